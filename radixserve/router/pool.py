"""The workers behind the router: membership, health, load, and which one a request gets.

Health: every `health_interval_s` each worker's /health is asked (and its /metrics read
for its load); `health_failures` failures in a row, or one failed request (a refused or
broken connection), take it out: it gets no new requests and every request still open on
it stops waiting at once (its `down` event) and is retried elsewhere. A worker that passes
a check again comes back with an empty tree (it may have restarted with an empty cache).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, OrderedDict

import httpx

from radixserve.router.backend import Backend
from radixserve.router.config import RouterConfig, check_worker_url
from radixserve.router.policy import Policy
from radixserve.server.protocol import ApiError

logger = logging.getLogger("radixserve.router")

LOAD_METRICS = ("radixserve_num_running_reqs", "radixserve_num_queued_reqs")
MAX_METRICS_BYTES = 1 << 20  # of a worker's /metrics read for its load; the rest is ignored


class BackendPool:
    def __init__(self, config: RouterConfig, policy: Policy, client: httpx.AsyncClient) -> None:
        self.config = config
        self.policy = policy
        self.client = client  # shared with the proxy; no base URL
        self.workers: dict[str, Backend] = {}
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session id -> worker url
        self.decisions: Counter[str] = Counter()  # why requests went where they went
        self.retries = 0
        for url in config.worker_urls:
            self.add(url)

    # ---------------------------------------------------------------- membership
    def add(self, url: str) -> Backend:
        """Add a worker (unhealthy until its first check passes); ValueError on a bad url."""
        url = check_worker_url(url)
        if url not in self.workers:
            self.workers[url] = Backend(url)
            logger.info("worker %s added", url)
        return self.workers[url]

    def remove(self, url: str) -> bool:
        """Route nothing more to `url`; requests open on it finish there."""
        worker = self.workers.pop(url.rstrip("/"), None)
        if worker is None:
            return False
        self.policy.forget(worker.url)
        logger.info("worker %s removed", worker.url)
        return True

    def healthy(self) -> list[Backend]:
        return [w for w in self.workers.values() if w.healthy]

    # ---------------------------------------------------------------- routing
    def pick(self, key: str | None, session: str | None, exclude: set[str]) -> Backend:
        """The worker for one attempt: the session's worker if it has one and it is up,
        else the policy's choice (key None: the least loaded, the policy not asked).
        ApiError 503 when no healthy worker is left."""
        candidates = [w for w in self.healthy() if w.url not in exclude]
        if not candidates:
            raise ApiError(503, "no healthy worker can take the request", headers=RETRY)
        sticky = self.workers.get(self.sessions.get(session, "")) if session else None
        if sticky is not None and sticky in candidates:
            self.sessions.move_to_end(session)  # type: ignore[arg-type]
            self.decisions["session"] += 1
            return sticky
        if key is None:
            return min(candidates, key=lambda w: w.load)
        decision = self.policy.choose(candidates, key)
        self.decisions[decision.reason] += 1
        if session:
            self.sessions[session] = decision.worker.url
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.config.sessions:
                self.sessions.popitem(last=False)
        return decision.worker

    def mark_dead(self, worker: Backend, why: str) -> None:
        if worker.healthy:
            logger.warning("worker %s taken out: %s", worker.url, why)
        worker.healthy = False
        worker.down.set()
        self.policy.forget(worker.url)

    # ---------------------------------------------------------------- health
    async def check(self, worker: Backend) -> None:
        """One health check (and load refresh) of `worker`."""
        try:
            resp = await self.client.get(worker.url + "/health", timeout=self._timeout)
            ok, why = resp.status_code == 200, f"/health answered {resp.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {e!r}"
        if not ok:
            worker.failures += 1
            if worker.failures >= self.config.health_failures:
                self.mark_dead(worker, why)
            return
        worker.failures = 0
        worker.reported_load = await self._reported_load(worker)
        if not worker.healthy:
            worker.down = asyncio.Event()
            worker.healthy = True
            logger.info("worker %s is up", worker.url)

    async def check_all(self) -> None:
        """Every worker's check, each within the health timeout; whatever one worker answers
        (or fails to), the others are checked and the loop goes on."""
        workers = list(self.workers.values())
        timeout = self.config.health_timeout_s * 2  # /health, then /metrics
        results = await asyncio.gather(
            *(asyncio.wait_for(self.check(w), timeout) for w in workers), return_exceptions=True
        )
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                worker.failures += 1
                if worker.failures >= self.config.health_failures:
                    self.mark_dead(worker, f"health check failed: {result!r}")

    async def run_health_checks(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all()

    async def _reported_load(self, worker: Backend) -> int:
        """Running + queued samples from the worker's /metrics: its first MAX_METRICS_BYTES,
        lines that do not parse as a finite count ignored (0 if it will not say)."""
        body = b""
        try:
            async with self.client.stream(
                "GET", worker.url + "/metrics", headers=self.auth, timeout=self._timeout
            ) as resp:
                if resp.status_code != 200:
                    return 0
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) >= MAX_METRICS_BYTES:
                        break
        except httpx.HTTPError:
            return 0
        total = 0.0
        for line in body[:MAX_METRICS_BYTES].decode("utf-8", "replace").splitlines():
            name, _, value = line.partition(" ")
            if name in LOAD_METRICS:
                try:
                    count = float(value)
                except ValueError:
                    continue
                if math.isfinite(count) and 0 <= count < 1e9:
                    total += count
        return int(total)

    @property
    def auth(self) -> dict[str, str]:
        """The key /metrics is read with: the admin key (a worker with several tenants shows
        the load to it alone), else the inference key."""
        key = self.config.admin_key() or self.config.inference_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.config.health_timeout_s)


RETRY = {"Retry-After": "1"}
