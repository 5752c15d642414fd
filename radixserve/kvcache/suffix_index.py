"""Where token runs occur in the radix cache: the suffix lookup of speculative decoding.

Every cached position p with ORDER - 1 positions before it on its path is filed under the
ORDER tokens ending at p, as (the node holding p, p's depth). The cache keeps the index in
step with the tree: a new leaf files its positions, a split moves the upper half's to the
new node, an evicted leaf takes its own away, a flush empties it. Depths never change, so
an entry needs no update when the node holding it changes shape.

Positions are filed per part of the cache (radix.py): a filing key holds the id of the root
of the node's part, so a lookup under one salt never sees another part's positions.

`lookup` finds where the end of a sequence occurs in the cache: of the latest CANDIDATES
positions filed under its last ORDER tokens, those whose match with the sequence's end is
longest (up to MAX_MATCH tokens), and returns the cached tokens after each, down the most
recently used branch, the most recently used position first. What it matches may be any
sequence the cache holds: another request's answer, another sample's, the same text under
another prefix (a system prompt that names the date), the sample's own prompt.
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
TOKEN_BITS = 21  # a filing key packs ORDER token ids of this many bits (vocabularies < 2M)
TOKEN_MASK = (1 << TOKEN_BITS) - 1
GRAM_MASK = (1 << TOKEN_BITS * ORDER) - 1
DEPTH_BITS = 32  # a position packs (node id, depth) as id << DEPTH_BITS | depth
ROOT_BITS = 64  # a filing key packs (run, root id) as gram << ROOT_BITS | root id

# A run of ORDER tokens, packed: its positions, one int or a dict of them in filing order.
# Ints, so that the garbage collector has no object a position to walk (a dict only for
# runs filed more than once).
Filed = dict[int, "int | dict[int, None]"]


def gram(tokens: Sequence[int], top: TreeNode) -> int:
    """ORDER token ids of the part under root `top` as one int: the low TOKEN_BITS bits of
    each (a key may stand for other runs if an id has more bits: lookups compare tokens;
    never for another part: its low ROOT_BITS bits are the root's id)."""
    key = 0
    for t in tokens:
        key = key << TOKEN_BITS | t & TOKEN_MASK
    return key << ROOT_BITS | top.id


def last_tokens(node: TreeNode | None, n: int) -> list[int]:
    """The last `n` tokens of the path from the root down to `node` (all, if fewer)."""
    out: list[int] = []
    while node is not None and len(out) < n:
        out = node.key[len(out) - n :] + out
        node = node.parent
    return out


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
        self.ends: Filed = {}
        self.nodes: dict[int, TreeNode] = {}  # by id, the nodes positions are filed in

    def __len__(self) -> int:
        return sum(1 if isinstance(e, int) else len(e) for e in self.ends.values())

    def _filed(self, node: TreeNode) -> Iterator[tuple[int, int]]:
        """(key, packed position) of `node`'s positions that have ORDER - 1 positions before
        them: each key is `gram` of the run ending there, rolled on one token at a time."""
        before = last_tokens(node.parent, ORDER - 1)
        top = node.top.id
        key, keys = 0, []
        for i, t in enumerate(before + node.key):
            key = (key << TOKEN_BITS | t & TOKEN_MASK) & GRAM_MASK
            if i >= ORDER - 1:
                keys.append(key << ROOT_BITS | top)
        base = (node.id << DEPTH_BITS) + start_depth(node)
        return zip(keys, range(base - len(before) + ORDER - 1, base + len(node.key)))

    def _file(self, key: int, at: int) -> None:
        filed = self.ends.get(key)
        if filed is None:
            self.ends[key] = at
        elif isinstance(filed, int):
            self.ends[key] = {filed: None, at: None}
        else:
            filed[at] = None

    def _unfile(self, key: int, at: int) -> None:
        filed = self.ends[key]
        if isinstance(filed, int):
            assert filed == at, f"position {at} not filed under {key}"
            del self.ends[key]
            return
        del filed[at]
        if len(filed) == 1:
            self.ends[key] = next(iter(filed))

    def add(self, node: TreeNode) -> None:
        """File the positions of `node`, a new leaf."""
        self.nodes[node.id] = node
        for key, at in self._filed(node):
            self._file(key, at)

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """`upper` took the first part of `lower`'s positions: move their entries to it."""
        self.nodes[upper.id] = upper
        moved = (lower.id - upper.id) << DEPTH_BITS
        for key, at in self._filed(upper):
            self._unfile(key, at + moved)
            self._file(key, at)

    def remove(self, leaf: TreeNode) -> None:
        """Forget the positions of `leaf`, still in the tree, about to be evicted."""
        for key, at in self._filed(leaf):
            self._unfile(key, at)
        del self.nodes[leaf.id]

    def clear(self) -> None:
        self.ends.clear()
        self.nodes.clear()

    def check(self, nodes: Iterator[TreeNode]) -> None:
        """Assert that the index files exactly the positions of `nodes` (the whole tree)."""
        want: dict[int, set[int]] = {}
        live: dict[int, TreeNode] = {}
        for node in nodes:
            if node.parent is not None:
                live[node.id] = node
            for key, at in self._filed(node):
                want.setdefault(key, set()).add(at)
        have = {k: {e} if isinstance(e, int) else set(e) for k, e in self.ends.items()}
        assert have == want, f"suffix index: {len(have)} keys filed, the tree has {len(want)}"
        assert self.nodes == live, f"suffix index: {len(self.nodes)} nodes, the tree {len(live)}"

    def lookup(
        self, token_ids: Sequence[int], max_tokens: int, top: TreeNode
    ) -> tuple[int, list[list[int]]]:
        """(match length, up to `max_tokens` tokens that followed each) for the best cached
        occurrences of the end of `token_ids` in the part under root `top` (module
        docstring); (0, []) for none."""
        if len(token_ids) < ORDER or max_tokens <= 0:
            return 0, []
        filed = self.ends.get(gram(token_ids[-ORDER:], top))
        if filed is None:
            return 0, []
        latest = [filed] if isinstance(filed, int) else islice(reversed(filed), CANDIDATES)
        found: list[tuple[int, float, list[int]]] = []  # (match, last use, continuation)
        depth_mask = (1 << DEPTH_BITS) - 1
        for at in latest:
            node = self.nodes[at >> DEPTH_BITS]
            offset = (at & depth_mask) - start_depth(node)
            after = cached_branches(node, offset, max_tokens, 1)[0]
            if not after:
                continue
            m = 0
            for m, token in enumerate(tokens_before(node, offset)):
                if m == MAX_MATCH or m == len(token_ids) or token_ids[-1 - m] != token:
                    break
            else:
                m += 1
            if m >= ORDER:
                found.append((m, node.last_access, after))
        if not found:
            return 0, []
        best = max(m for m, _, _ in found)
        found.sort(key=lambda f: f[1], reverse=True)
        return best, [after for m, _, after in found if m == best]


def cached_branches(node: TreeNode, offset: int, max_tokens: int, limit: int) -> list[list[int]]:
    """The cached continuations after `node.key[offset]` (`offset` -1: from the node's first
    token), one a branch, up to `limit` of them, each up to `max_tokens` tokens; the most
    recently used branch first."""
    out = node.key[offset + 1 : offset + 1 + max_tokens]
    if len(out) == max_tokens or not node.children:
        return [out]
    found: list[list[int]] = []
    for child in sorted(node.children.values(), key=lambda c: c.last_access, reverse=True):
        for rest in cached_branches(child, -1, max_tokens - len(out), limit - len(found)):
            found.append(out + rest)
        if len(found) == limit:
            break
    return found
