"""Credentials kept out of everything radixserve shows: logs, /get_server_info, error bodies.

A URL's password (`redis://:pw@host`, `http://user:pw@host`) and password-like query
parameters (`?password=...`) are replaced by `***`; the user name and host stay, so the
operator can still tell which endpoint a line is about.
"""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "***"
_URL_PASSWORD = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^/\s]*@")
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|pwd|token|key)=)[^&#\s]+", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URL password and password-like query value masked."""
    return _QUERY_PASSWORD.sub(rf"\g<1>{MASK}", _URL_PASSWORD.sub(rf"\g<1>{MASK}@", text))


def redact_values(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of `values` with each string value (and each string in a list) redacted."""

    def one(v: Any) -> Any:
        if isinstance(v, str):
            return redact(v)
        if isinstance(v, list | tuple):
            return [one(x) for x in v]
        return v

    return {k: one(v) for k, v in values.items()}


class RedactingFilter(logging.Filter):
    """Masks credentials in a record's message and traceback before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True
