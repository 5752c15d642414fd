"""A bounded, read-only snapshot of a prefix cache's tree for the web console.

Breadth first from the root, so the shared nodes near the root (system prompts, few-shot
headers) are always in it; `max_nodes` and `max_depth` bound the work and the answer: the
walk stops once they are reached, so a tree of any size costs O(max_nodes + their children).
`snapshot` is what `/cache_tree` answers: the nodes, marked with the running samples' paths
and the nodes the last step batched, and the cache's sizes beside the scheduler's stats.

Parts (kvcache/radix.py): the root of every salted part is shown as a child of the shared
root, with no tokens and its salt. A snapshot scoped to a tenant holds only the parts of that
tenant's salts, and counts only what it shows (the rest of the cache is other tenants').
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
    tenant: str | None = None,
) -> CacheTreeView:
    """The view of `cache` (see `view_tree`), its nodes marked with how many of the running
    samples' paths (`running`: their last nodes) pass through them and whether the last
    step's tree attention batched them (`batched`: node ids); only the parts of `tenant`'s
    salts when it is set (module docstring). Reads the cache only."""
    root = cache.root
    parts = [r for s, r in cache.roots().items() if r is not root]
    if tenant is None:
        below = [*root.children.values(), *parts]
    else:
        below = [r for r in parts if r.salt.tenant == tenant]
    counts = running_counts(running)
    nodes, truncated = view_tree(root, max_nodes, max_depth, PREVIEW_TOKENS, counts, batched, below)
    if tenant is not None:
        return _scoped(nodes, truncated, stats, attention_backend, tenant)
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


def _scoped(
    nodes: list[CacheNodeView],
    truncated: bool,
    stats: SchedulerStats,
    attention_backend: str,
    tenant: str,
) -> CacheTreeView:
    """A tenant's view: its nodes, counted as shown; of the stats, the capacity only."""
    tokens = sum(n.num_tokens for n in nodes)
    locked = sum(n.num_tokens for n in nodes if n.lock_ref > 0)
    blank = SchedulerStats(0, 0, 0, stats.kv_capacity_tokens, 0, 0, 0, 0, 0)
    return CacheTreeView(
        nodes=nodes,
        total_nodes=len(nodes),
        truncated=truncated,
        cached_tokens=tokens,
        evictable_tokens=tokens - locked,
        locked_tokens=locked,
        stats=blank,
        attention_backend=attention_backend,
        tenant=tenant,
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
    below: list[TreeNode] | None = None,
) -> tuple[list[CacheNodeView], bool]:
    """(views of at most `max_nodes` nodes within `max_depth` of `root`, breadth first;
    whether any node was left out). `below`: what `root` is shown with as its children
    (default: its own)."""
    assert 1 <= max_nodes <= MAX_NODES and 0 <= max_depth <= MAX_DEPTH, (max_nodes, max_depth)
    views: list[CacheNodeView] = []
    truncated = False
    queue: deque[tuple[TreeNode, int, int]] = deque([(root, -1, 0)])
    while queue:
        if len(views) == max_nodes:
            return views, True
        node, parent, depth = queue.popleft()
        children = below if node is root and below is not None else [*node.children.values()]
        views.append(
            CacheNodeView(
                id=node.id,
                parent=parent,
                depth=depth,
                num_tokens=len(node.key),
                preview_ids=node.key[:preview_tokens],
                lock_ref=node.lock_ref,
                num_children=len(children),
                running=running.get(node.id, 0),
                batched=node.id in batched,
                tier="device",
                salt=node.salt if node.is_root and node is not root else None,
            )
        )
        if depth == max_depth:
            truncated = truncated or bool(children)
        else:
            queue.extend((child, node.id, depth + 1) for child in children)
    return views, truncated
