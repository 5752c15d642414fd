"""Where the API keys come from: a flag, else an environment variable (never a command line
the server builds: `serve --dp-size` hands them to its workers by environment), and the
rule that a process reachable from other machines needs one."""

from __future__ import annotations

import os

API_KEY_ENV = "RADIXSERVE_API_KEY"  # the inference key
ADMIN_API_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def env_key(given: str | None, env: str) -> str | None:
    """A key (or secret) from its flag, else from the environment; None when neither sets
    one. ValueError when the one set is empty: an empty variable is a mistake (a template
    left unfilled), not a request for no key."""
    key, source = (os.environ.get(env), env) if given is None else (given, "the flag for " + env)
    if key is not None and not key.strip():
        raise ValueError(f"{source} is set but empty: give a value, or unset it")
    return key


def check_exposure(host: str, keyed: bool, what: str, allowed: bool = False) -> None:
    """ValueError for a process bound to `host`, not a loopback name, with no key (`keyed`
    False), unless `allowed` (--allow-unauthenticated); `what` is what anyone could do."""
    if host in LOOPBACK_NAMES or keyed or allowed:
        return
    raise ValueError(
        f"on {host} with no API key, {what}: give --api-key and --admin-api-key (or their "
        "RADIXSERVE_* variables), bind to 127.0.0.1, or pass --allow-unauthenticated"
    )
