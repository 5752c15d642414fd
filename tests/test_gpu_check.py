"""benchmarks/gpu_check.py's own logic, on the CPU: the greedy comparison rule, and its
end-to-end section run through the real engine and HF transformers (the slow tier). The
kernel check runs in tests/test_kernels.py under the Triton interpreter."""

from __future__ import annotations

import gpu_check
import pytest
import torch


def test_a_divergence_passes_only_at_a_near_tie() -> None:
    ref = [{"ids": [1, 2, 3], "gaps": [2.0, 0.05, 3.0]}, {"ids": [4, 5], "gaps": [1.0, 1.0]}]
    same = [{"ids": [1, 2, 3], "gaps": [2.0, 0.0, 3.0]}, {"ids": [4, 5], "gaps": [1.0, 1.0]}]
    assert gpu_check.compare_greedy(ref, same, 0.1)["ok"]
    tie = [{"ids": [1, 9, 9], "gaps": [2.0, 0.0, 0.0]}, {"ids": [4, 5], "gaps": [1.0, 1.0]}]
    got = gpu_check.compare_greedy(ref, tie, 0.1)
    assert got["ok"] and got["prompts"][0] == {
        "identical": 1,
        "cpu_gap": 0.05,
        "gpu_gap": 0.0,
        "ok": True,
    }
    wrong = [{"ids": [1, 2, 3], "gaps": [2.0, 0.0, 3.0]}, {"ids": [7, 5], "gaps": [1.0, 1.0]}]
    got = gpu_check.compare_greedy(ref, wrong, 0.1)
    assert not got["ok"] and got["prompts"][1]["identical"] == 0


@pytest.mark.slow
def test_e2e_section_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """tree and flat generate the same greedy samples of one shared prompt; HF transformers
    (bf16, batched) the same ones up to a near-tie of the float32 model (gpu_check's rule:
    the two tokens' float32 logits within NEAR_TIE["bfloat16"])."""
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    out = gpu_check.check_e2e(None, batch=4, prompt=300, new=6)
    for name in ("tree", "flat", "hf"):  # (its rates are timings: on a loaded machine < 0)
        assert len(out[name]["first_sample"]) == 6
    assert out["tree_same_tokens_as_flat"] == 6, out
    same, flat, hf = (
        out["hf_same_tokens_as_flat"],
        out["flat"]["first_sample"],
        out["hf"]["first_sample"],
    )
    if same < 6:
        logits = float32_logits(gpu_check.e2e_prompt(300) + flat[:same])
        gap = abs(logits[flat[same]] - logits[hf[same]]).item()
        assert gap < gpu_check.NEAR_TIE["bfloat16"], (same, gap, out)


def float32_logits(ids: list[int]) -> torch.Tensor:
    """The next-token logits (vocab,) of the embedded model's GGUF weights dequantized to
    float32, through HF transformers."""
    from radixserve.models.resolve import resolve_model_path

    hf = gpu_check.hf_model(resolve_model_path(None), torch.float32)
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1]
