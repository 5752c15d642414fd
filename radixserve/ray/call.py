"""What the ingress hands a replica: one HTTP request, and its prompt for the router."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    method: str  # "GET" or "POST"
    path: str  # "/generate", "/v1/chat/completions", ...
    body: bytes  # as the client sent it
    content_type: str
    ids: list[int] | None  # the prompt's token ids as the replica will see them; None: unknown
    prompt: str  # the prompt as text (Ray's own prefix router reads this attribute)
