"""Run untrusted Python (model-written code) in a contained subprocess.

One call = one fresh process in a fresh temporary directory, which is its cwd and the only
place it may write. Containment, layer by layer:

- resource limits, set with `resource.setrlimit` by our runner inside the child before the
  candidate's code starts: CPU seconds, address space (memory), file size (stdout and stderr
  go to files, so a print loop hits it too), open files, no core dumps, and RLIMIT_NPROC
  (the kernel does not enforce NPROC for root, so for root the audit hook below is what
  stops a fork bomb);
- a wall-clock timeout, after which the whole process group (a new session) is SIGKILLed;
- no network: when `unshare --net` works (as root), or `unshare --user --net` (unprivileged
  user namespaces), the child runs in a new network namespace with no interface up
  ("netns"); otherwise an audit hook refuses every socket ("audit");
- an audit hook (PEP 578) in the child, always on, refusing process creation (fork, exec,
  spawn, system, subprocess and its `_posixsubprocess`), `ctypes` (which could call
  anything), signals to other processes, raising resource limits, and writes, renames and
  deletions outside the sandbox directory. Refusals raise `SandboxViolation` in the child,
  so they show as status "blocked".

Cost of the ctypes ban: packages that import ctypes (numpy among them) cannot be imported
in the sandbox; HumanEval and APPS solutions need only the standard library.

This contains mistakes and misbehaving samples; it is not a security boundary against an
adversary who knows it (a container, a seccomp filter or an unprivileged user would be).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NETWORK_MODES = ("auto", "netns", "audit")
STATUSES = ("ok", "error", "timeout", "cpu", "memory", "file_limit", "blocked")

# The child's bootstrap: set limits, install the audit hook, run the candidate as __main__.
# argv: runner.py PROGRAM SANDBOX_ROOT NETWORK_MODE CPU_S MEMORY_BYTES FILE_BYTES NPROC
RUNNER = r"""
import os, resource, sys

prog, root, network = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3]
cpu_s, memory, fsize, nproc = (int(v) for v in sys.argv[4:8])
for which, soft, hard in (
    (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),  # SIGXCPU at soft, SIGKILL at hard
    (resource.RLIMIT_AS, memory, memory),
    (resource.RLIMIT_FSIZE, fsize, fsize),
    (resource.RLIMIT_NOFILE, 64, 64),
    (resource.RLIMIT_CORE, 0, 0),
    (resource.RLIMIT_NPROC, nproc, nproc),
):
    resource.setrlimit(which, (soft, hard))


class SandboxViolation(RuntimeError):
    pass


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
REFUSED = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "ctypes.dlopen", "resource.setrlimit", "resource.prlimit",
}
# Their functions fork or call C without an audit event of their own.
REFUSED_MODULES = {"_posixsubprocess", "_ctypes"}
PATH_ARGS = {  # event -> how many leading arguments are paths that will be modified
    "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
    "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1, "os.rename": 2, "os.link": 2,
    "os.symlink": 2,
}


def inside(path):
    if isinstance(path, int):  # an fd the process already holds
        return True
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    return real == root or real.startswith(root + os.sep) or real == os.devnull


def hook(event, args):
    if event in REFUSED:
        raise SandboxViolation(f"{event} is not allowed in the sandbox")
    if network == "audit" and event.startswith("socket."):
        raise SandboxViolation(f"{event}: no network in the sandbox")
    if event == "import" and args[0] in REFUSED_MODULES:
        raise SandboxViolation(f"import {args[0]} is not allowed in the sandbox")
    if event in ("os.kill", "os.killpg") and args[0] not in (0, os.getpid()):
        raise SandboxViolation(f"{event} of another process")
    if event == "open" and args[2] & WRITE_FLAGS and not inside(args[0]):
        raise SandboxViolation(f"writing {args[0]!r} outside the sandbox")
    for path in args[: PATH_ARGS.get(event, 0)]:
        if not inside(path):
            raise SandboxViolation(f"{event} of {path!r} outside the sandbox")


sys.addaudithook(hook)
with open(prog, encoding="utf-8") as f:
    source = f.read()
