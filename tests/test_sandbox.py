"""benchmarks/sandbox.py: each containment layer, seen to hold from outside the sandbox.

The escape tests first switch the in-process audit hook off (it is a second line, and
bypassable by design), then try each known escape; the namespaces and limits must hold.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import sandbox
from sandbox import Limits, SandboxUnavailable, run_python

FAST = Limits(wall_s=5, cpu_s=3, memory_mb=256, file_mb=1, nproc=8)
# Replaces the audit hook's code with a no-op: what an adversary does first.
HOOK_OFF = "import sys\nsys.modules['__main__'].hook.__code__ = (lambda e, a: None).__code__\n"
LIBDIR = os.path.dirname(os.__file__)  # the stdlib: mounted read-only in the sandbox


def running(marker: str) -> list[int]:
    """Host pids of live processes whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and entry.name.isdigit():
            pids.append(int(entry.name))
    return pids


def test_runs_code_with_stdin_in_a_private_tmp() -> None:
    name = f"radixserve-scratch-{uuid.uuid4().hex}"
    code = f"import os\nprint(input()[::-1])\nopen({name!r}, 'w').write('x')\nprint(os.getcwd())"
    r = run_python(code, "hello\n", FAST)
    assert r.status == "ok" and r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["olleh", "/tmp"]
    assert not (Path("/tmp") / name).exists()  # its /tmp is not the host's


def test_exception_is_an_error_with_its_traceback() -> None:
    r = run_python("raise ValueError('boom')", "", FAST)
    assert (r.status, r.returncode) == ("error", 1)
    assert r.stderr.strip().endswith("ValueError: boom")


def test_runs_as_an_unprivileged_user_of_its_own() -> None:
    code = "import os\nprint(os.getuid(), os.getgid())\nprint(open('/proc/self/status').read())"
    r = run_python(code, "", FAST)
    assert r.ok, r.stderr
    ids, status = r.stdout.split("\n", 1)
    assert ids == f"{sandbox.SANDBOX_UID} {sandbox.SANDBOX_UID}"
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"] == fields["CapPrm"] == "0000000000000000", fields
    assert fields["NoNewPrivs"] == "1" and fields["Pid"] == "1", fields
    if os.geteuid() == 0:  # a fresh host uid, not root
        uid_map = run_python("print(open('/proc/self/uid_map').read())", "", FAST).stdout
        mapped = {int(f[0]): int(f[1]) for f in map(str.split, uid_map.strip().splitlines())}
        assert mapped[sandbox.SANDBOX_UID] >= sandbox.UID_BASE, uid_map


def test_infinite_loop_is_killed_at_the_wall_clock_timeout() -> None:
    start = time.perf_counter()
    r = run_python("while True:\n    pass\n", "", Limits(wall_s=1.5, cpu_s=30))
    elapsed = time.perf_counter() - start
    assert r.status == "timeout" and r.returncode is None
    # not before the timeout; ended by the kill, not by its CPU limit (30 s of CPU)
    assert 1.5 <= r.wall_s <= elapsed < 30, (r.wall_s, elapsed)


def test_sleeping_process_is_killed_at_the_wall_clock_timeout() -> None:
    r = run_python("import signal\nsignal.pause()\nprint('woke')", "", Limits(wall_s=1.0))
    assert r.status == "timeout" and r.stdout == "", (r.status, r.stdout)  # killed asleep


def test_cpu_limit_kills_a_spinning_process_before_the_wall_clock() -> None:
    r = run_python("while True:\n    pass\n", "", Limits(wall_s=20, cpu_s=1))
    assert r.status == "cpu" and r.returncode == -signal.SIGKILL, (r.status, r.returncode)


@pytest.mark.parametrize(
    "hog",
    [
        "x = bytearray(2 ** 30)",  # one 1 GiB allocation
        "x = []\nwhile True:\n    x.append(bytearray(10 ** 6))",  # growth until the limit
        HOOK_OFF + "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n",
    ],
)
def test_memory_hog_hits_the_address_space_limit(hog: str) -> None:
    r = run_python(hog, "", Limits(wall_s=10, memory_mb=256))
    if "setrlimit" in hog:  # raising the hard limit needs a capability it has not
        assert r.status == "error" and "not allowed to raise" in r.stderr, r.stderr[-300:]
    else:
        assert r.status == "memory", (r.status, r.stderr[-300:])


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
def test_process_creation_is_refused_by_the_audit_hook(bomb: str) -> None:
    r = run_python(bomb, "", FAST)
    assert r.status == "blocked", (r.status, r.stderr[-300:])


def test_fork_bomb_is_bounded_by_the_process_limit() -> None:
    code = HOOK_OFF + (
        "import os, signal\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            signal.pause()\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print(n, type(e).__name__)\n"
    )
    r = run_python(code, "", FAST)
    assert r.ok and r.stdout.split() == [str(FAST.nproc - 1), "BlockingIOError"], r
    classic = run_python(HOOK_OFF + "import os\nwhile True:\n    os.fork()", "", FAST)
    assert classic.status == "error", (classic.status, classic.stderr[-300:])


