"""Every family the decoder runs beyond Llama (Qwen3, Gemma 3, Gemma 2, Phi-3, SmolLM3, and
the sliding windows of Qwen2 and Mistral) against HF transformers (the oracle) on tiny
random checkpoints built here (models/synthetic.py TINY_FAMILIES: sliding windows of 16,
partial rotary and longrope past an original context of 64, layers without RoPE), in
float32. Tolerances:
    logits: max abs diff <= 1e-4 x the largest |logit| (measured ~1e-7 relative)
    greedy tokens: identical to HF generate(do_sample=False), 8 prompts x 32 tokens
The server runs them as it runs Llama: tree attention with every shared segment kept,
speculative decoding, the radix cache; a prompt longer than the window is cached and then
extended.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers import alloc_slots, assert_all_free, extend, keep_every_segment, make_pool

from radixserve import Engine
from radixserve.attention.flat import FlatBackend
from radixserve.attention.tree import TreeBackend
from radixserve.models import load_model
from radixserve.models.config import ModelConfig
from radixserve.models.synthetic import build_tiny_model

FAMILIES = ["qwen3", "gemma3", "gemma2", "phi3", "smollm3", "qwen2", "mistral"]
REL_TOL = 1e-4
NEW_TOKENS = 32
ENGINE: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_model(root / f, seed=i, family=f) for i, f in enumerate(FAMILIES)}


def hf_model(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits_one_at_a_time(hf: Any, ids: list[int]) -> torch.Tensor:
    """HF's logits fed one token per forward with its cache (longrope's factors then follow
    each token's own position, as ours do; models/rope.py)."""
    cache, rows = None, []
    with torch.no_grad():
        for t in ids:
            out = hf(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def prompts(seed: int) -> list[list[int]]:
    """8 prompts of 17-31 tokens (past the window of 16); with 32 new tokens within longrope's
    original context (64: HF's Phi-3 generate recomputes its whole cache with the long
    factors once a sequence passes it, models/rope.py); the first two share 12 tokens and
    the third extends the second."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(100, 20000, (17 + 2 * i,), generator=g).tolist() for i in range(8)]
    out[1][:12] = out[0][:12]
    out[2] = out[1] + out[2][: 31 - len(out[1])]
    return out


def hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            min_new_tokens=NEW_TOKENS, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_the_family(checkpoints: dict[str, Path], family: str) -> None:
    _, cfg = load_model(checkpoints[family], torch.float32)
    expect = {
        "qwen3": dict(qk_norm=True, head_dim=32),
        "gemma3": dict(qk_norm=True, sandwich_norms=True, norm_offset=1.0, sliding_window=16,
                       local_rope_theta=10000.0, rope_theta=1e6, embed_scale=8.0,
                       query_pre_attn_scalar=24.0, hidden_act="gelu_pytorch_tanh"),
        "gemma2": dict(sandwich_norms=True, final_logit_softcap=5.0, sliding_window=16),
        "phi3": dict(rotary_dim=8),
        "smollm3": dict(rope_layers=(True, True, True, False)),
        "qwen2": dict(layer_types=("full_attention", "sliding_attention"), sliding_window=16),
        "mistral": dict(layer_types=("sliding_attention",) * 2, sliding_window=16),
    }[family]  # fmt: skip
    assert {k: getattr(cfg, k) for k in expect} == expect
    if family == "phi3":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.type == "longrope"
        assert cfg.rope_scaling.original_max_position_embeddings == 64


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_through_prefill_extend_and_decode(
    checkpoints: dict[str, Path], family: str
) -> None:
    """Positions 0..19 prefill, 20..44 one extend over the cache, 45..79 decodes: past the
    window (16) and longrope's original context (64)."""
    model, _ = load_model(checkpoints[family], torch.float32)
    ids = torch.randint(100, 20000, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    for backend, sliding_rows in ((FlatBackend(), False), (TreeBackend(), True)):
        pool = make_pool(model, 80, sliding_rows)
        slots = alloc_slots(pool, 80)[torch.randperm(80)]  # scattered slots
        parts = [extend(model, backend, pool, slots, ids[:20], 0)]
        parts.append(extend(model, backend, pool, slots, ids[20:45], 20))
        parts += [extend(model, backend, pool, slots, [ids[p]], p) for p in range(45, 80)]
        want = hf_logits_one_at_a_time(hf_model(checkpoints[family]), ids)
        diff = (torch.cat(parts) - want).abs().max().item()
        assert diff <= REL_TOL * want.abs().max().item(), f"{family}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_server_greedy_matches_hf_generate(checkpoints: dict[str, Path], family: str) -> None:
    """The same tokens as HF's generate for 8 prompts x 32 tokens from two engines: tree
    attention keeping every shared segment with speculative decoding (drafts from the radix
    cache and the samples' own tokens), and flat attention with none. A prompt that extends
    an earlier one reuses its cached K/V past the window."""
    rest = check_server_greedy(checkpoints[family], seed=FAMILIES.index(family))
    assert rest[0]["meta_info"]["cached_tokens"] > 16  # ps[2] extends ps[1]: past the window


def test_a_window_no_shorter_than_the_context_never_binds() -> None:
    """Phi-4-mini's sliding_window (262144) exceeds its context (131072): its layers run as
    full layers, with no sliding rows to size (Phi-3-mini-4k's 2047 of 4096 does bind)."""
    base = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}  # fmt: skip
    wide = {**base, "sliding_window": 262144, "max_position_embeddings": 131072}
    assert [ModelConfig.from_hf(wide).window(i) for i in range(2)] == [0, 0]
    narrow = ModelConfig.from_hf({**base, "sliding_window": 2047, "max_position_embeddings": 4096})
    assert [narrow.window(i) for i in range(2)] == [2047, 2047]


def test_unsupported_fields_are_named() -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 256}  # fmt: skip
    gemma2 = {**base, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 8}
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        ModelConfig.from_hf({**gemma2, "use_bidirectional_attention": True})
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"],
                             "rope_parameters": dynamic})  # fmt: skip
    phi3 = {**base, "architectures": ["Phi3ForCausalLM"], "rope_scaling": {
        "type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}  # fmt: skip
    with pytest.raises(ValueError, match="short_factor / long_factor have 1 / 1 entries"):
        ModelConfig.from_hf(phi3)
    with pytest.raises(ValueError, match="hidden_act 'relu2'"):
        ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "hidden_act": "relu2"})


