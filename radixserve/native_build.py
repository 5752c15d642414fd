"""Building radixserve's C++ CPU kernels (radixserve/csrc: one source a module, every source
including csrc/common.h) with torch's extension builder: one place for the folder, the flags,
the module names and the fallback.

Each source is built once per ISA (module name `<name>_<isa>`, cached with the source hash in
one folder per module, Python and torch version under $TORCH_EXTENSIONS_DIR or
~/.cache/torch_extensions) with -O3 and -fopenmp: at::parallel_for is
inline OpenMP, serial without it; the link resolves to the libgomp.so.1 torch has loaded.
The AVX2 build adds -mavx2 -mfma -mf16c, from which common.h defines RS_AVX2; the AVX-512
build adds AVX-512F/BW/VL/DQ (32 vector registers for the 8-lane code; RS_AVX512, whose
AVX512-BF16 functions carry target attributes and check the CPU first), so it loads on CPUs
that torch reports as AVX512;
"avx512vnni" (the quantized kernels, where the CPU has AVX512-VNNI) compiles the whole source
for AVX-512 with VNNI (RS_VNNI), so it is loaded only on such a CPU; "scalar" is portable C++.
Without a compiler `build` returns None, and while native ops are off (`use_native_ops(False)`)
every `@native_module` getter does: the callers then run the same math as torch ops.

Processes building or loading the same module take turns on an flock of its folder, which
the kernel releases when a holder dies. torch's own lock file, which a process killed while
building leaves behind and on which every later load would wait forever, is removed under it.

The switch is process-wide, like the attention ops' `kernels.set_impl`: these kernels are
called deep inside the model, the sampler and the attention ops. A ModelWorker sets it from
EngineConfig.native_ops when it starts (nothing else does in the package); a test that flips
it sets it back.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("radixserve.native")
CSRC = Path(__file__).with_name("csrc")  # every native source, and the headers they include
VECTOR_FLAGS = {"avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                               "-mavx512dq", "-mavx512vnni"],
                "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                           "-mavx512dq"],
                "avx2": ["-mavx2", "-mfma", "-mf16c"], "scalar": []}  # fmt: skip
_enabled = True  # EngineConfig.native_ops of the last ModelWorker started in this process

Getter = Callable[[], ModuleType | None]


def use_native_ops(enabled: bool) -> None:
    """Turn every native CPU kernel of this process on or off (modules stay built)."""
    global _enabled
    _enabled = enabled


def native_ops_enabled() -> bool:
    return _enabled


def native_module(get: Getter) -> Getter:
    """Decorate a getter that `build`s one module: the build runs once per process (cached,
    failure included; a call made while another thread builds waits for that build); the
    getter returns the module while native ops are on, else None."""
    built = functools.cache(get)
    turn = threading.Lock()

    @functools.wraps(get)
    def getter() -> ModuleType | None:
        if not _enabled:
            return None
        with turn:
            return built()

    return getter


def build_in_background(*steps: Callable[[], object]) -> None:
    """Run each step (a call that builds native modules through their getters) on a thread
    of its own and return: the compilers are processes, so modules build side by side, and
    with whatever the caller goes on to do."""
    for step in steps:
        threading.Thread(target=step, name="native build", daemon=True).start()


def build_folder(module_name: str) -> Path:
    """Where `module_name` is built and cached, for this Python and torch."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"{python}_torch{torch.__version__}" / module_name


def build(name: str, source: Path, isa: str | None) -> ModuleType | None:
    """Compile `source` as `name` (per ISA when `isa` is given: `name_isa`, its vector flags);
    None, logged, when the build fails."""
    from torch.utils.cpp_extension import load

    # No FMA contraction: the kernels write their FMAs as intrinsics, and scalar expressions
    # then round as written, like the torch formulas they mirror (the native decoder layer
    # gives the module path's logits bit for bit).
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", *(VECTOR_FLAGS[isa] if isa else [])]
    # torch rebuilds when the source or the flags change: the headers next to the source
    # (common.h, which every source includes, and the row loops it includes) enter through a
    # flag carrying their digest
    headers = sorted(source.parent.glob("*.h"))
    if headers:
        digest = hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:16]
        flags.append(f"-DRS_HEADERS_DIGEST={digest}")
    module_name = f"{name}_{isa}" if isa else name
    folder = build_folder(module_name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "radixserve.lock", "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)  # released on close, or when this process dies
            stale = folder / "lock"  # torch's: no live process holds it while we hold ours
            if stale.exists():
                logger.warning("removing %s, left by a build that was killed", stale)
                stale.unlink()
            module = load(
                module_name,
                [str(source)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
            )
    except Exception as exc:  # no compiler / ninja, or a failing build: fall back, loudly
        logger.warning("native CPU kernels %s unavailable (%s); using torch ops", module_name, exc)
        return None
    logger.info("native CPU kernels %s built (%s)", module_name, source.name)
    return module
