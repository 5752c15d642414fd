"""Credentials never shown: URL passwords and password-like query values are masked in
text, config values and log records (tracebacks included)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from radixserve.redact import RedactingFilter, redact, redact_values
from radixserve.router.config import check_worker_url


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:p@ss:w0rd@host", "rediss://user:***@host"),
        (
            "tier redis://:pw@10.0.0.1:6379 unreachable",
            "tier redis://:***@10.0.0.1:6379 unreachable",
        ),
        ("http://alice:pw@a and https://bob:pw2@b", "http://alice:***@a and https://bob:***@b"),
        ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=***&db=1"),
        ("/?key=abc", "/?key=***"),
        ("redis://host:6379/0", "redis://host:6379/0"),  # nothing to mask
        ("http://host:8000/path", "http://host:8000/path"),
    ],
)
def test_redact_masks_passwords_only(text: str, want: str) -> None:
    assert redact(text) == want


def test_redact_values_masks_strings_and_lists() -> None:
    got = redact_values({"remote": "redis://:pw@h", "urls": ["http://u:pw@a"], "n": 3})
    assert got == {"remote": "redis://:***@h", "urls": ["http://u:***@a"], "n": 3}


def test_log_records_lose_their_passwords(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.redact")
    caplog.handler.addFilter(RedactingFilter())
    try:
        logger.warning("tier %s unreachable", "redis://:pw-in-args@h:1")
        try:
            raise ConnectionError("cannot reach redis://:pw-in-trace@h:1")
        except ConnectionError:
            logger.exception("failed")
    finally:
        caplog.handler.removeFilter(caplog.handler.filters[-1])
    assert "pw-in-args" not in caplog.text and "pw-in-trace" not in caplog.text
    assert "redis://:***@h:1" in caplog.text and "ConnectionError" in caplog.text


UVICORN_LOGS = """
import logging

from radixserve.procutil import configure_logging, uvicorn_config

configure_logging("info")
uvicorn_config("app:app", log_level="info")  # where uvicorn sets up its loggers
try:
    raise RuntimeError("cannot reach redis://:pw-in-trace@h:1")
except RuntimeError:
    logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
access = '%s - "%s %s HTTP/%s" %d'
logging.getLogger("uvicorn.access").info(access, "127.0.0.1:1", "GET", "/?key=the-key", "1.1", 200)
logging.getLogger("uvicorn").info("tier redis://:pw-in-message@h:1")
"""


def test_uvicorns_own_log_lines_lose_their_passwords() -> None:
    """The server's and the router's uvicorn (procutil.uvicorn_config) log through the
    redacting handler: the access line's console key, an exception's text."""
    run = subprocess.run(
        [sys.executable, "-c", UVICORN_LOGS], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    log = run.stderr
    assert "Exception in ASGI application" in log and "RuntimeError" in log, log
    assert '"GET /?key=*** HTTP/1.1" 200' in log and "tier redis://:***@h:1" in log, log
    for secret in ("pw-in-trace", "the-key", "pw-in-message"):
        assert secret not in log, log


def test_worker_urls_with_credentials_are_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="carries credentials") as err:
        check_worker_url("http://admin:hunter2@10.0.0.5:8000")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ValueError) as err:
        check_worker_url("ftp://admin:hunter2@10.0.0.5")
    assert "hunter2" not in str(err.value)
    assert check_worker_url("http://10.0.0.5:8000/") == "http://10.0.0.5:8000"
