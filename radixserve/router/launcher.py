"""Run the router; or N local workers plus the router (`radixserve serve --dp-size N`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace

import uvicorn

from radixserve.cpus import physical_cores, pinned_env, share
from radixserve.procutil import configure_logging, free_port, uvicorn_config
from radixserve.router.app import build_app
from radixserve.router.config import RouterConfig

logger = logging.getLogger("radixserve.router")

WORKER_STOP_S = 30.0


class _Server(uvicorn.Server):
    """Stops on SIGINT/SIGTERM and returns (uvicorn's own handler re-raises the signal
    after serving, which would end the process before the workers are stopped)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def run_router(config: RouterConfig) -> int:
    """Serve until SIGINT/SIGTERM; the exit status."""
    configure_logging(config.log_level)
    app = build_app(config)
    server = _Server(
        uvicorn_config(
            app, host=config.host, port=config.port, log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )  # fmt: skip
    server.run()
    return 0 if server.started else 1


def run_data_parallel(serve_args: Sequence[Sequence[str]], config: RouterConfig) -> int:
    """Start one worker per `serve_args` entry (`radixserve serve <args>` on free loopback
    ports, the CPU cores split between them) and the router in front; stop the workers
    after it."""
    configure_logging(config.log_level)
    dp_size = len(serve_args)
    cores = physical_cores()
    ports = [free_port() for _ in range(dp_size)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve",
                "serve",
                *args,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env={**os.environ, **pinned_env(share(cores, i, dp_size))},
        )  # fmt: skip
        for i, (args, port) in enumerate(zip(serve_args, ports, strict=True))
    ]
    logger.info("%d workers on ports %s, cores %s", dp_size, ports,
                [share(cores, i, dp_size) for i in range(dp_size)])  # fmt: skip
    urls = tuple(f"http://127.0.0.1:{p}" for p in ports)
    try:
        return run_router(replace(config, worker_urls=urls))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(WORKER_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
