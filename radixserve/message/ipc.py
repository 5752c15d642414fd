"""ZeroMQ plumbing shared by the processes: a private socket folder, inboxes and outboxes.

Topology: every process binds exactly ONE PULL socket (its inbox) and connects PUSH sockets
to the inboxes it talks to. PUSH/PULL keeps per-sender order, which the protocol relies on
(a request's ScheduleReq always reaches the scheduler before its AbortReq).

The folder is created with mode 0700 (tempfile.mkdtemp) so that no other local user can
connect to the sockets; `remove_ipc_dir` deletes it on shutdown.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass

import zmq

from radixserve.message.codec import decode, encode
from radixserve.message.messages import AnyMessage, Message


@dataclass(frozen=True)
class IpcPaths:
    root: str  # the private folder holding the three unix sockets

    @property
    def api(self) -> str:
        return f"ipc://{self.root}/api"

    @property
    def tokenizer(self) -> str:
        return f"ipc://{self.root}/tokenizer"

    @property
    def scheduler(self) -> str:
        return f"ipc://{self.root}/scheduler"


def make_ipc_dir() -> IpcPaths:
    root = tempfile.mkdtemp(prefix="radixserve-")
    mode = stat.S_IMODE(os.stat(root).st_mode)
    assert mode == 0o700, f"socket folder {root} has mode {oct(mode)}, expected 0o700"
    return IpcPaths(root)


def remove_ipc_dir(paths: IpcPaths) -> None:
    shutil.rmtree(paths.root, ignore_errors=True)


class Inbox:
    """The process's bound PULL socket. Not thread-safe (one reader)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)

    def recv(self, timeout_ms: int | None) -> AnyMessage | None:
        """Block up to `timeout_ms` (None: forever) for one message; None on timeout."""
        if self.sock.poll(timeout_ms) == 0:
            return None
        return decode(self.sock.recv())

    def recv_all_nowait(self) -> list[AnyMessage]:
        """Every message already queued, without blocking (possibly none)."""
        out: list[AnyMessage] = []
        while True:
            try:
                out.append(decode(self.sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.sock.close(linger=0)


class Outbox:
    """A PUSH socket connected to another process's inbox."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def close(self) -> None:
        self.sock.close(linger=0)
