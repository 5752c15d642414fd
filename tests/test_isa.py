"""ISA detection and the `dtype="auto"` choice (radixserve/isa.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from radixserve import isa
from radixserve.config import EngineConfig


@pytest.fixture(autouse=True)
def _fresh_isa_cache():
    isa.cpu_isa.cache_clear()
    yield
    isa.cpu_isa.cache_clear()


def test_auto_is_the_default_and_unknown_dtypes_are_refused() -> None:
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="fp8")


@pytest.mark.parametrize("fast, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_picks_bf16_only_where_it_is_fast(monkeypatch, fast: bool, want: torch.dtype) -> None:
    monkeypatch.setattr(isa, "fast_cpu_bf16", lambda: fast)
    dtype, why = isa.resolve_dtype("auto", "cpu")
    assert dtype == want
    assert isa.cpu_isa() in why  # the log line names the ISA it found


def test_explicit_dtype_is_honoured_and_slow_bf16_warns(monkeypatch, caplog) -> None:
    monkeypatch.setattr(isa, "fast_cpu_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="radixserve.isa"):
        assert isa.resolve_dtype("bfloat16", "cpu") == (torch.bfloat16, "requested")
    assert "slower than float32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixserve.isa"):
        assert isa.resolve_dtype("float32", "cpu") == (torch.float32, "requested")
    assert caplog.text == ""


def test_isa_override_only_lowers(monkeypatch) -> None:
    native = isa.cpu_isa()
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "scalar")
    isa.cpu_isa.cache_clear()
    assert isa.cpu_isa() == "scalar"
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "avx512")
    isa.cpu_isa.cache_clear()
    assert isa.cpu_isa() == native  # never raised above what the CPU has
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "sse9")
    isa.cpu_isa.cache_clear()
    with pytest.raises(ValueError, match="RADIXSERVE_CPU_ISA"):
        isa.cpu_isa()


def test_avx2_environment_gives_float32() -> None:
    """Under the settings that make any x86 box behave as an AVX2-only one, auto is float32."""
    code = (
        "from radixserve.isa import cpu_isa, resolve_dtype;"
        "print(cpu_isa(), resolve_dtype('auto', 'cpu')[0])"
    )
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[1] == "torch.float32", out
    assert out[0] in ("avx2", "scalar"), out


def test_quant_kernels_take_the_vnni_build_only_where_the_cpu_has_it(monkeypatch) -> None:
    """The AVX512-VNNI build is compiled for AVX-512 as a whole: it must never load on a CPU
    without those instructions (AVX-512 without VNNI gets the AVX2 kernels)."""
    monkeypatch.setattr(isa, "cpu_isa", lambda: "avx512")
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(isa.VNNI_FLAGS | {"fma"}))
    assert isa.quant_kernel_isa() == "avx512vnni"
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(isa.VNNI_FLAGS - {"avx512_vnni"}))
    assert isa.quant_kernel_isa() == "avx2"
    monkeypatch.setattr(isa, "cpu_flags", lambda: None)
    assert isa.quant_kernel_isa() == "avx2"
    for lower in ("avx2", "scalar"):
        monkeypatch.setattr(isa, "cpu_isa", lambda lower=lower: lower)
        assert isa.quant_kernel_isa() == lower
