"""The router's one configuration, frozen and validated once; CLI flags map 1:1 onto it."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from radixserve.keys import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    API_KEYS_FILE_ENV,
    CACHE_ISOLATION,
    check_exposure,
    env_key,
    tenant_keys,
)
from radixserve.redact import redact

ROUTING_POLICIES = ("cache_aware", "round_robin", "random", "least_load")


@dataclass(frozen=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    # cache_aware: route by prefix only when the best match covers more than this fraction
    # of the prompt, and only while the load is balanced (not: max - min > abs and
    # max > rel * min, loads in in-flight requests)
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    tree_budget_chars: int = 2**24  # per worker; least recently sent prompts pruned past it
    health_interval_s: float = 2.0  # health checks and load refresh from /metrics
    health_timeout_s: float = 5.0
    health_failures: int = 2  # consecutive failed checks that take a worker out
    max_attempts: int = 3  # workers one request may be tried on before 503
    api_key: str | None = None  # the inference key (radixserve/server/guard.py); the workers
    # take the same keys, and the router forwards each client's
    admin_api_key: str | None = None
    api_keys_file: str | None = None  # several tenants' keys, as on a worker (keys.py)
    # "tenant": a request is routed by its tenant and prompt (the workers share no cached
    # K/V across tenants), as on a worker
    cache_isolation: str = "none"
    allow_unauthenticated: bool = False  # serve an address other than loopback with no key
    allowed_hosts: tuple[str, ...] = ()  # Host names served ("*": any), as on a worker
    log_level: str = "info"
    sessions: int = 65536  # sticky session ids remembered (least recently used forgotten)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {ROUTING_POLICIES}, not {self.policy!r}")
        for url in self.worker_urls:
            check_worker_url(url)
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], not {self.cache_threshold}")
        positive = {
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "tree_budget_chars": self.tree_budget_chars,
            "health_interval_s": self.health_interval_s,
            "health_timeout_s": self.health_timeout_s,
            "health_failures": self.health_failures,
            "max_attempts": self.max_attempts,
            "sessions": self.sessions,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(
                f"cache_isolation must be one of {CACHE_ISOLATION}, not {self.cache_isolation!r}"
            )
        check_exposure(
            self.host,
            bool(self.tenant_keys() or self.admin_key()),
            "anyone could add workers and read every prompt",
            self.allow_unauthenticated,
        )

    def inference_key(self) -> str | None:
        return env_key(self.api_key, API_KEY_ENV)

    def admin_key(self) -> str | None:
        return env_key(self.admin_api_key, ADMIN_API_KEY_ENV)

    def tenant_keys(self) -> dict[str, str]:
        """{key: tenant} of every inference key (radixserve/keys.py), the file read now."""
        keys_file = env_key(self.api_keys_file, API_KEYS_FILE_ENV)
        return tenant_keys(keys_file, self.inference_key(), self.admin_key())


def check_worker_url(url: str) -> str:
    """`url` without a trailing slash if it is http(s)://host[:port]; else ValueError (whose
    message masks any password the url carried)."""
    parts = urlsplit(url)
    shape = parts.scheme in ("http", "https") and parts.hostname and parts.path in ("", "/")
    if not shape or parts.query or parts.fragment:
        raise ValueError(f"worker url must look like http://host:port, not {redact(url)!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"worker url {redact(url)!r} carries credentials: give the workers' key as "
            "--api-key instead"
        )
    return url.rstrip("/")
