"""`radixserve ray serve`: deploy the application on a Ray cluster and serve until stopped."""

from __future__ import annotations

import logging
import signal
import threading

import ray
from ray import serve

from radixserve.ray.app import RayServeOptions, application

logger = logging.getLogger("radixserve.ray")


def run_ray_serve(options: RayServeOptions, address: str | None, host: str, port: int) -> int:
    """Join the cluster at `address` (None: a running one if there is, else a new local
    one), serve the application on `host:port` through Ray Serve's proxy until SIGINT or
    SIGTERM, then delete it; the exit status."""
    ray.init(address=address, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(options), name=options.name, route_prefix="/")
        logger.warning("radixserve on Ray Serve: http://%s:%d (%d replicas, router %s)",
                       host, port, options.num_replicas, options.router)  # fmt: skip
        stop.wait()
        serve.delete(options.name)
        return 0
    finally:
        ray.shutdown()
