"""Where the API keys come from: a flag, else an environment variable (never a command line
the server builds: `serve --dp-size` hands them to its workers by environment), a keys file
of several tenants' keys, and the rule that a process reachable from other machines needs
one."""

from __future__ import annotations

import os
import re

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


# Tenants (radixserve/server/guard.py): every inference key belongs to one tenant, whose
# requests only it may stop and whose part of the prefix cache only it reads under
# --cache-isolation tenant. A keys file gives several keys, each with its tenant's name.
API_KEYS_FILE_ENV = "RADIXSERVE_API_KEYS_FILE"
DEFAULT_TENANT = "default"  # --api-key's tenant; every caller's when no key is set at all
ADMIN_TENANT = "admin"  # the admin key's own requests (not a name a keys file may use)
# What requests share in the prefix cache (core/request.py CacheSalt): "none" everything (but
# a request's own cache_salt separates it), "tenant" nothing across tenants
CACHE_ISOLATION = ("none", "tenant")
MIN_KEY_CHARS = 16  # a keys file's keys, as the tiers' secret (radixserve/config.py)
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def read_keys_file(path: str) -> dict[str, str]:
    """{key: tenant} of a keys file: one `KEY TENANT` pair a line; blank lines and lines
    whose first non-blank character is # are skipped. ValueError naming the file and the
    line number (never the key) for a line that is not two fields, a key shorter than
    MIN_KEY_CHARS or not printable ASCII, a tenant name not matching TENANT_NAME or the
    reserved ADMIN_TENANT, a key given twice, or a file that cannot be read."""
    return {key: tenant for key, (tenant, _) in _read_keys(path).items()}


def _read_keys(path: str) -> dict[str, tuple[str, int]]:
    """{key: (tenant, line number)} of a keys file (see `read_keys_file`)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api keys file {path}: cannot read it ({e})") from None
    keys: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        key, tenant = _key_line(f"api keys file {path}, line {number}", text)
        if key in keys:
            raise ValueError(
                f"api keys file {path}, line {number}: the key of line {keys[key][1]} again "
                "(a key belongs to one tenant)"
            )
        keys[key] = (tenant, number)
    return keys


def _key_line(where: str, text: str) -> tuple[str, str]:
    fields = text.split()
    if len(fields) != 2:
        raise ValueError(f"{where}: expected 'KEY TENANT', got {len(fields)} fields")
    key, tenant = fields
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"{where}: the key has {len(key)} characters, at least {MIN_KEY_CHARS}")
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{where}: the key must be printable ASCII (it travels in a header)")
    if not TENANT_NAME.fullmatch(tenant) or tenant == ADMIN_TENANT:
        raise ValueError(
            f"{where}: tenant {tenant!r} must be 1-64 of A-Z a-z 0-9 . _ - (not starting "
            f"with . _ -), and not {ADMIN_TENANT!r}"
        )
    return key, tenant


def tenant_keys(
    keys_file: str | None, inference_key: str | None, admin_key: str | None
) -> dict[str, str]:
    """{key: tenant} of every inference key: the keys file's, and `inference_key`'s
    (DEFAULT_TENANT). ValueError as `read_keys_file`, and for a file key that is also the
    admin key or `inference_key` (its tenant would be ambiguous)."""
    keys = _read_keys(keys_file) if keys_file is not None else {}
    for other, flag in ((admin_key, "--admin-api-key"), (inference_key, "--api-key")):
        if other is not None and other in keys:
            line = keys[other][1]
            raise ValueError(f"api keys file {keys_file}, line {line}: the key is also {flag}")
    out = {key: tenant for key, (tenant, _) in keys.items()}
    if inference_key is not None:
        out[inference_key] = DEFAULT_TENANT
    return out
