"""The router's approximate radix tree: which prompts one worker was sent, by character.

It only approximates the worker's real radix cache (which holds token ids and evicts under
its own KV pressure): the router never sees the worker's cache, only what it sent there.
Keys are strings (a text prompt, or token ids as `ids_key` spells them); edges are compressed
(a node's label is a run of characters), children are keyed by their label's first
character. Every insert stamps the nodes on its path with a tick from a counter, so a parent
is never older than its children; pruning removes least recently stamped leaves (a node
whose children are all gone becomes a leaf in turn) until the size fits the budget.

    root ── "You are a helpful" ──┬── " assistant. Q1" (tick 3)
                                  └── " bot. Q2"        (tick 5)   size = 17 + 14 + 8
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


def ids_key(ids: Iterable[int]) -> str:
    """Token ids as a tree key, one character per id (ids beyond the 0x110000 code points
    wrap: the tree is approximate anyway), so prefixes of ids are prefixes of keys."""
    return "".join(chr(int(i) % 0x110000) for i in ids)


class _Node:
    __slots__ = ("children", "label", "parent", "tick")

    def __init__(self, label: str, parent: _Node | None, tick: int) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tick = tick


class PrefixTree:
    """The prompts sent to one worker. `size` = characters held (the sum of the labels)."""

    def __init__(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0
        self._tick = 0

    def held(self) -> int:
        """How much of the worker's cache these prompts take, in characters (ids)."""
        return self.size

    def match(self, key: str) -> int:
        """Length of the longest prefix of `key` held in the tree. Changes nothing."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            common = _common_len(child.label, key, pos)
            pos += common
            if common < len(child.label):
                break
            node = child
        return pos

    def insert(self, key: str) -> None:
        """Add `key` (splitting an edge where it leaves one) and stamp its whole path."""
        self._tick += 1
        node, pos = self.root, 0
        node.tick = self._tick
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = _Node(key[pos:], node, self._tick)
                self.size += len(key) - pos
                return
            common = _common_len(child.label, key, pos)
            if common < len(child.label):
                child = self._split(child, common)
            child.tick = self._tick
            node, pos = child, pos + common

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s label at `at`: a new middle node holds the first part."""
        assert 0 < at < len(child.label), (at, child.label)
        parent = child.parent
        assert parent is not None
        mid = _Node(child.label[:at], parent, child.tick)
        parent.children[mid.label[0]] = mid
        child.label, child.parent = child.label[at:], mid
        mid.children[child.label[0]] = child
        return mid

    def prune(self, budget: int) -> int:
        """Remove least recently inserted leaves until `size <= budget`; characters freed."""
        if self.size <= budget:
            return 0
        before = self.size
        leaves = [(n.tick, id(n), n) for n in self._nodes() if not n.children and n.parent]
        heapq.heapify(leaves)
        while self.size > budget and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            if not parent.children and parent.parent is not None:
                heapq.heappush(leaves, (parent.tick, id(parent), parent))
        return before - self.size

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Labels non-empty and keyed by their first character, parents linked and never
        older than their children, size the sum of the labels."""
        total = 0
        for node in self._nodes():
            total += len(node.label)
            for first, child in node.children.items():
                assert child.label and child.label[0] == first, (first, child.label)
                assert child.parent is node, "child's parent link is wrong"
                assert child.tick <= node.tick, (child.tick, node.tick)
        assert total == self.size, (total, self.size)


def _common_len(label: str, key: str, pos: int) -> int:
    """Characters `label` shares with `key[pos:]` from their start."""
    if key.startswith(label, pos):  # the common case: the whole edge matches
        return len(label)
    n = min(len(label), len(key) - pos)
    i = 0
    while i < n and label[i] == key[pos + i]:
        i += 1
    return i
