"""Model implementations (Llama family) and checkpoint loading."""

from __future__ import annotations

from radixserve.models.config import ModelConfig, RopeScaling
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.loader import load_model, load_tokenizer
from radixserve.models.resolve import resolve_model_path

__all__ = [
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeScaling",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
]
