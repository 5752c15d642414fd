"""A bounded, read-only snapshot of a prefix cache's tree for the web console.

Breadth first from the root, so the shared nodes near the root (system prompts, few-shot
headers) are always in it; `max_nodes` and `max_depth` bound the work and the answer: the
walk stops once they are reached, so a tree of any size costs O(max_nodes + their children).
`snapshot` is what `/cache_tree` answers: the nodes, marked with the running samples' paths
and the nodes the last step batched, and the cache's sizes beside the scheduler's stats.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from radixserve.core.info import CacheNodeView, CacheTreeView, SchedulerStats
from radixserve.kvcache.radix import TreeNode

if TYPE_CHECKING:  # the api server imports this module's limits: not the caches' imports
    from radixserve.kvcache.prefix_cache import PrefixCache

MAX_NODES = 2000  # most nodes one snapshot may ask for
MAX_DEPTH = 64
PREVIEW_TOKENS = 16  # tokens of each node the view shows


def snapshot(
    cache: PrefixCache,
    max_nodes: int,
    max_depth: int,
    running: Iterable[TreeNode],
    batched: set[int],
    stats: SchedulerStats,
    attention_backend: str,
) -> CacheTreeView:
    """The view of `cache` (see `view_tree`), its nodes marked with how many of the running
    samples' paths (`running`: their last nodes) pass through them and whether the last
    step's tree attention batched them (`batched`: node ids). Reads the cache only."""
    nodes, truncated = view_tree(
        cache.root, max_nodes, max_depth, PREVIEW_TOKENS, running_counts(running), batched
    )
    return CacheTreeView(
        nodes=nodes,
        total_nodes=cache.num_nodes,
        truncated=truncated,
        cached_tokens=cache.total_size,
        evictable_tokens=cache.evictable_size,
        locked_tokens=cache.locked_size,
        stats=stats,
        attention_backend=attention_backend,
    )


def running_counts(last_nodes: Iterable[TreeNode]) -> Counter[int]:
    """node id -> how many of these samples' cached paths pass through it (root excluded)."""
    counts: Counter[int] = Counter()
    for node in last_nodes:
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None:
            counts[walk.id] += 1
            walk = walk.parent
    return counts


def view_tree(
    root: TreeNode,
    max_nodes: int,
    max_depth: int,
    preview_tokens: int,
    running: Counter[int],
    batched: set[int],
) -> tuple[list[CacheNodeView], bool]:
    """(views of at most `max_nodes` nodes within `max_depth` of the root, breadth first;
    whether any node was left out)."""
    assert 1 <= max_nodes <= MAX_NODES and 0 <= max_depth <= MAX_DEPTH, (max_nodes, max_depth)
    views: list[CacheNodeView] = []
    truncated = False
    queue: deque[tuple[TreeNode, int, int]] = deque([(root, -1, 0)])
    while queue:
        if len(views) == max_nodes:
            return views, True
        node, parent, depth = queue.popleft()
        views.append(
            CacheNodeView(
                id=node.id,
                parent=parent,
                depth=depth,
                num_tokens=len(node.key),
                preview_ids=node.key[:preview_tokens],
                lock_ref=node.lock_ref,
                num_children=len(node.children),
                running=running.get(node.id, 0),
                batched=node.id in batched,
                tier="device",
            )
        )
        if depth == max_depth:
            truncated = truncated or bool(node.children)
        else:
            queue.extend((child, node.id, depth + 1) for child in node.children.values())
    return views, truncated
