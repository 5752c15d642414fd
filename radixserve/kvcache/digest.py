"""The shared part of a prefix cache as block hashes (core/digest.py), for a router.

Breadth first from the shared root, so the blocks near the root (system prompts, few-shot
headers) are named first and a bounded digest keeps them. Each node carries the hash of the
last whole block above it and the ids after that block (fewer than `block`), so every cached
id is hashed once. A `DigestMemo` keeps each node's hashes from one digest to the next: a node
whose key and whose inputs from above are the same is not hashed again, so a digest of a cache
that changed little costs about a step per node, not per cached token. Salted parts (tenants,
`cache_salt`) are not named: a request of the shared part cannot reuse them. Reads the cache
only.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from radixserve.core.digest import block_hashes

if TYPE_CHECKING:
    from radixserve.kvcache.prefix_cache import PrefixCache
    from radixserve.kvcache.radix import TreeNode

MAX_BLOCKS = 1 << 16  # most hashes one digest may ask for (512 KiB)

# node id -> (its key, block, hash above it, ids carried into it, its hashes, ids carried out)
Entry = tuple[list[int], int, bytes, tuple[int, ...], list[bytes], tuple[int, ...]]


class DigestMemo:
    """Each node's hashes as the last digest made them. A node's key is never changed in
    place (a split gives it a new list), so the same key object means the same ids."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}


def cache_digest(
    cache: PrefixCache, block: int, max_blocks: int, memo: DigestMemo | None = None
) -> list[bytes]:
    """The hashes of the whole blocks on the cached paths of the shared part, at most
    `max_blocks`, shallow blocks first; `memo`: the hashes of the last digest, reused."""
    assert block >= 1 and 1 <= max_blocks <= MAX_BLOCKS, (block, max_blocks)
    old = memo.entries if memo is not None else {}
    new: dict[int, Entry] = {}
    out: list[bytes] = []
    # (node, hash of the last whole block above it, ids after that block)
    queue: deque[tuple[TreeNode, bytes, tuple[int, ...]]] = deque(
        (child, b"", ()) for child in cache.root.children.values()
    )
    while queue and len(out) < max_blocks:
        node, prev, carry = queue.popleft()
        entry = old.get(node.id)
        if entry is None or entry[0] is not node.key or entry[1:4] != (block, prev, carry):
            ids = [*carry, *node.key]
            hashes = block_hashes(ids, block, prev)
            entry = (node.key, block, prev, carry, hashes, tuple(ids[len(hashes) * block :]))
        new[node.id] = entry
        hashes, rest = entry[4], entry[5]
        out.extend(hashes[: max_blocks - len(out)])
        if hashes:
            prev = hashes[-1]
        queue.extend((child, prev, rest) for child in node.children.values())
    if memo is not None:
        memo.entries = new
    return out
