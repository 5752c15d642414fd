"""What every radixserve process shares: log format, child entry point, parent watch, and
a free loopback port for the servers a launcher starts.

A child process (tokenizer, scheduler) runs `child_main(name, level, launcher_pid, target,
*args)`:
- it ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the launcher
  alone decides the shutdown order (it sends `Shutdown`, then joins, then escalates);
- it dies with the launcher (PR_SET_PDEATHSIG on Linux, plus `ParentWatch` in its loop);
- an exception escaping `target` is logged with its traceback and the child exits with
  status 1; the launcher sees the dead child, logs it and exits non-zero itself.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from radixserve.redact import RedactingFilter

LOG_FORMAT = "%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s"
PARENT_POLL_MS = 1000  # how often an idle child checks that its launcher still lives

logger = logging.getLogger("radixserve.server")


def configure_logging(level: str) -> None:
    """stderr at `level`, credentials masked (radixserve.redact) on every record."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())


def uvicorn_config(app: Any, **kw: Any) -> uvicorn.Config:
    """uvicorn's config without uvicorn's own log handlers: its loggers (`uvicorn`,
    `uvicorn.error`, `uvicorn.access`) propagate to the handler `configure_logging` set up,
    so an access line's `/?key=...` and an exception's text are masked like any record."""
    return uvicorn.Config(app, log_config=None, **kw)


def child_main(
    name: str, log_level: str, launcher_pid: int, target: Callable[..., None], *args: Any
) -> None:
    """Entry point of a spawned child; `target(*args)` is its real main."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != launcher_pid:  # it died while we were importing: nothing to serve
        sys.exit(1)
    configure_logging(log_level)
    try:
        target(*args)
    except BaseException:
        logger.exception("%s process crashed", name)
        logging.shutdown()
        sys.exit(1)
    logger.info("%s process exited cleanly", name)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL us when the launcher dies, even mid model-load (when
    no loop polls `ParentWatch`). Elsewhere `ParentWatch` alone covers it."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable")


class ParentWatch:
    """Detects that the launcher died (we were re-parented), so a child never outlives it."""

    def __init__(self) -> None:
        self._ppid = os.getppid()

    def parent_alive(self) -> bool:
        return os.getppid() == self._ppid


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick; another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
