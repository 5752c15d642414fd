"""Where the API keys come from: a flag, else an environment variable (never a command line
the server builds: `serve --dp-size` hands them to its workers by environment)."""

from __future__ import annotations

import os

API_KEY_ENV = "RADIXSERVE_API_KEY"  # the inference key
ADMIN_API_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"


def env_key(given: str | None, env: str) -> str | None:
    """A key from its flag, else from the environment; None when neither sets one."""
    return given or os.environ.get(env) or None
