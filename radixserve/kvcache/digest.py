"""The shared part of a prefix cache as block hashes (core/digest.py), for a router.

Breadth first from the shared root, so the blocks near the root (system prompts, few-shot
headers) are named first and a bounded digest keeps them. Each node carries the hash of the
last whole block above it and the ids after that block (fewer than `block`), so every cached
id is hashed once: O(cached tokens). Salted parts (tenants, `cache_salt`) are not named: a
request of the shared part cannot reuse them. Reads the cache only.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from radixserve.core.digest import block_hashes

if TYPE_CHECKING:
    from radixserve.kvcache.prefix_cache import PrefixCache
    from radixserve.kvcache.radix import TreeNode

MAX_BLOCKS = 1 << 16  # most hashes one digest may ask for (512 KiB)


def cache_digest(cache: PrefixCache, block: int, max_blocks: int) -> list[bytes]:
    """The hashes of the whole blocks on the cached paths of the shared part, at most
    `max_blocks`, shallow blocks first."""
    assert block >= 1 and 1 <= max_blocks <= MAX_BLOCKS, (block, max_blocks)
    out: list[bytes] = []
    # (node, hash of the last whole block above it, ids after that block)
    queue: deque[tuple[TreeNode, bytes, list[int]]] = deque(
        (child, b"", []) for child in cache.root.children.values()
    )
    while queue and len(out) < max_blocks:
        node, prev, carry = queue.popleft()
        ids = carry + list(node.key)
        hashes = block_hashes(ids, block, prev)
        out.extend(hashes[: max_blocks - len(out)])
        if hashes:
            prev = hashes[-1]
        rest = ids[len(hashes) * block :]
        queue.extend((child, prev, rest) for child in node.children.values())
    return out
