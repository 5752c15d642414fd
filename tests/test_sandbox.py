"""benchmarks/sandbox.py: each containment layer, seen to hold from outside the child."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks/
from benchmarks.sandbox import Limits, netns_prefix, run_python  # noqa: E402

FAST = Limits(wall_s=5, cpu_s=3, memory_mb=256, file_mb=1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # a zombie counts as gone
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_runs_code_with_stdin_in_a_fresh_directory_that_is_removed() -> None:
    code = (
        "import os\nprint(input()[::-1])\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())"
    )
    r = run_python(code, "hello\n", FAST)
    assert r.status == "ok" and r.returncode == 0, r.stderr
    out, cwd = r.stdout.splitlines()
    assert out == "olleh"
    assert Path(cwd).name == "work" and Path(cwd).parent.name.startswith("radixserve-sandbox-")
    assert not Path(cwd).exists()  # the whole temporary directory is gone after the call


def test_exception_is_an_error_with_its_traceback() -> None:
    r = run_python("raise ValueError('boom')", "", FAST)
    assert (r.status, r.returncode) == ("error", 1)
    assert r.stderr.strip().endswith("ValueError: boom")


def test_infinite_loop_is_killed_at_the_wall_clock_timeout() -> None:
    code = "import os\nprint(os.getpid(), flush=True)\nwhile True:\n    pass\n"
    start = time.perf_counter()
    r = run_python(code, "", Limits(wall_s=1.5, cpu_s=30))
    elapsed = time.perf_counter() - start
    assert r.status == "timeout" and r.returncode is None
    assert 1.5 <= r.wall_s < 4.0 and elapsed < 5.0, (r.wall_s, elapsed)
    assert not alive(int(r.stdout)), "the looping process survived the sandbox call"


def test_sleeping_process_is_killed_at_the_wall_clock_timeout() -> None:
    r = run_python("import time\ntime.sleep(60)", "", Limits(wall_s=1.0))
    assert r.status == "timeout" and r.wall_s < 3.0, (r.status, r.wall_s)


def test_cpu_limit_kills_a_spinning_process_before_the_wall_clock() -> None:
    r = run_python("while True:\n    pass\n", "", Limits(wall_s=20, cpu_s=1))
    assert r.status == "cpu" and r.returncode == -signal.SIGXCPU, (r.status, r.returncode)
    assert r.wall_s < 5.0, r.wall_s


@pytest.mark.parametrize(
    "hog",
    [
        "x = bytearray(2 ** 30)",  # one 1 GiB allocation
        "x = []\nwhile True:\n    x.append(bytearray(10 ** 6))",  # growth until the limit
    ],
)
def test_memory_hog_hits_the_address_space_limit(hog: str) -> None:
    r = run_python(hog, "", Limits(wall_s=10, memory_mb=256))
    assert r.status == "memory", (r.status, r.stderr[-300:])
    assert r.wall_s < 5.0, r.wall_s


def test_file_size_limit_caps_files_and_output() -> None:
    big_file = run_python("open('f', 'wb').write(b'x' * (4 << 20))", "", FAST)
    assert big_file.status == "file_limit", (big_file.status, big_file.stderr[-300:])
    flood = run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", "", FAST)
    assert flood.status == "file_limit", flood.status
    assert len(flood.stdout) == FAST.output_chars  # read back only up to the cap


@pytest.mark.parametrize(
    "bomb",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
        "import os\nos.system('sleep 30 &')",
        "import ctypes\nctypes.CDLL(None).fork()",
    ],
)
def test_process_creation_is_refused(bomb: str) -> None:
    r = run_python(bomb, "", FAST)
    assert r.status == "blocked", (r.status, r.stderr[-300:])
    assert r.wall_s < 3.0, r.wall_s


def _listener() -> tuple[socket.socket, int]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    return srv, srv.getsockname()[1]


NETWORK_MODES = [
    pytest.param(
        "netns",
        marks=pytest.mark.skipif(netns_prefix() is None, reason="unshare --net fails here"),
    ),
    "audit",
]


@pytest.mark.parametrize("mode", NETWORK_MODES)
def test_network_call_is_contained(mode: str) -> None:
    """The child tries to reach a port the test listens on: it must fail, and the listener
    must see no connection."""
    srv, port = _listener()
    try:
        code = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'leak')\n"
        )
        r = run_python(code, "", Limits(wall_s=10, network=mode))
        assert r.network == mode
        assert r.status == ("error" if mode == "netns" else "blocked"), r.stderr[-300:]
        expected = "Network is unreachable" if mode == "netns" else "SandboxViolation: socket"
        assert expected in r.stderr, r.stderr[-300:]
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()


def test_auto_network_mode_prefers_a_namespace() -> None:
    r = run_python("print(1)", "", Limits(network="auto"))
    assert r.ok and r.network == ("netns" if netns_prefix() else "audit")


def test_writes_and_deletes_outside_the_sandbox_are_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    target = tmp_path / "new.txt"
    for code in [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
    ]:
        r = run_python(code, "", FAST)
        assert r.status == "blocked", (code, r.status, r.stderr[-300:])
    assert victim.read_text() == "keep" and not target.exists()
    reading = run_python(f"print(open({str(victim)!r}).read())", "", FAST)
    assert reading.ok and reading.stdout == "keep\n"  # reading is allowed


def test_signals_to_other_processes_and_raising_limits_are_refused() -> None:
    kill = run_python("import os\nos.kill(os.getppid(), 0)", "", FAST)
    assert kill.status == "blocked", kill.stderr[-300:]
    raise_cpu = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))"
    assert run_python(raise_cpu, "", FAST).status == "blocked"
