"""The one codec: msgpack via msgspec, typed by the `AnyMessage` union.

`decode` raises `msgspec.ValidationError` / `msgspec.DecodeError` on bytes that are not a
well-formed message of our vocabulary; no other Python object can come out of it.
"""

from __future__ import annotations

import msgspec

from radixserve.message.messages import AnyMessage, Message

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> AnyMessage:
    return _decoder.decode(data)