def check_server_greedy(checkpoint: Path, seed: int) -> list[dict[str, Any]]:
    """HF's greedy tokens for 8 prompts x 32 tokens from two engines: tree attention keeping
    every shared segment with speculative decoding (drafts from the radix cache and the
    samples' own tokens), and flat attention with none; every slot freed after. Returns the
    tree engine's answers to prompts 2.. (the second batch)."""
    hf = hf_model(checkpoint)
    ps = prompts(seed=seed)
    want = [hf_greedy(hf, p) for p in ps]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    spec = Engine(str(checkpoint), attention_backend="tree", **ENGINE)
    plain = Engine(str(checkpoint), attention_backend="flat",
                   speculative_algorithm="none", **ENGINE)  # fmt: skip
    backend = spec.scheduler.worker.backend
    assert isinstance(backend, TreeBackend)
    with keep_every_segment(backend):  # (a sample reading a kept segment drafts nothing)
        first = spec.generate(input_ids=ps[:2], sampling_params=params)
        rest = spec.generate(input_ids=ps[2:], sampling_params=params)
    again = spec.generate(input_ids=ps[3], sampling_params=params)  # drafts: the cache
    assert [o["output_ids"] for o in first + rest] == want
    assert again["output_ids"] == want[3]
    assert spec.scheduler.stats().accepted_draft_tokens_total > 0
    out = plain.generate(input_ids=ps, sampling_params=params)
    assert [o["output_ids"] for o in out] == want
    for engine in (spec, plain):
        assert_all_free(engine)
    return rest


def check_tensor_parallel_greedy(checkpoint: Path, seed: int) -> None:
    """Two TP ranks' greedy tokens on 4 prompts == HF's, and the follower rank exits 0."""
    from radixserve.distributed.parallel import get_tp

    hf = hf_model(checkpoint)
    ps = prompts(seed=seed)[:4]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    engine = Engine(str(checkpoint), tp_size=2, **ENGINE)
    try:
        out = engine.generate(input_ids=ps, sampling_params=params)
        assert [o["output_ids"] for o in out] == [hf_greedy(hf, p) for p in ps]
    finally:
        tp = get_tp()
        engine.worker.close()
    assert tp is not None and [p.exitcode for p in tp.followers] == [0]


@pytest.mark.slow  # a two-process engine per family: ~5-9 s each
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_greedy_matches_hf(checkpoints: dict[str, Path], family: str) -> None:
    """Two ranks (each 2 q heads, 1 KV head, half the MLP; q/k norms and the sandwich norms
    replicated, Phi-3's fused tensors split before sharding): HF's greedy tokens."""
    check_tensor_parallel_greedy(checkpoints[family], seed=FAMILIES.index(family))
