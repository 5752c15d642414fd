"""Where token runs occur in the radix cache: the suffix lookup of speculative decoding.

Every cached position p with ORDER - 1 positions before it on its path is filed under the
ORDER tokens ending at p, as (the node holding p, p's depth). The cache keeps the index in
step with the tree: a new leaf files its positions, a split moves the upper half's to the
new node, an evicted leaf takes its own away, a flush empties it. Depths never change, so
an entry needs no update when the node holding it changes shape.

`lookup` finds where the end of a sequence occurs in the cache: of the latest CANDIDATES
positions filed under its last ORDER tokens, the one whose match with the sequence's end is
longest (up to MAX_MATCH tokens, then the most recently used), and returns the cached
tokens after it, down the most recently used branch. What it matches may be any sequence
the cache holds: another request's answer, another sample's, the same text under another
prefix (a system prompt that names the date), the sample's own prompt.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.kvcache.radix import TreeNode

ORDER = 3  # tokens a position is filed under: the shortest match a lookup returns
MAX_MATCH = 8  # tokens a candidate's match is scored on
CANDIDATES = 16  # latest positions under the sequence's last ORDER tokens that are scored

Entries = dict[tuple[int, int], "TreeNode"]  # (node id, depth) -> the node


def start_depth(node: TreeNode) -> int:
    """The depth of `node`'s first token: the tokens on the path above it."""
    depth, up = 0, node.parent
    while up is not None:
        depth += len(up.key)
        up = up.parent
    return depth


def tokens_before(node: TreeNode, offset: int) -> Iterator[int]:
    """The path's tokens from `node.key[offset]` back towards the root."""
    at: TreeNode | None = node
    while at is not None:
        yield from reversed(at.key[: offset + 1])
        at = at.parent
        offset = len(at.key) - 1 if at is not None else 0


class SuffixIndex:
    """The cache's positions by the ORDER tokens ending at each (module docstring)."""

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], Entries] = {}

    def __len__(self) -> int:
        return sum(len(e) for e in self.ends.values())

    def _filed(self, node: TreeNode, start: int, end: int) -> Iterator[tuple[tuple[int, ...], int]]:
        """(ORDER tokens, depth) of `node`'s positions start .. end - 1 (depths) that have
        ORDER - 1 positions before them."""
        first = start_depth(node)
        before = list(islice(tokens_before(node, start - first - 1), ORDER - 1))[::-1]
        run = before + node.key[start - first : end - first]
        for i in range(ORDER - 1, len(run)):
            yield tuple(run[i - ORDER + 1 : i + 1]), start - len(before) + i

    def add(self, node: TreeNode) -> None:
        """File the positions of `node`, a new leaf."""
        first = start_depth(node)
        for key, depth in self._filed(node, first, first + len(node.key)):
            self.ends.setdefault(key, {})[(node.id, depth)] = node

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """`upper` took the first part of `lower`'s positions: move their entries to it."""
        first = start_depth(upper)
        for key, depth in self._filed(upper, first, first + len(upper.key)):
            entries = self.ends[key]
            del entries[(lower.id, depth)]
            entries[(upper.id, depth)] = upper

    def remove(self, leaf: TreeNode) -> None:
        """Forget the positions of `leaf`, still in the tree, about to be evicted."""
        first = start_depth(leaf)
        for key, depth in self._filed(leaf, first, first + len(leaf.key)):
            entries = self.ends[key]
            del entries[(leaf.id, depth)]
            if not entries:
                del self.ends[key]

    def clear(self) -> None:
        self.ends.clear()

    def check(self, nodes: Iterator[TreeNode]) -> None:
        """Assert that the index files exactly the positions of `nodes` (the whole tree)."""
        want: dict[tuple[int, ...], set[tuple[int, int]]] = {}
        for node in nodes:
            first = start_depth(node)
            for key, depth in self._filed(node, first, first + len(node.key)):
                want.setdefault(key, set()).add((node.id, depth))
        have = {key: set(entries) for key, entries in self.ends.items()}
        for entries in self.ends.values():
            assert all(n.id == i for (i, _), n in entries.items()), "an entry names another node"
        assert have == want, f"suffix index: {len(have)} keys filed, the tree has {len(want)}"

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """(match length, up to `max_tokens` tokens that followed it) for the best cached
        occurrence of the end of `token_ids` (module docstring); (0, []) for none."""
        if len(token_ids) < ORDER or max_tokens <= 0:
            return 0, []
        entries = self.ends.get(tuple(token_ids[-ORDER:]))
        if not entries:
            return 0, []
        best: tuple[int, float] = (0, 0.0)
        found: list[int] = []
        for (_, depth), node in islice(reversed(entries.items()), CANDIDATES):
            offset = depth - start_depth(node)
            after = _after(node, offset, max_tokens)
            if not after:
                continue
            m = 0
            for m, token in enumerate(tokens_before(node, offset)):
                if m == MAX_MATCH or m == len(token_ids) or token_ids[-1 - m] != token:
                    break
            else:
                m += 1
            score = (m, node.last_access)
            if score > best:
                best, found = score, after
        return best[0], found


def _after(node: TreeNode, offset: int, max_tokens: int) -> list[int]:
    """Up to `max_tokens` cached tokens after `node.key[offset]`, down the most recently
    used branch."""
    out = node.key[offset + 1 : offset + 1 + max_tokens]
    while len(out) < max_tokens and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out.extend(node.key[: max_tokens - len(out)])
    return out
