"""Building radixserve's C++ CPU kernels (models/csrc, kernels/csrc) with torch's extension
builder: one place for the flags, the module names and the fallback.

Each source is built once per ISA (module name `<name>_<isa>`, cached by torch under
~/.cache/torch_extensions with the source hash) with -O3 and -fopenmp: at::parallel_for is
inline OpenMP, serial without it; the link resolves to the libgomp.so.1 torch has loaded.
The AVX2 build adds -mavx2 -mfma -mf16c and defines RS_AVX2; the AVX-512 build is the same
plus RS_AVX512 (its few AVX-512 functions carry target attributes and check the CPU first);
"scalar" is portable C++. Without a compiler, or with RADIXSERVE_NATIVE_OPS=0, `build`
returns None and the callers run the same math as torch ops.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("radixserve.native")
VECTOR_FLAGS = {"avx512": ["-mavx2", "-mfma", "-mf16c", "-DRS_AVX2", "-DRS_AVX512"],
                "avx2": ["-mavx2", "-mfma", "-mf16c", "-DRS_AVX2"], "scalar": []}  # fmt: skip


def build(name: str, source: Path, isa: str | None) -> ModuleType | None:
    """Compile `source` as `name` (per ISA when `isa` is given: `name_isa`, its vector flags);
    None, logged, when disabled or the build fails."""
    if os.environ.get("RADIXSERVE_NATIVE_OPS", "1") == "0":
        logger.info("native CPU kernels disabled by RADIXSERVE_NATIVE_OPS=0 (%s)", source.name)
        return None
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-fopenmp", *(VECTOR_FLAGS[isa] if isa else [])]
    module_name = f"{name}_{isa}" if isa else name
    try:
        module = load(module_name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler / ninja, or a failing build: fall back, loudly
        logger.warning("native CPU kernels %s unavailable (%s); using torch ops", module_name, exc)
        return None
    logger.info("native CPU kernels %s built (%s)", module_name, source.name)
    return module
