"""benchmarks/bench_vs_llamacpp.py at tiny sizes on the embedded model: both sides generate
exactly the requested tokens, from the same prompt length, and every row is reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import bench_vs_llamacpp as bench
import pytest
from llamacpp_side import SUPERVISED, cpu_flags, rebuild_command

B, P, N = 2, 64, 4
TINY = [
    *("--batch", str(B), "--prefix", str(P), "--new-tokens", str(N)),
    *("--prefill", str(P), "--decode-prompt", str(P), "--roofline", "off"),
]
ROW_NAMES = [f"W(B={B},P={P})", f"prefill P={P}", f"decode B=1 P={P}"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A script that runs its work under `supervise`, as the benchmarks do where llama.cpp loads;
# the work is dying by the signal named in argv[1].
DIES_BY_SIGNAL = """
import os, signal, sys
from llamacpp_side import supervise
supervise(__file__, sys.argv[1:])
os.kill(os.getpid(), signal.Signals[sys.argv[1]])
"""
NO_AMX = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


def expected_tokens(row: dict[str, Any]) -> list[int]:
    """Tokens per sequence each side must produce for `row`."""
    return [row["new_tokens"]] * row["batch"]


def check_radixserve(res: dict[str, Any]) -> None:
    rows = res["rows"]  # one model's result
    assert [r["name"] for r in rows] == ROW_NAMES
    assert [(r["batch"], r["prompt"], r["new_tokens"]) for r in rows] == [
        (B, P, N),
        (1, P, 1),
        (1, P, N),
    ]
    for r in rows:
        assert r["radixserve_tokens_per_seq"] == expected_tokens(r), r["name"]
        assert r["radixserve_prompt_tokens"] == P, r["name"]
    assert sum(rows[0]["radixserve_tokens_per_seq"]) == B * N
    assert res["radixserve_config"]["kv_capacity_tokens"] >= bench.kv_needed(bench.parse_args(TINY))


@pytest.mark.slow  # the radixserve side through the whole benchmark (~9 s)
def test_radixserve_side(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    res = bench.main([*TINY, "--skip-llamacpp", "--no-memory", "--json", str(out)])
    (model,) = res["models"]  # the embedded GGUF by default
    check_radixserve(model)
    assert json.loads(out.read_text())["models"][0]["rows"] == model["rows"]
    assert model["llamacpp"] is None and model["memory"] is None
    assert all(r["speedup"] is None and r["llamacpp_best"] is None for r in model["rows"])


@pytest.mark.slow  # both engines through the whole benchmark (~12 s; needs llama-cpp-python)
def test_both_sides(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    out, png = tmp_path / "res.json", tmp_path / "res.png"
    res = bench.main([*TINY, "--json", str(out), "--plot", str(png)])
    (model,) = res["models"]
    check_radixserve(model)
    for r in model["rows"]:
        assert r["llamacpp_tokens_per_seq"] == {
            "off": expected_tokens(r),
            "on": expected_tokens(r),
        }, r["name"]
        best = (min if r["unit"] == "s" else max)(r["llamacpp_off"], r["llamacpp_on"])
        assert r["llamacpp_best"] == best
    assert model["llamacpp"]["kv_unified"] is True
    assert png.read_bytes()[:8] == PNG_MAGIC
    memory = model["memory"]  # each side loaded and ran alone in a child process
    for side in ("radixserve", "llamacpp"):
        assert memory[side]["load_s"] > 0 and memory[side]["peak_rss_bytes"] > 50e6, memory
    assert memory["rss_ratio"] == (
        memory["radixserve"]["peak_rss_bytes"] / memory["llamacpp"]["peak_rss_bytes"]
    )


@pytest.mark.slow  # llama.cpp through the whole benchmark (~6 s; needs llama-cpp-python)
def test_llamacpp_side_alone(tmp_path: Path) -> None:
    """--skip-radixserve: llama.cpp's rows only (a file too big to load twice), with the
    prompt the radixserve side of another run gets."""
    pytest.importorskip("llama_cpp")
    res = bench.main([*TINY, "--skip-radixserve", "--no-memory"])
    (model,) = res["models"]
    assert [r["name"] for r in model["rows"]] == ROW_NAMES
    assert model["radixserve_config"] is None
    for r in model["rows"]:
        assert r["radixserve"] is None and r["speedup"] is None and r["llamacpp_best"] > 0
        assert r["llamacpp_tokens_per_seq"]["off"] == expected_tokens(r), r["name"]


def test_speedup_direction() -> None:
    """Seconds: llama.cpp best / radixserve; tok/s: radixserve / llama.cpp best."""
    secs = bench.make_row("w", "samples", "s", (2, 8, 4), {"off": 6.0, "on": 4.0}, 2.0)
    assert (secs["llamacpp_best"], secs["speedup"]) == (4.0, 2.0)
    rate = bench.make_row("p", "prefill", "tok/s", (1, 8, 1), {"off": 100.0, "on": 50.0}, 300.0)
    assert (rate["llamacpp_best"], rate["speedup"]) == (100.0, 3.0)
    none = bench.make_row("p", "prefill", "tok/s", (1, 8, 1), {}, 300.0)
    assert (none["llamacpp_best"], none["speedup"]) == (None, None)


def test_engine_args_parse_json_else_string() -> None:
    got = bench.engine_args(["max_total_tokens=20000", "dtype=float32", "disable_radix_cache=true"])
    assert got == {"max_total_tokens": 20000, "dtype": "float32", "disable_radix_cache": True}
    with pytest.raises(SystemExit, match="key=value"):
        bench.engine_args(["oops"])


def test_prompt_is_exact_and_prefix_closed(tmp_path: Path) -> None:
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}. #### {2 * i}"}
        for i in range(200)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))

    class CharTokenizer:  # one id per character: lengths are easy to reason about
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    tok = CharTokenizer()
    for path in (str(data), None):
        long, short = bench.prompt_ids(tok, 300, path), bench.prompt_ids(tok, 100, path)
        assert len(long) == 300 and len(short) == 100
        assert long[:100] == short
    assert bench.prompt_ids(tok, 40, str(data))[:9] == tok.encode("Question:")


def run_dying(tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    """DIES_BY_SIGNAL run as a script, its work process killed by signal `name`."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_BY_SIGNAL)
    env = {**os.environ, "PYTHONPATH": str(Path(bench.__file__).parent)}
    env.pop(SUPERVISED, None)
    return subprocess.run(
        [sys.executable, str(script), name],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_sigill_is_named_with_the_rebuild_command(tmp_path: Path) -> None:
    done = run_dying(tmp_path, "SIGILL")
    assert done.returncode == 128 + signal.SIGILL == 132, done.stderr
    assert "Fatal Python error: Illegal instruction" in done.stderr  # the child's traceback
    assert "dies.py (llama.cpp in its process) died by SIGILL." in done.stderr
    assert f"  {rebuild_command(cpu_flags())}\n" in done.stderr
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF ' in done.stderr and NO_AMX in done.stderr


def test_sigsegv_is_named_without_the_rebuild_command(tmp_path: Path) -> None:
    done = run_dying(tmp_path, "SIGSEGV")
    assert done.returncode == 128 + signal.SIGSEGV == 139, done.stderr
    assert "dies.py (llama.cpp in its process) died by SIGSEGV." in done.stderr
    assert "CMAKE_ARGS" not in done.stderr


def test_rebuild_command_follows_cpu_flags() -> None:
    tail = "pip install --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python"
    avx512 = {"avx2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni"}
    assert rebuild_command({"avx2", "fma", "f16c", "amx_tile", "amx_int8"}) == (
        f'CMAKE_ARGS="-DGGML_NATIVE=OFF {NO_AMX}" {tail} llama-cpp-python'
    )
    assert rebuild_command(avx512 | {"avx_vnni", "amx_tile"}) == (
        'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON '
        f'-DGGML_AVX512_VNNI=ON {NO_AMX}" {tail} llama-cpp-python'
    )
    assert "-DGGML_AVX512=ON" not in rebuild_command(avx512 - {"avx512bw"})  # all five or none
