"""The CPU cores a model process computes on: how many threads, and which cores they stay on.

A model's matmuls and attention run on torch's OpenMP threads (at::parallel_for). The
default is one thread per physical core the process may run on (`os.sched_getaffinity`, so
taskset and cgroup CPU sets count): SMT siblings share one core's vector units, so a second
thread per core adds barrier waits, not arithmetic. Model processes sharing a machine (TP
ranks, data-parallel workers) take disjoint shares of those cores. `OMP_NUM_THREADS`, when
set, is the default instead (the data-parallel launcher sets it per worker), and `--threads`
overrides both. A model process radixserve starts gets that count as OMP_NUM_THREADS in its
environment (torch reads it); an in-process `Engine` changes torch's thread count only when
given `threads` (or when it runs several TP ranks), else computes on the threads its process
has.

Pinning: a model process that radixserve starts (the server's scheduler, its TP followers,
the data-parallel workers) gets `OMP_PROC_BIND=close` and `OMP_PLACES` = its cores in its
environment (libgomp reads them once, as it loads): each OpenMP thread stays on one core,
so a thread that another program's work pushes aside no longer holds every parallel region
of the step at its barrier. An in-process `Engine` is not pinned (its OpenMP runtime is
already running); set the two variables before starting Python to pin it. A user's own
`OMP_PROC_BIND` / `OMP_PLACES` are never replaced.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

TOPOLOGY = Path("/sys/devices/system/cpu")


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on, ascending."""
    if hasattr(os, "sched_getaffinity"):  # Linux: honours taskset / cgroup CPU sets
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int] | None = None) -> list[int]:
    """One logical CPU per physical core among `cpus` (default: usable_cpus()): the first
    of each core's SMT siblings. Without the sysfs topology, every CPU counts as a core."""
    cpus = usable_cpus() if cpus is None else cpus
    seen: set[tuple[str, str]] = set()
    cores = []
    for cpu in cpus:
        topo = TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text(), (topo / "core_id").read_text())
        except OSError:
            key = (str(cpu), "")
        if key not in seen:
            seen.add(key)
            cores.append(cpu)
    return cores


def share(cores: list[int], part: int, parts: int) -> list[int]:
    """Part `part` of `parts` disjoint, near-equal slices of `cores` (at least one core each:
    with more parts than cores, parts share cores round-robin)."""
    if parts > len(cores):
        return [cores[part % len(cores)]]
    size, extra = divmod(len(cores), parts)
    start = part * size + min(part, extra)
    return cores[start : start + size + (part < extra)]


def default_threads(tp_rank: int = 0, tp_size: int = 1) -> int:
    """OpenMP threads of a model process that was given no `--threads`: $OMP_NUM_THREADS if
    set, else the physical cores of its share among `tp_size` ranks."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(share(physical_cores(), tp_rank, tp_size))


def pinned_env(cores: list[int], threads: int | None = None) -> dict[str, str]:
    """Environment entries for a model process computing on `cores`: its thread count
    (`threads`; else one per core, unless OMP_NUM_THREADS is set) and, unless OMP_PROC_BIND
    or OMP_PLACES is set (by the user, or by a launcher above: the data-parallel one), the
    OpenMP binding."""
    env = {}
    if threads is not None or "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads or len(cores))
    if "OMP_PROC_BIND" not in os.environ and "OMP_PLACES" not in os.environ:
        env |= {"OMP_PROC_BIND": "close", "OMP_PLACES": ",".join(f"{{{c}}}" for c in cores)}
    return env


@contextlib.contextmanager
def environ(extra: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `extra` while the block runs (a spawned child copies it at start)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
