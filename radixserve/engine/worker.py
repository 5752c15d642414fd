"""Model worker: owns the model, the KV pool and the attention backend; runs one step."""

from __future__ import annotations

import logging

import psutil
import torch

from radixserve.attention import make_backend
from radixserve.config import EngineConfig
from radixserve.engine.batch import ForwardBatch
from radixserve.kvcache.pool import KVPool
from radixserve.models.config import ModelConfig
from radixserve.models.loader import load_model

logger = logging.getLogger("radixserve.worker")


def kv_capacity(config: EngineConfig, model: ModelConfig, bytes_per_token: int) -> int:
    """KV pool size in tokens: --max-total-tokens, else a fraction of available memory."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
    else:
        free = psutil.virtual_memory().available
    return max(int(free * config.mem_fraction) // bytes_per_token, 16)


class ModelWorker:
    """Contract: `forward(batch, rows)` writes the batch's new K/V into the pool and returns
    float32 logits (len(rows), vocab) for the flattened token rows `rows`."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        torch.manual_seed(config.random_seed)
        self.model, self.model_config = load_model(model_path, config.torch_dtype, config.device)
        self.backend = make_backend(config.attention_backend)
        mc = self.model_config
        itemsize = torch.empty((), dtype=config.torch_dtype).element_size()
        per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize
        capacity = kv_capacity(config, mc, per_token)
        self.pool = KVPool(
            capacity + 1,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            config.torch_dtype,
            config.device,
        )
        logger.info(
            "KV pool: %d tokens (%.1f MiB, %d B/token), attention backend %s",
            capacity,
            capacity * per_token / 2**20,
            per_token,
            self.backend.name,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        self.backend.plan(batch)
        hidden = self.model(batch, self.backend)  # (T, hidden)
        return self.model.compute_logits(hidden[rows])  # (len(rows), vocab) float32
