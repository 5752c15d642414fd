"""One Ray Serve replica: a radixserve server on a loopback port of the replica's node.

The server (api, tokenizer and scheduler processes, as `radixserve serve` runs them) is a
child of the replica actor, so it lives on the node Ray placed the replica on, computes on
the CPUs Ray reserved for it (`--threads`), and dies with the actor (the server watches its
parent). Only the replica talks to it, with a key it made up: nothing else on the machine
can use it. A call is forwarded as it came; the answer goes back as a head (status and
content type) and then the body's bytes as they arrive, so streams stay streams.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from radixserve.keys import ADMIN_API_KEY_ENV, API_KEY_ENV
from radixserve.procutil import free_port
from radixserve.ray.call import Call
from radixserve.ray.replica_tree import DigestReports

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
DIGEST_BLOCK = 16  # token ids a reported block names (core/digest.py)
DIGEST_MAX_BLOCKS = 8192  # most blocks one report names (64 KiB)


class EngineReplica:
    """A radixserve server behind Ray Serve (module docstring)."""

    def __init__(self, serve_args: Sequence[str], threads: int = 1) -> None:
        self.key = secrets.token_urlsafe(24)
        port = free_port()
        env = {**os.environ, ADMIN_API_KEY_ENV: self.key, "OMP_NUM_THREADS": str(threads)}
        env.pop(API_KEY_ENV, None)
        argv = ["serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", *argv, "--threads", str(threads)], env=env
        )
        self.url = f"http://127.0.0.1:{port}"
        self.auth = {"Authorization": f"Bearer {self.key}"}
        self._wait_healthy()
        self.client = httpx.AsyncClient(base_url=self.url, headers=self.auth, timeout=None)
        self.reports = DigestReports(DIGEST_BLOCK)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"radixserve serve exited with {self.proc.returncode}")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.proc.kill()
        raise TimeoutError(f"radixserve serve not healthy after {START_TIMEOUT_S:.0f} s")

    async def forward(self, call: Call) -> AsyncIterator[dict[str, Any] | bytes]:
        """The server's answer to `call`: {"status", "content_type"}, then the body."""
        headers = {"Content-Type": call.content_type} if call.body else {}
        request = self.client.build_request(call.method, call.path, content=call.body,
                                            headers=headers)  # fmt: skip
        resp = await self.client.send(request, stream=True)
        try:
            content_type = resp.headers.get("content-type", "application/json")
            yield {"status": resp.status_code, "content_type": content_type}
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What changed in the shared part of the server's cache, as block hashes
        (`DigestReports`; routing.py reads them)."""
        params = {"block": DIGEST_BLOCK, "max_blocks": DIGEST_MAX_BLOCKS}
        resp = await self.client.get("/cache_digest", params=params, timeout=10)
        resp.raise_for_status()
        cached = int(resp.headers.get("x-radixserve-cached-tokens", 0))
        return self.reports.next(resp.content, cached)

    async def check_health(self) -> None:
        """Raises (Ray then replaces the replica) when the server is gone or unhealthy."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"radixserve serve exited with {self.proc.returncode}")
        resp = await self.client.get("/health", timeout=10)
        if resp.status_code != 200:
            raise RuntimeError(f"radixserve serve /health answered {resp.status_code}")

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
