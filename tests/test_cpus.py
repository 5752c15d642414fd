"""Threads and pinning of model processes (radixserve/cpus.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import ServerHandle, children_of

from radixserve import Engine, cpus
from radixserve.config import EngineConfig


def fake_topology(root: Path, cores_of: dict[int, tuple[int, int]]) -> None:
    """sysfs topology files: cpu -> (package, core)."""
    for cpu, (package, core) in cores_of.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")


def test_one_cpu_per_physical_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # two packages of two cores, SMT siblings numbered after the first threads (Linux order)
    fake_topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1),
                             4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)})  # fmt: skip
    monkeypatch.setattr(cpus, "TOPOLOGY", tmp_path)
    assert cpus.physical_cores(list(range(8))) == [0, 1, 2, 3]
    assert cpus.physical_cores([5, 6, 7]) == [5, 6, 7]  # one sibling of each of three cores
    assert cpus.physical_cores([1, 5]) == [1]
    assert cpus.physical_cores([9]) == [9]  # no topology files: a core of its own


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_shares_are_disjoint_and_cover_the_cores(n: int, parts: int) -> None:
    cores = list(range(10, 10 + n))
    shares = [cpus.share(cores, i, parts) for i in range(parts)]
    assert all(shares)  # every part computes somewhere
    if parts <= n:
        assert sorted(c for s in shares for c in s) == cores
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        assert [s[0] for s in shares] == [cores[i % n] for i in range(parts)]


def test_threads_default_to_omp_num_threads_else_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpus.default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(cpus, "physical_cores", lambda: [0, 1, 2, 3, 4])
    assert cpus.default_threads() == 5
    assert [cpus.default_threads(r, 2) for r in range(2)] == [3, 2]


def test_pinning_never_replaces_the_users_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES"):
        monkeypatch.delenv(name, raising=False)
    assert cpus.pinned_env([2, 3]) == {
        "OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "close", "OMP_PLACES": "{2},{3}"
    }  # fmt: skip
    assert cpus.pinned_env([2, 3], threads=1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_PLACES", "cores")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpus.pinned_env([2, 3]) == {}
    assert cpus.pinned_env([2, 3], threads=4) == {"OMP_NUM_THREADS": "4"}


def test_environ_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RS_TEST_KEPT", "old")
    monkeypatch.delenv("RS_TEST_NEW", raising=False)
    with cpus.environ({"RS_TEST_KEPT": "new", "RS_TEST_NEW": "1"}):
        assert os.environ["RS_TEST_KEPT"] == "new" and os.environ["RS_TEST_NEW"] == "1"
    assert os.environ["RS_TEST_KEPT"] == "old" and "RS_TEST_NEW" not in os.environ


def test_threads_flag_is_checked() -> None:
    assert EngineConfig(threads=3).threads == 3
    with pytest.raises(ValueError, match="threads must be >= 1"):
        EngineConfig(threads=0)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def _single_cpu_threads(pid: int) -> set[int]:
    """The CPUs that threads of `pid` are pinned to, one each (/proc status)."""
    pinned = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        allowed = next(
            line.split(":", 1)[1].strip()
            for line in (task / "status").read_text().splitlines()
            if line.startswith("Cpus_allowed_list")
        )
        if allowed.isdigit():
            pinned.add(int(allowed))
    return pinned


@pytest.mark.skipif(
    not Path("/proc/self/task").exists() or "OMP_PLACES" in os.environ,
    reason="Linux /proc, and pinning left to the server (no OMP_PLACES in the test's env)",
)
def test_the_servers_model_process_computes_pinned(server: ServerHandle) -> None:
    """The scheduler process (the model) gets its cores as OMP_PLACES and its OpenMP
    threads stay one per core; the tokenizer process gets no binding."""
    with server.client() as c:
        r = c.post("/generate", json={"text": "pin", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200, r.text
    children = {
        pid: _environ(pid)
        for pid in children_of(server.proc.pid)
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    }  # the scheduler and the tokenizer (multiprocessing's tracker computes nothing)
    bound = [pid for pid, env in children.items() if env.get("OMP_PROC_BIND") == "close"]
    assert len(bound) == 1, children.keys()  # the scheduler; not the tokenizer
    cores = cpus.physical_cores()
    env = children[bound[0]]
    assert env["OMP_PLACES"] == ",".join(f"{{{c}}}" for c in cores)
    assert env["OMP_NUM_THREADS"] == str(len(cores))
    if len(cores) > 1:
        assert _single_cpu_threads(bound[0]) == set(cores)


def test_an_engine_takes_threads_only_when_given(tiny_model_dir: Path) -> None:
    """An in-process Engine computes on its process's threads unless given `threads`."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        Engine(str(tiny_model_dir), max_total_tokens=256).shutdown()
        assert torch.get_num_threads() == 1
        if cpus.default_threads() > 1:
            Engine(str(tiny_model_dir), max_total_tokens=256, threads=2).shutdown()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