sys.argv = [prog]
exec(compile(source, prog, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512  # address space (RLIMIT_AS), interpreter included
    file_mb: int = 16  # largest file the child may write, its stdout and stderr included
    nproc: int = 64  # RLIMIT_NPROC; see the module docstring about root
    network: str = "auto"  # "netns" | "audit" | "auto": netns if it works here, else audit
    output_chars: int = 64 * 1024  # how much of stdout / stderr is read back

    def __post_init__(self) -> None:
        assert self.network in NETWORK_MODES, f"network must be one of {NETWORK_MODES}"
        assert self.wall_s > 0 and self.cpu_s >= 1, (self.wall_s, self.cpu_s)
        assert self.memory_mb >= 32 and self.file_mb >= 1, (self.memory_mb, self.file_mb)


@dataclass(frozen=True)
class RunResult:
    status: str  # one of STATUSES
    returncode: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    network: str  # the isolation actually used: "netns" or "audit"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


NETNS_PREFIXES = (["unshare", "--net", "--"], ["unshare", "--user", "--net", "--"])


@functools.lru_cache(maxsize=1)
def netns_prefix() -> tuple[str, ...] | None:
    """The command prefix that runs a program in a new network namespace here, or None
    (probed once per process)."""
    if shutil.which("unshare") is None:
        return None
    for prefix in NETNS_PREFIXES:
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return tuple(prefix)
    return None


def network_mode(requested: str) -> str:
    """The isolation to use for `requested`; raises RuntimeError if "netns" is impossible."""
    if requested == "auto":
        return "netns" if netns_prefix() else "audit"
    if requested == "netns" and not netns_prefix():
        raise RuntimeError("network='netns' asked for, but `unshare --net` fails here")
    return requested


def _child_env(work: Path) -> dict[str, str]:
    # Nothing of ours leaks in (API keys, proxies); HOME points into the sandbox. PYTHON*
    # variables would be ignored anyway: the child runs with -I (isolated mode).
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
    }


def _classify(returncode: int | None, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    # We send SIGKILL only on the wall timeout (handled above), so a SIGKILL here is the
    # kernel's, at the hard CPU limit.
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"
    tail = stderr[-2000:]
    if returncode == -signal.SIGXFSZ or "File too large" in tail:
        return "file_limit"
    if "SandboxViolation" in tail:
        return "blocked"
    if "MemoryError" in tail:
        return "memory"
    return "error"


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_python(code: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
    """Run `code` as `__main__` in a fresh sandbox, feeding it `stdin`.

    Blocks for at most about `limits.wall_s` seconds. Nothing the child started survives
    the call (its process group is killed), and its temporary directory is removed.
    Raises RuntimeError only if network="netns" was asked for and is not available.
    """
    limits = limits or Limits()
    net = network_mode(limits.network)
    with tempfile.TemporaryDirectory(prefix="radixserve-sandbox-") as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        (root / "runner.py").write_text(RUNNER, encoding="utf-8")
        (root / "prog.py").write_text(code, encoding="utf-8")
        (root / "stdin").write_text(stdin, encoding="utf-8")
        cmd = [
            sys.executable,
            "-I",
            "-B",
            "-X",
            "utf8",
            str(root / "runner.py"),
            str(root / "prog.py"),
            str(root),
        ]
        cmd += [net, str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.file_mb << 20)]
        cmd += [str(limits.nproc)]
        if net == "netns":
            cmd = [*(netns_prefix() or ()), *cmd]
        returncode, timed_out, wall = _spawn(cmd, root, work, limits.wall_s)
        stdout = _read(root / "stdout", limits.output_chars)
        stderr = _read(root / "stderr", limits.output_chars)
    status = _classify(returncode, timed_out, stderr)
    return RunResult(status, returncode, stdout, stderr, wall, net)


def _spawn(cmd: list[str], root: Path, work: Path, wall_s: float) -> tuple[int | None, bool, float]:
    """Start `cmd` in a new session; wait up to `wall_s`; kill its whole process group."""
    start = time.perf_counter()
    with (
        open(root / "stdin", "rb") as fin,
        open(root / "stdout", "wb") as fout,
        open(root / "stderr", "wb") as ferr,
    ):
        proc = subprocess.Popen(
            cmd,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=work,
            env=_child_env(work),
            start_new_session=True,  # its own process group: pgid == proc.pid
            close_fds=True,
        )
    timed_out = False
    try:
        proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # also reaps stragglers of a child that exited on time
        proc.wait()
    return (None if timed_out else proc.returncode), timed_out, time.perf_counter() - start
