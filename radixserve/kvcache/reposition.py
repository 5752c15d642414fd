"""Positional decoupling (opt-in, `--hicache-reposition`): K/V of a token run reused at
another position than the one it was computed at.

When a conversation outgrows the context window and its oldest turns are dropped, the next
prompt is [kept prefix] + [turns k..n] + [new message]: the tree matches the kept prefix
(the system prompt) only, yet turns k..n were computed before, at other positions, and are
still in the pool or a lower tier under the old conversation's keys. This module finds them:

    old sequence  O:  |  system  | turn 1 ... turn k-1 | turn k ... turn n |
                                                        a0                  a0 + n
    new prompt    N:  |  system  | turn k ... turn n | new message |
                                 q                    q + n
    N[q : q + n] == O[a0 : a0 + n]; their K/V is O's, moved by delta = q - a0 positions.

Finding O and a0 (`RunIndex`): every sequence the cache is offered is indexed by the
content of its W-token windows at offsets 0, W, 2W, ... (no position in the key) and by its
`CacheSalt`: a run is found only under the salt it was offered with. A run of
N starting at q that O holds at a0 contains one of O's windows within its first W tokens
(offset s, q <= s < q + W, O's window at a = a0 + s - q), so `find` looks up the W windows
of N starting at q .. q + W - 1, checks the tokens between q and s against O's before a,
and extends the run forward as far as the tokens agree. Every hit is checked token by token:
the index only proposes.

Moving K/V: values carry no position; RoPE turns a key at position p by the angles p * f
(f: the model's inverse frequencies, rotate-half layout), so turning a stored key by
delta * f gives the key RoPE'd at p + delta (rotations compose; equal up to float rounding).
Keys stay stored after RoPE: the tiers and their exact path are untouched, and only a moved
run pays the rotation (in float32, rounded back to the pool's dtype).

The approximation: a moved run's K/V is what its tokens computed while attending to the
dropped turns, not what they would compute now; that is why it is opt-in. Quality cost:
docs/benchmarks.md (bench_multiturn.py --context-budget).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.core.request import SHARED, CacheSalt

WINDOW = 16  # tokens per indexed window; also the shortest run worth moving


def rotate_keys(k: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys RoPE'd at position p -> the same keys RoPE'd at p + delta (rotate-half layout).

    k (..., D) any float dtype; inv_freq (D/2,) float32, the model's (scaling applied).
    Returns a new tensor in k's dtype, computed in float32."""
    d = k.shape[-1]
    assert inv_freq.shape == (d // 2,), f"inv_freq {tuple(inv_freq.shape)} for head_dim {d}"
    angles = delta * inv_freq.double()  # float64 angles: exact for any context length
    cos, sin = angles.cos().float(), angles.sin().float()
    cos2, sin2 = torch.cat((cos, cos)), torch.cat((-sin, sin))  # (D,): [cos|cos], [-sin|sin]
    x = k.float()
    swapped = torch.cat((x[..., d // 2 :], x[..., : d // 2]), dim=-1)  # [x2 | x1]
    return (x * cos2 + swapped * sin2).to(k.dtype)


@dataclass(frozen=True)
class Run:
    """tokens[q : q + length] of a new prompt == old[start : start + length]."""

    old: list[int]  # the indexed sequence holding the run (its K/V is under its keys)
    start: int  # a0: where the run starts in `old`
    length: int


class RunIndex:
    """Position-independent index over the token sequences a cache was offered.

    `add(tokens, salt)` indexes the sequence's windows at offsets 0, W, 2W, ... (a window's
    last sequence wins: a conversation's longer sequences replace its shorter ones, which
    are then freed); `find(tokens, q, salt)` returns the longest run indexed under `salt`
    equal to tokens[q:] that starts exactly at q, or None. Bounded: at most
    `max_tokens // W` windows, least recently added or found dropped first.
    Single-threaded, like the cache that owns it.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_windows = max(max_tokens // WINDOW, 1)
        # (salt, window tokens) -> (the sequence holding it, the window's offset there)
        self._windows: OrderedDict[tuple[CacheSalt, tuple[int, ...]], tuple[list[int], int]]
        self._windows = OrderedDict()

    def __len__(self) -> int:
        return len(self._windows)

    def clear(self) -> None:
        self._windows.clear()

    def add(self, tokens: Sequence[int], salt: CacheSalt = SHARED) -> None:
        seq = list(tokens)
        for a in range(0, len(seq) - WINDOW + 1, WINDOW):
            window = (salt, tuple(seq[a : a + WINDOW]))
            self._windows[window] = (seq, a)
            self._windows.move_to_end(window)
        while len(self._windows) > self.max_windows:
            self._windows.popitem(last=False)

    def find(self, tokens: Sequence[int], q: int, salt: CacheSalt = SHARED) -> Run | None:
        """The longest run tokens[q : q + n] (n >= WINDOW) some sequence indexed under
        `salt` holds."""
        best: Run | None = None
        for s in range(q, min(q + WINDOW, len(tokens) - WINDOW + 1)):
            window = (salt, tuple(tokens[s : s + WINDOW]))
            hit = self._windows.get(window)
            if hit is None:
                continue
            old, a = hit
            a0 = a - (s - q)
            if a0 < 0 or old[a0:a] != list(tokens[q:s]):
                continue
            self._windows.move_to_end(window)
            n = _common_run(old, a0, tokens, q)
            if best is None or n > best.length:
                best = Run(old, a0, n)
        return best


class Mover:
    """A HiCache's positional decoupling: the run index and the model's RoPE frequencies
    (inv_freq (D/2,) float32, the model's `rope_inv_freq`)."""

    def __init__(self, index: RunIndex, inv_freq: torch.Tensor) -> None:
        self.index = index
        self.inv_freq = inv_freq
        self.moved_tokens = 0  # tokens served by moved runs since start

    def move(self, rows: torch.Tensor, delta: int) -> torch.Tensor:
        """K/V rows (layers, 2, T, kv_heads, D) computed at positions p -> a new tensor of
        the rows at p + delta: keys turned by delta, values as they are."""
        keys = rotate_keys(rows[:, 0], delta, self.inv_freq)
        return torch.stack((keys, rows[:, 1]), dim=1)


def _common_run(a: list[int], i: int, b: Sequence[int], j: int) -> int:
    """Length of the longest common prefix of a[i:] and b[j:]."""
    n = 0
    for x, y in zip(a[i:], b[j:], strict=False):  # the shorter one ends the run
        if x != y:
            break
        n += 1
    return n
