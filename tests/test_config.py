"""EngineConfig: fast-path fields validated once, their environment defaults (read once, at
import), and the CLI flags generated from the fields."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixserve.cli import build_parser, config_from_args
from radixserve.config import EngineConfig


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"attention_kernels": "fast"}, "attention_kernels must be one of"),
        ({"attention_kernels": "native", "native_ops": False}, "native needs native_ops"),
        ({"packed_linear": "yes"}, "packed_linear must be one of"),
        ({"quant_activations": "int4"}, "quant_activations must be one of"),
    ],
)
def test_fast_path_fields_are_validated(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_packed_linear_request() -> None:
    got = [EngineConfig(packed_linear=p).packed_linear_request for p in ("auto", "on", "off")]
    assert got == [None, True, False]


ENV_PROBE = (
    "from radixserve.config import EngineConfig as C; c = C(); "
    "print(c.native_ops, c.packed_linear, C(native_ops=True, packed_linear='auto').native_ops, "
    "c.hicache_encrypt, C(hicache_encrypt=False).hicache_encrypt)"
)


def probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    return subprocess.run(
        [sys.executable, "-c", ENV_PROBE], env={**clean, **env}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.slow  # a fresh interpreter per variable (~6 s)
def test_environment_sets_defaults_only() -> None:
    """RADIXSERVE_NATIVE_OPS / RADIXSERVE_PACKED_LINEAR / RADIXSERVE_HICACHE_ENCRYPT give the
    defaults; an explicit field wins; any other value fails at import, naming the variable."""
    env = {"RADIXSERVE_NATIVE_OPS": "0", "RADIXSERVE_PACKED_LINEAR": "1"}
    out = probe({**env, "RADIXSERVE_HICACHE_ENCRYPT": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "on", "True", "True", "False"]
    assert probe({}).stdout.split() == ["True", "auto", "True", "False", "False"]
    for name in ("RADIXSERVE_NATIVE_OPS", "RADIXSERVE_HICACHE_ENCRYPT"):
        bad = probe({name: "yes"})
        assert bad.returncode != 0 and f"{name} must be one of" in bad.stderr


def parse(*flags: str) -> EngineConfig:
    parser = build_parser()
    return config_from_args(parser.parse_args(["serve", *flags]), parser)


def test_cli_flags_map_onto_the_fields() -> None:
    assert parse() == EngineConfig()
    got = parse("--no-native-ops", "--attention-kernels", "reference", "--packed-linear", "off",
                "--disable-radix-cache", "--random-seed", "7")  # fmt: skip
    assert (got.native_ops, got.attention_kernels, got.packed_linear) == (False, "reference", "off")
    assert got.disable_radix_cache and got.random_seed == 7
    assert parse("--native-ops").native_ops
    assert parse("--hicache-encrypt").hicache_encrypt
    assert not parse("--no-hicache-encrypt").hicache_encrypt


def test_model_flags_and_sglang_alias() -> None:
    got = parse("--model-path", "Qwen/Qwen2.5-0.5B-Instruct", "--revision", "v1",
                "--served-model-name", "qwen")  # fmt: skip
    assert (got.model, got.revision, got.served_model_name) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "v1", "qwen",
    )  # fmt: skip
    assert parse("--model", "m.gguf").model == "m.gguf"
    assert (parse().revision, parse().served_model_name) == (None, None)