@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_setsid_survivor_dies_with_the_sandbox(ending: str) -> None:
    """A double-forked, setsid()ed child that outlives the program: gone when the call ends."""
    marker = f"radixserve-survivor-{uuid.uuid4().hex}"
    code = HOOK_OFF + textwrap.dedent(f"""
        import os, signal, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                sleeper = ['-S', '-c', 'import signal; signal.pause()', {marker!r}]
                os.execv(sys.executable, [sys.executable, *sleeper])
            os._exit(0)
        for _ in range(200):  # until the survivor shows in the namespace's /proc
            pids = [p for p in os.listdir('/proc') if p.isdigit()]
            if any({marker!r}.encode() in open(f'/proc/{{p}}/cmdline', 'rb').read() for p in pids):
                break
            time.sleep(0.01)
        print('survivor up', flush=True)
        """)
    code += "signal.pause()\n" if ending == "timeout" else ""
    r = run_python(code, "", Limits(wall_s=2))
    assert r.stdout == "survivor up\n", r
    assert r.status == ("timeout" if ending == "timeout" else "ok"), r.stderr[-300:]
    assert running(marker) == [], "a process outlived its sandbox"


def test_other_processes_are_invisible_and_cannot_be_signalled() -> None:
    secret = f"sk-{uuid.uuid4().hex}"
    sleeper = ["-c", "import signal; signal.pause()", "--api-key", secret]
    victim = subprocess.Popen([sys.executable, *sleeper])
    try:
        code = HOOK_OFF + (
            "import os, signal\n"
            "for p in os.listdir('/proc'):\n    if p.isdigit():\n"
            "        print(p, open(f'/proc/{p}/cmdline', 'rb').read())\n"
            f"os.kill({victim.pid}, signal.SIGKILL)\n"
        )
        r = run_python(code, "", FAST)
        assert secret not in r.stdout and r.stdout.startswith("1 "), r.stdout
        assert len(r.stdout.splitlines()) == 1  # only itself
        assert r.status == "error" and "ProcessLookupError" in r.stderr, r.stderr[-300:]
        assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()


def test_files_outside_the_sandbox_cannot_be_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o644)
    for path in [secret, Path(__file__).resolve(), Path("/etc/passwd")]:
        r = run_python(f"print(open({str(path)!r}).read())", "", FAST)
        assert r.status == "error" and "FileNotFoundError" in r.stderr, (path, r.stderr[-300:])
        assert r.stdout == ""


ESCAPES = {
    "REFUSED.clear() then os.system": (
        "import os, sys\nsys.modules['__main__'].REFUSED.clear()\n"
        "sys.modules['__main__'].REFUSED_MODULES.clear()\n"
        "assert os.system('echo x > {lib}/{name}') == 0\n"
    ),
    "open": "open('{lib}/{name}', 'w').write('x')",
    "dir_fd": (
        "import os\nd = os.open('{lib}', os.O_RDONLY)\n"
        "os.open('{name}', os.O_WRONLY | os.O_CREAT, dir_fd=d)\n"
    ),
    "sqlite3.connect": (
        "import sqlite3\nsqlite3.connect('{lib}/{name}').execute('create table t(x)')"
    ),
    "link": "import os\nos.link('{lib}/this.py', '{lib}/{name}')",
    "outside /tmp": "open('{outside}', 'w').write('x')",
}


@pytest.mark.parametrize("how", sorted(ESCAPES))
def test_writes_outside_the_sandbox_fail(how: str, tmp_path: Path) -> None:
    name = f"radixserve-escape-{uuid.uuid4().hex}"
    outside = tmp_path / name  # the host's /tmp: the sandbox has a /tmp of its own
    code = ESCAPES[how].format(lib=LIBDIR, name=name, outside=outside)
    r = run_python(HOOK_OFF + code, "", FAST)
    assert not (Path(LIBDIR) / name).exists() and not outside.exists()
    assert (Path(LIBDIR) / "this.py").exists()
    if how != "outside /tmp":  # that one writes into its private /tmp: harmless
        assert r.status == "error", (r.status, r.stderr[-300:])


def test_fchmod_of_a_file_opened_for_reading_fails() -> None:
    target = Path(LIBDIR) / "this.py"
    mode = target.stat().st_mode
    code = f"import os\nfd = os.open({str(target)!r}, os.O_RDONLY)\nos.fchmod(fd, 0o777)\n"
    r = run_python(HOOK_OFF + code, "", FAST)
    assert r.status == "error" and "Read-only file system" in r.stderr, r.stderr[-300:]
    assert target.stat().st_mode == mode


def _listener() -> tuple[socket.socket, int]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    return srv, srv.getsockname()[1]


@pytest.mark.parametrize("hook", ["on", "off"])
def test_network_connect_to_a_host_listener_fails(hook: str) -> None:
    """The program tries to reach a port the test listens on: it must fail, and the
    listener must see no connection (the sandbox's loopback is its own)."""
    srv, port = _listener()
    try:
        code = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'leak')\n"
        )
        r = run_python((HOOK_OFF if hook == "off" else "") + code, "", Limits(wall_s=10))
        assert r.status == ("blocked" if hook == "on" else "error"), r.stderr[-300:]
        assert ("SandboxViolation" if hook == "on" else "ConnectionRefusedError") in r.stderr
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()


def test_the_audit_hook_refuses_signals_and_raising_limits() -> None:
    kill = run_python("import os\nos.kill(12345, 0)", "", FAST)
    assert kill.status == "blocked", kill.stderr[-300:]
    raise_cpu = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))"
    assert run_python(raise_cpu, "", FAST).status == "blocked"
    write = run_python(f"open({LIBDIR + '/x'!r}, 'w')", "", FAST)
    assert write.status == "blocked", write.stderr[-300:]


def test_fails_closed_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    sandbox.check_available.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="no bwrap"):
            run_python("print(1)")
    finally:
        sandbox.check_available.cache_clear()
