"""Routing policies: which healthy worker gets a request, behind one interface.

`cache_aware` (SGLang's router algorithm, over an approximate tree per worker):

    1. loads balanced? (not: max - min > balance_abs_threshold and
                             max > balance_rel_threshold * min)
         no  -> the least-loaded worker (a hot prefix must not pile onto one worker)
    2. match = the longest prefix of the prompt each worker's tree holds
         best match / prompt length > cache_threshold -> that worker (the KV is there)
         else -> the worker with the smallest tree (most room in its cache), ties to the
                 least loaded: a new prefix's later requests follow it there, so new
                 prefixes are spread by what the workers hold, not by the moment's queues
    3. the prompt is inserted into the chosen worker's tree; trees past the budget are
       pruned least recently used first

The others: `round_robin`, `random`, `least_load` (ties to the first). Every policy records
nothing but its own state; loads and health are the pool's.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.router.backend import Backend
from radixserve.router.config import RouterConfig
from radixserve.router.tree import PrefixTree


@dataclass(frozen=True)
class Decision:
    worker: Backend
    reason: str  # "cache" (prefix match), "room" (smallest tree), "balance" (least load),
    # or the policy's name
    matched: int = 0  # characters of the prompt the chosen worker's tree held


class Policy(ABC):
    name: str

    @abstractmethod
    def choose(self, workers: Sequence[Backend], key: str) -> Decision:
        """Pick one of `workers` (non-empty, all healthy) for a prompt keyed `key` and
        record the choice in the policy's own state."""

    def forget(self, url: str) -> None:  # noqa: B027 (optional hook: no state, nothing to do)
        """The worker at `url` left or lost its cache: drop what the policy knows of it."""

    def stats(self, url: str) -> dict[str, int]:
        """What the policy holds for one worker (shown in /get_server_info)."""
        return {}


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[Backend], key: str) -> Decision:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker, self.name)


class Random(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, workers: Sequence[Backend], key: str) -> Decision:
        return Decision(self._rng.choice(list(workers)), self.name)


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, workers: Sequence[Backend], key: str) -> Decision:
        return Decision(min(workers, key=lambda w: w.load), self.name)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.trees: dict[str, PrefixTree] = {}

    def _tree(self, url: str) -> PrefixTree:
        return self.trees.setdefault(url, PrefixTree())

    def balanced(self, workers: Sequence[Backend]) -> bool:
        lo, hi = min(w.load for w in workers), max(w.load for w in workers)
        c = self.config
        return not (hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo)

    def choose(self, workers: Sequence[Backend], key: str) -> Decision:
        decision = self._decide(workers, key)
        tree = self._tree(decision.worker.url)
        tree.insert(key)
        tree.prune(self.config.tree_budget_chars)
        return decision

    def _decide(self, workers: Sequence[Backend], key: str) -> Decision:
        if self.balanced(workers) and key:
            matches = [(self._tree(w.url).match(key), w) for w in workers]
            matched, best = max(matches, key=lambda m: m[0])  # ties: the first listed
            if matched / len(key) > self.config.cache_threshold:
                return Decision(best, "cache", matched)
            roomiest = min(workers, key=lambda w: (self._tree(w.url).held(), w.load))
            return Decision(roomiest, "room", self._tree(roomiest.url).match(key))
        least = min(workers, key=lambda w: (w.load, self._tree(w.url).held()))
        return Decision(least, "balance", self._tree(least.url).match(key))

    def forget(self, url: str) -> None:  # noqa: B027 (optional hook: no state, nothing to do)
        self.trees.pop(url, None)

    def stats(self, url: str) -> dict[str, int]:
        return {"tree_chars": self._tree(url).size}


def make_policy(config: RouterConfig) -> Policy:
    """The policy `config.policy` names (the one place a name becomes a policy)."""
    policies: dict[str, type[Policy]] = {
        "round_robin": RoundRobin,
        "random": Random,
        "least_load": LeastLoad,
    }
    if config.policy == "cache_aware":
        return CacheAware(config)
    return policies[config.policy]()
