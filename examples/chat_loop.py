"""A multi-turn chat: each turn re-runs the conversation as a program; the radix cache
finds the earlier turns already computed, so a turn costs only its new tokens. Replies
stream as they are generated.

    python examples/chat_loop.py                    # scripted turns, embedded model
    python examples/chat_loop.py -i                 # type your own turns (empty line ends)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import radixserve.frontend as rs

SYSTEM = "You are a friendly assistant. Keep answers short."
SCRIPT = [
    "Hi! What is the capital of France?",
    "And what is it famous for?",
    "Thanks. Say goodbye in French.",
]
ROLES = {"system": rs.system, "user": rs.user, "assistant": rs.assistant}


@rs.function
def chat_turn(s, history, message, max_tokens=64):  # noqa: ANN001, ANN201
    for m in history:
        s += ROLES[m["role"]](m["content"])
    s += rs.user(message)
    s += rs.assistant(rs.gen("reply", max_tokens=max_tokens, temperature=0))


@dataclass
class Turn:
    user: str
    reply: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the radix cache (the earlier turns)


@dataclass
class ChatSession:
    backend: Any = None
    system: str = SYSTEM
    max_tokens: int = 64
    turns: list[Turn] = field(default_factory=list)
    history: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history = [{"role": "system", "content": self.system}]

    def say(self, message: str, on_text: Callable[[str], None] | None = None) -> Turn:
        state = chat_turn.run(
            self.history, message, self.max_tokens, backend=self.backend, stream=True
        )
        for piece in state.text_iter("reply"):
            if on_text is not None:
                on_text(piece)
        reply = state["reply"]
        meta = state.get_meta_info("reply")
        self.history = state.messages()
        turn = Turn(message, reply, meta["prompt_tokens"], meta["cached_tokens"])
        self.turns.append(turn)
        return turn


def main(backend: Any = None, messages: Iterable[str] | None = None) -> ChatSession:
    session = ChatSession(backend or rs.EngineBackend())
    for message in messages if messages is not None else SCRIPT:
        print(f"user: {message}\nassistant: ", end="", flush=True)
        turn = session.say(message, lambda piece: print(piece, end="", flush=True))
        print(f"\n    ({turn.cached_tokens}/{turn.prompt_tokens} prompt tokens cached)\n")
    return session


def _typed_turns() -> Iterable[str]:
    while line := input("> ").strip():
        yield line


if __name__ == "__main__":
    main(messages=_typed_turns() if "-i" in sys.argv[1:] else None)
