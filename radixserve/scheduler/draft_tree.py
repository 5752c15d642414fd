"""Token trees of speculative decoding: what may follow a sample's last token, verified in
one step.

A tree's nodes are draft tokens, each under its parent: another node, or the sample's last
token (ROOT). A node's path is its ancestors and itself; feeding it costs one token row,
which attends to the sample's sequence and the node's path. A chain is a tree where each
node is under the one before. Nodes come parents first, and no two children of one parent
hold the same token, so a drawn token continues at most one branch.

`weighted_tree` builds the tree from continuations the drafters found (several cached
samples of one prompt that took different branches, several earlier occurrences of the
sample's last tokens followed by different text): it merges them into a trie, estimates
each node's chance of being kept as the share of the continuations that go through it, and
keeps the k likeliest nodes (no node is likelier than its parent, so they form a tree).
A node's chance is what it adds to the tokens a step is expected to keep, so under these
estimates no other tree of k nodes keeps more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = -1  # the parent of a node right after the sample's last token


@dataclass
class Draft:
    """A token tree: node i is `tokens[i]` under node `parents[i]` (< i, or ROOT)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(init=False, default_factory=list)  # 1 for ROOT's children

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents), "a parent for each token"
        assert all(ROOT <= p < i for i, p in enumerate(self.parents)), self.parents
        self.depths = []
        for p in self.parents:
            self.depths.append(1 if p == ROOT else self.depths[p] + 1)
        seen = set(zip(self.parents, self.tokens))
        assert len(seen) == len(self.tokens), "two children of one parent hold one token"

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> Draft:
        return cls(list(tokens), list(range(ROOT, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Tokens on its longest path: the most a step keeps of it."""
        return max(self.depths, default=0)

    def path(self, node: int) -> list[int]:
        """`node`'s ancestors and itself, from ROOT's child down."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def child(self, parent: int, token: int) -> int | None:
        """The node holding `token` under `parent`, if any."""
        for i in range(parent + 1, len(self.tokens)):
            if self.parents[i] == parent and self.tokens[i] == token:
                return i
        return None


def weighted_tree(continuations: Sequence[Sequence[int]], k: int, topk: int) -> Draft:
    """The k nodes of the trie of `continuations` that the most of them go through, at most
    `topk` under one parent (module docstring); among equal ones, those of earlier
    continuations first."""
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []  # continuations through each trie node
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> trie node
    for seq in continuations:
        at = ROOT
        for token in seq:
            nxt = children.setdefault((at, token), len(tokens))
            if nxt == len(tokens):
                tokens.append(token)
                parents.append(at)
                counts.append(0)
            counts[nxt] += 1
            at = nxt
    # a node's count is at most its parent's, and it comes later: parents first
    return likeliest(tokens, parents, [-c for c in counts], k, topk)


def likeliest(tokens: list[int], parents: list[int], cost: list[float], k: int, topk: int) -> Draft:
    """The tree of the k nodes of lowest `cost` (the earlier of equal ones) of a larger
    tree, at most `topk` under one parent; no node may cost less than its parent."""
    index: dict[int, int] = {ROOT: ROOT}  # a kept node's index in the draft
    branches = dict.fromkeys(range(ROOT, len(tokens)), 0)  # kept nodes under each
    kept: list[int] = []
    for node in sorted(range(len(tokens)), key=lambda i: (cost[i], i)):
        if len(kept) >= k:
            break
        parent = parents[node]
        if parent in index and branches[parent] < topk:
            branches[parent] += 1
            index[node] = len(kept)
            kept.append(node)
    return Draft([tokens[n] for n in kept], [index[parents[n]] for n in kept])
