"""Start the server: children, handshake, HTTP, and a clean shutdown whatever happens.

    1. make the private socket folder (0700); bind the api server's inbox
    2. spawn the scheduler and tokenizer processes ("spawn" start method), and with
       --tp-size N the follower ranks 1..N-1 (the scheduler is rank 0; they meet through a
       file in the socket folder)
    3. wait for TokenizerReady (scheduler loaded the model -> tokenizer loaded its tokenizer);
       a child that dies first ends the launch with status 1 (its traceback is in the log)
    4. serve HTTP with uvicorn until SIGINT/SIGTERM, or until a child dies (status 1)
    5. send Shutdown down the pipeline, join the children (then terminate, then kill; after
       a child crashed, the Shutdown may not get through, so the join is short), remove
       the socket folder

Signals: uvicorn's own handler re-raises the signal after serving, which would kill us
before step 5; `_Uvicorn` only asks the server to stop. Outside serving, SIGTERM raises
KeyboardInterrupt like SIGINT, so step 5 (a `finally`) always runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn

from radixserve.config import EngineConfig
from radixserve.cpus import environ, physical_cores, pinned_env, share
from radixserve.message.ipc import IpcPaths, make_ipc_dir, remove_ipc_dir
from radixserve.message.messages import Shutdown
from radixserve.procutil import child_main, configure_logging, uvicorn_config
from radixserve.scheduler.scheduler_process import run_scheduler_process
from radixserve.server.app import build_app
from radixserve.server.manager import ChildDied, RequestManager
from radixserve.server.metrics import Metrics
from radixserve.tokenizer.tokenizer_process import run_tokenizer_process
from radixserve.worker.tp_follower import init_method_in, run_follower

logger = logging.getLogger("radixserve.launcher")

STARTUP_TIMEOUT_S = 900.0  # first run converts the embedded model; slow disks take minutes
CHILD_JOIN_S = 10.0
CHILD_JOIN_AFTER_CRASH_S = 1.0  # a dead child breaks the Shutdown chain: don't wait long
GRACEFUL_HTTP_SHUTDOWN_S = 5
EXIT_INTERRUPTED = 130


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_stop = on_stop

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._handle, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            _interrupt_on_sigterm()

    def _handle(self, sig: int) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for open connections
        logger.info("received %s: shutting down", signal.Signals(sig).name)
        self.should_exit = True
        self._on_stop()


def _interrupt_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def launch_server(config: EngineConfig) -> int:
    """Run the server until it is stopped; return the process exit status."""
    configure_logging(config.log_level)
    _interrupt_on_sigterm()
    problem = _port_problem(config.host, config.port)
    if problem is not None:  # fail before spending minutes on loading the model
        logger.error("cannot listen on %s:%d: %s", config.host, config.port, problem)
        return 1
    ipc = make_ipc_dir()
    logger.info("IPC sockets in %s", ipc.root)
    procs: dict[str, BaseProcess] = {}
    try:
        return asyncio.run(_serve(config, ipc, procs))
    except KeyboardInterrupt:
        logger.info("interrupted before the server was up")
        return EXIT_INTERRUPTED
    finally:
        _stop_children(procs)
        remove_ipc_dir(ipc)
        logger.info("shut down")


def _port_problem(host: str, port: int) -> str | None:
    """Why host:port cannot be bound right now, or None. (uvicorn binds it for real later.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return str(e)
    return None


def _spawn_children(config: EngineConfig, ipc: IpcPaths) -> dict[str, BaseProcess]:
    ctx = mp.get_context("spawn")
    tp_init = init_method_in(ipc.root) if config.tp_size > 1 else None
    # Join order on shutdown is this order: rank 0 stops its followers on its way out.
    targets: dict[str, tuple[Any, ...]] = {
        "scheduler": (run_scheduler_process, config, ipc, tp_init)
    }
    for rank in range(1, config.tp_size):
        targets[f"tp-rank-{rank}"] = (run_follower, config, rank, tp_init)
    targets["tokenizer"] = (run_tokenizer_process, ipc)
    procs: dict[str, BaseProcess] = {}
    cores = physical_cores()
    for name, (target, *args) in targets.items():
        proc = ctx.Process(
            target=child_main,
            args=(name, config.log_level, os.getpid(), target, *args),
            name=f"radixserve-{name}",
        )
        with environ(model_env(config, cores, name)):
            proc.start()
        procs[name] = proc
    return procs


def model_env(config: EngineConfig, cores: list[int], child: str) -> dict[str, str]:
    """What a child adds to its environment: a CPU model process (the scheduler is TP rank
    0, then "tp-rank-<r>") its share of the cores, its threads pinned to them
    (radixserve/cpus.py); nothing for the tokenizer or on a GPU."""
    if child == "tokenizer" or config.device.startswith("cuda"):
        return {}
    rank = 0 if child == "scheduler" else int(child.removeprefix("tp-rank-"))
    return pinned_env(share(cores, rank, config.tp_size), config.threads)


async def _serve(config: EngineConfig, ipc: IpcPaths, procs: dict[str, BaseProcess]) -> int:
    metrics = Metrics()
    manager = RequestManager(ipc, metrics, config.max_samples_in_flight)
    try:
        procs.update(_spawn_children(config, ipc))
        manager.procs = procs
        try:
            info = await manager.wait_ready(STARTUP_TIMEOUT_S)
        except (ChildDied, TimeoutError) as e:
            logger.error("start-up failed: %s", e)
            return 1
        server = _Uvicorn(
            uvicorn_config(
                build_app(manager, config, metrics),
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                access_log=config.log_level == "debug",
                timeout_graceful_shutdown=GRACEFUL_HTTP_SHUTDOWN_S,
                limit_concurrency=config.connection_limit,
                lifespan="off",
            ),
            on_stop=lambda: manager.fail_all(503, "the server is shutting down"),
        )
        logger.info(
            "model %s, dtype %s, KV capacity %d tokens, attention %s; serving on http://%s:%d",
            info.model_path,
            info.dtype,
            info.kv_capacity_tokens,
            info.attention_backend,
            config.host,
            config.port,
        )
        gc.freeze()  # as in the scheduler process: collections skip the start-up objects
        return await _run_http(server, manager)
    finally:
        manager.send(Shutdown())
        manager.close()


async def _run_http(server: _Uvicorn, manager: RequestManager) -> int:
    def stop() -> None:
        server.should_exit = True

    def task_done(task: asyncio.Future[None]) -> None:
        # These loops never return: an exception is a bug, and serving without them would
        # leave every request hanging. Fail loudly instead.
        if task.cancelled() or task.exception() is None:
            return
        logger.error("api server task crashed", exc_info=task.exception())
        manager.failure = manager.failure or f"api server task crashed: {task.exception()!r}"
        manager.fail_all(500, f"the server failed: {manager.failure}")
        stop()

    tasks = [
        asyncio.ensure_future(manager.receive_loop()),
        asyncio.ensure_future(manager.watch_children(on_failure=stop)),
    ]
    for t in tasks:
        t.add_done_callback(task_done)
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
    return 1 if manager.failure is not None else 0


def _stop_children(procs: dict[str, BaseProcess]) -> None:
    """Join (they got Shutdown), then SIGTERM, then SIGKILL whatever is left."""
    crashed = any(p.exitcode not in (None, 0) for p in procs.values())
    deadline = time.monotonic() + (CHILD_JOIN_AFTER_CRASH_S if crashed else CHILD_JOIN_S)
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs.values():
        if proc.is_alive():
            logger.warning("%s did not exit: terminating it", proc.name)
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        logger.info("%s exited with code %s", proc.name, proc.exitcode)
