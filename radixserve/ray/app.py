"""The Ray Serve application: an `Ingress` in front of N `EngineReplica`s.

    client ──HTTP──> Ray Serve proxy ──> Ingress (ingress.py) ──handle──> EngineReplica × N
                                          tokenizes the prompt     │       (engine.py: a radixserve
                                                                   │        server on its node)
                                          request router: RadixTreeRouter (routing.py),
                                          or Ray's power-of-two / prefix-affinity routers

`radixserve ray serve ...` runs it on a running Ray cluster (or a local one), and
`serve run radixserve.ray.app:build_app model=... num_replicas=2` does the same from Ray's
command line. Replicas are Ray's to place, replace and scale (`autoscaling_config` on their
queue lengths when `max_replicas` > `min_replicas`): radixserve keeps no membership.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from typing import Any

from ray import serve
from ray.serve import Application

from radixserve.ray.engine import EngineReplica
from radixserve.ray.ingress import Ingress

ROUTERS = {
    "radix_tree": "radixserve.ray.routing:RadixTreeRouter",
    "power_of_two": None,  # Ray Serve's default router
    "prefix_affinity": "ray.llm._internal.serve.routing_policies.prefix_aware."
    "prefix_aware_router:PrefixCacheAffinityRouter",  # Ray's approximate one (needs pyarrow)
}


@dataclass(frozen=True)
class RayServeOptions:
    model: str | None = None  # as `radixserve serve --model` (None: the embedded model)
    revision: str | None = None
    serve_args: tuple[str, ...] = ()  # more `radixserve serve` flags for every replica
    num_replicas: int = 1  # fixed, unless max_replicas is set
    max_replicas: int | None = None  # autoscale between num_replicas and this
    target_ongoing_requests: float = 4.0  # autoscaling: requests in flight per replica
    # autoscaling: how long the queues must say so before a replica is added or removed, and
    # the window their lengths are averaged over (Ray's defaults)
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    cpus_per_replica: float = 1.0  # reserved by Ray; the replica's server computes on them
    max_ongoing_requests: int = 64  # per replica; beyond, Ray queues at the ingress
    router: str = "radix_tree"
    stats_period_s: float = 1.0  # how often each replica reports its cache to the router
    name: str = "radixserve"

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {sorted(ROUTERS)}, not {self.router!r}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, not {self.num_replicas}")
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < num_replicas")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"cpus_per_replica must be positive, not {self.cpus_per_replica}")

    @property
    def replica_argv(self) -> list[str]:
        model = ["--model", self.model] if self.model else []
        revision = ["--revision", self.revision] if self.revision else []
        return [*model, *revision, *self.serve_args]


def application(options: RayServeOptions) -> Application:
    """The bound application (`serve.run` it)."""
    scaling: dict[str, Any] = {"num_replicas": options.num_replicas}
    if options.max_replicas is not None:
        scaling = {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": options.num_replicas, "max_replicas": options.max_replicas,
            "target_ongoing_requests": options.target_ongoing_requests,
            "upscale_delay_s": options.upscale_delay_s,
            "downscale_delay_s": options.downscale_delay_s,
            "look_back_period_s": options.look_back_period_s,
        }}  # fmt: skip
    router: dict[str, Any] = {"request_routing_stats_period_s": options.stats_period_s}
    if ROUTERS[options.router] is not None:
        router["request_router_class"] = ROUTERS[options.router]
    threads = max(1, int(options.cpus_per_replica))
    engine = serve.deployment(
        name="EngineReplica",
        ray_actor_options={"num_cpus": options.cpus_per_replica},
        max_ongoing_requests=options.max_ongoing_requests,
        request_router_config=router,
        health_check_period_s=2.0,
        **scaling,
    )(EngineReplica).bind(options.replica_argv, threads)
    ingress = serve.deployment(
        name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024
    )(Ingress)
    return ingress.bind(engine, options.model, options.revision)


def build_app(args: dict[str, str]) -> Application:
    """`serve run radixserve.ray.app:build_app key=value ...`: the keys are
    `RayServeOptions`' fields (`serve_args` as one shell-quoted string)."""
    known = {f.name: f for f in fields(RayServeOptions)}
    values: dict[str, Any] = {}
    for key, raw in args.items():
        if key not in known:
            raise ValueError(f"{key}: not an option (options: {', '.join(known)})")
        values[key] = _parse(key, str(raw))
    return application(RayServeOptions(**values))


def _parse(key: str, raw: str) -> Any:
    if key == "serve_args":
        return tuple(shlex.split(raw))
    try:
        if key in ("num_replicas", "max_replicas", "max_ongoing_requests"):
            return int(raw)
        if key in ("cpus_per_replica", "target_ongoing_requests") or key.endswith("_s"):
            return float(raw)
    except ValueError:
        raise ValueError(f"{key}: {raw!r} is not a number") from None
    return raw
