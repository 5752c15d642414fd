"""The decoder every supported family runs (Llama, Qwen2, Mistral, Qwen3, Gemma 2 / 3, Phi-3,
SmolLM3, and the mixtures of experts Qwen3-MoE, OLMoE, Mixtral, gpt-oss), written for serving; the
families' differences are ModelConfig fields (radixserve/models/config.py names them).

Layout: the tokens of every request in the step are flattened into one (T, hidden) matrix,
request-major, with no batch or padding dimension; `batch.positions` (T,) gives each token's
absolute position and indexes the precomputed RoPE tables (models/rope.py). Attention (and
the KV pool) is the backend's business: each layer hands it q (T, Hq, D) and k/v (T, Hkv, D)
after RoPE, with its sliding window (0 = none).

Weights are stored fused for speed (the loader concatenates HF tensors at load time):
    qkv_proj.weight      (q_size + 2 * kv_size, hidden) = cat(q_proj, k_proj, v_proj)
    gate_up_proj.weight  (2 * intermediate, hidden)     = cat(gate_proj, up_proj)
Per layer: x -> RMSNorm -> attention -> +residual -> RMSNorm -> gated MLP -> +residual
(the MLP is a mixture of experts in a MoE layer: radixserve/models/moe.py)
(with `sandwich_norms`, Gemma's: the attention output and the MLP output are normed too
before their residual adds, and the MLP's input norm is `pre_feedforward_layernorm`).
Numerics follow HF transformers op for op (RMSNorm variance in float32, RoPE cos/sin computed
in float32 then cast to the model dtype): with the same SDPA attention kernel HF uses, float32
and plain-bf16 logits came out bit-identical to HF's in our tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radixserve.attention.base import AttentionBackend
from radixserve.core.batch import ForwardBatch
from radixserve.distributed.parallel import all_reduce
from radixserve.models import native, quant
from radixserve.models.config import ModelConfig
from radixserve.models.moe import MoE, NativeExperts, QuantExperts
from radixserve.models.quant import NativeLinear, QuantLinear
from radixserve.models.rope import apply_partial_rope, rope_qk, rope_table
from radixserve.models.sharding import local_config


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm: variance in float32, normalised value cast back before the weight.

    bf16 / float32 rows on CPU go through the fused native op (same rounding, one call)."""
    if native.applies(x) and weight.dtype == x.dtype and (fused := native.ops()) is not None:
        return fused.rms_norm(x, weight, eps)
    # One fused op for the float32 normalisation (same math, bit-identical to the unfused
    # pow/mean/rsqrt/mul chain): fewer small ops per layer on the decode hot path.
    if x.dtype == weight.dtype == torch.float32:  # no cast between: the weight fuses in too
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """HF's RMSNorm; with `offset` (Gemma's) the weight applies as (offset + w), multiplied in
    float32 before the cast back, as Gemma's norm does; `f32_product` (gpt-oss's) multiplies
    by w in float32 too."""

    def __init__(self, size: int, eps: float, offset: float = 0.0, f32_product: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.offset = offset
        self.f32_product = f32_product

    def forward(self, x: Tensor) -> Tensor:
        if not self.offset and (not self.f32_product or x.dtype == torch.float32):
            return rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # Gemma's float32 products, in the (fused) row op
            return rms_norm(x, self.offset + self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


def packed_linear_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where oneDNN pre-packed weights help: bf16 on a CPU whose oneDNN does bf16."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def fresh_weight(rows: int, cols: int) -> Tensor:
    """A new weight, N(0, 0.02) like HF's init; on the meta device (the loader's, which
    assigns every weight) left empty: the first random op there costs ~1 s of imports."""
    w = torch.empty(rows, cols)
    return w if w.is_meta else w.normal_(std=0.02)


class Linear(nn.Module):
    """y = x @ weight.T + bias over the last dim; weight (out, in) as in nn.Linear.

    Two implementations: plain F.linear (the reference; any device and dtype), or, after
    `pack()`, a oneDNN pre-packed copy of the weight (the CPU bf16 fast path). Packing
    frees the plain weight: a packed module has no `weight` (nor state_dict entry) and
    cannot be moved with `.to()`. Fresh weights are N(0, 0.02) like HF's init; the loader
    overwrites them.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        w = fresh_weight(out_features, in_features)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def pack(self) -> None:
        """Switch to the oneDNN packed weight (call `packed_linear_supported` first)."""
        # batch-size hint 1 (decode); the packed weight stays valid for any number of rows.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        del self.weight


Ropes = dict[str, Tensor]  # "global" / "local" -> (T, 2, rotary_dim) rows of this step


class LlamaAttention(nn.Module):
    # Under tensor parallelism `config` is one rank's shard (its heads) and o_proj's
    # partial sums are all-reduced over the `tp_size` ranks.
    def __init__(self, config: ModelConfig, layer_idx: int, tp_size: int = 1) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp_size = tp_size
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attn_scale
        self.window = config.window(layer_idx)
        self.softcap = config.attn_softcap
        self.sinks: nn.Parameter | None = None  # (Hq,) gpt-oss's sink logit per head
        if config.attn_sinks:
            self.sinks = nn.Parameter(torch.zeros(config.num_heads), requires_grad=False)
        # Which RoPE table this layer's q and k rotate by (None: no RoPE).
        self.rope: str | None = None
        if config.has_rope(layer_idx):
            local = config.sliding(layer_idx) and config.local_rope is not None
            self.rope = "local" if local else "global"
        self.full_rotary = config.rope.rotary_dim == config.head_dim
        self.q_norm = self.k_norm = None
        self.qk_norm_full = config.qk_norm_full  # over the whole projection (OLMoE)
        if config.qk_norm:
            eps, offset = config.rms_norm_eps, config.norm_offset
            full = config.qk_norm_full
            self.q_norm = RMSNorm(config.q_size if full else config.head_dim, eps, offset)
            self.k_norm = RMSNorm(config.kv_size if full else config.head_dim, eps, offset)
        qkv_out = config.q_size + 2 * config.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self, x: Tensor, ropes: Ropes, batch: ForwardBatch, attn: AttentionBackend
    ) -> Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q + 2 kv)
        cos_sin = ropes[self.rope] if self.rope else None  # (T, 2, R)
        if cos_sin is not None and self.q_norm is None and self.full_rotary:
            q, k = rope_qk(qkv, cos_sin, self.num_heads, self.num_kv_heads)  # (T, Hq|Hkv, D)
        else:
            q, k = self._normed_rotated(qkv, cos_sin)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, -1)  # view
        out = attn.forward(
            q, k, v, self.layer_idx, batch, self.scale, self.window, self.softcap, self.sinks
        )  # (T, Hq, D)
        out = self.o_proj(out.reshape(t, self.q_size))  # (T, hidden)
        return out if self.tp_size == 1 else all_reduce(out)

    def _normed_rotated(self, qkv: Tensor, cos_sin: Tensor | None) -> tuple[Tensor, Tensor]:
        """q (T, Hq, D) contiguous and k (T, Hkv, D) of the fused projection, each head
        RMS-normed (q/k norms) and rotated (partial or no RoPE) as the config says."""
        t, d = qkv.shape[0], self.head_dim
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        if self.qk_norm_full and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over all heads of each row
        q, k = q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_full:
            q = self.q_norm(q.reshape(-1, d)).view(t, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(t, self.num_kv_heads, d)
        if cos_sin is not None:
            q, k = apply_partial_rope(q, cos_sin), apply_partial_rope(k, cos_sin)
        return q.contiguous(), k


class LlamaMLP(nn.Module):
    # Under tensor parallelism `config` is one rank's shard (its slice of the intermediate
    # dimension) and down_proj's partial sums are all-reduced over the `tp_size` ranks.
    def __init__(self, config: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        inter, bias = config.intermediate_size, config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU, else SwiGLU

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out = self.down_proj(act * up)  # (T, hidden)
        return out if self.tp_size == 1 else all_reduce(out)


@dataclass(frozen=True)
class NativeMLP:
    """A dense gated MLP's quantized projections; `gelu`: tanh-GELU gate, else SiLU."""

    gate_up: NativeLinear
    down: NativeLinear
    gelu: bool


@dataclass(frozen=True)
class NativeMoE:
    """A mixture of experts as `post_attention_moe` takes it: the float32 router (E, hidden)
    and its bias, moe.route's settings, and the experts (QuantExperts.native_arg)."""

    router: Tensor
    router_bias: Tensor | None
    top_k: int
    renormalise: bool
    topk_softmax: bool
    experts: NativeExperts


@dataclass(frozen=True)
class NativeLayer:
    """A decoder layer's weights as the native layer halves take them (quant_cpu.cpp
    `pre_attention` / `post_attention` or `post_attention_moe`): every projection quantized,
    float32 activations. Norm weights are the factors the norms multiply by (Gemma's 1 + w);
    an absent norm is an empty tensor."""

    ops: ModuleType
    eps: float
    input_norm: Tensor
    qkv: NativeLinear
    q_norm: Tensor  # (D,), OLMoE's (Hq * D,), or empty
    k_norm: Tensor
    o: NativeLinear
    attn_out_norm: Tensor  # (hidden,) with sandwich norms, else empty
    mlp_norm: Tensor  # the MLP's input norm
    mlp: NativeMLP | NativeMoE
    mlp_out_norm: Tensor  # (hidden,) with sandwich norms, else empty


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp_size: int = 1) -> None:
        super().__init__()
        size, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_offset
        f32 = config.norm_weight_f32
        self.input_layernorm = RMSNorm(size, eps, offset, f32)
        self.self_attn = LlamaAttention(config, layer_idx, tp_size)
        # Llama: the MLP's input norm; with sandwich norms, the attention output's.
        self.post_attention_layernorm = RMSNorm(size, eps, offset, f32)
        self.mlp: LlamaMLP | MoE
        if config.is_moe(layer_idx):
            router = Linear(size, config.num_experts, bias=config.router_bias)
            self.mlp = MoE(config, router, tp_size)
        else:
            self.mlp = LlamaMLP(config, tp_size)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, offset)
        self.native: NativeLayer | None = None  # see LlamaForCausalLM.use_native_layers

    def forward(
        self, h: Tensor, ropes: Ropes, batch: ForwardBatch, attn: AttentionBackend
    ) -> Tensor:
        if self.native is not None:
            return self._native_forward(self.native, h, ropes, batch, attn)
        a = self.self_attn(self.input_layernorm(h), ropes, batch, attn)
        pre, post = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre is None or post is None:
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(a)
        return h + post(self.mlp(pre(h)))

    def native_layer(self, ops: ModuleType) -> NativeLayer | None:
        """This layer's weights for the native calls, or None where a projection is not
        quantized (or a mixture of experts' router is not a float32 Linear)."""
        a = self.self_attn
        qkv, o, mlp = a.qkv_proj, a.o_proj, self._native_mlp()
        if not (isinstance(qkv, QuantLinear) and isinstance(o, QuantLinear)):
            return None
        if mlp is None:
            return None
        if isinstance(mlp, NativeMoE) and self.pre_feedforward_layernorm is not None:
            return None  # (post_attention_moe has no sandwich norms: no such model has)
        post, pre_mlp = self.post_attention_layernorm, self.pre_feedforward_layernorm
        return NativeLayer(
            ops, self.input_layernorm.eps, _factors(self.input_layernorm), qkv.native_arg(),
            _factors(a.q_norm), _factors(a.k_norm), o.native_arg(),
            _factors(post if pre_mlp is not None else None), _factors(pre_mlp or post), mlp,
            _factors(self.post_feedforward_layernorm),
        )  # fmt: skip

    def _native_mlp(self) -> NativeMLP | NativeMoE | None:
        m = self.mlp
        if isinstance(m, LlamaMLP):
            gate_up, down = m.gate_up_proj, m.down_proj
            if isinstance(gate_up, QuantLinear) and isinstance(down, QuantLinear):
                return NativeMLP(gate_up.native_arg(), down.native_arg(), m.gelu)
            return None
        router, experts = m.gate, m.experts
        if not isinstance(router, Linear) or router.packed is not None:
            return None
        if router.weight.dtype != torch.float32 or not isinstance(experts, QuantExperts):
            return None
        return NativeMoE(
            router.weight, router.bias, m.top_k, m.renormalise, m.topk_softmax,
            experts.native_arg(),
        )  # fmt: skip

    def _native_forward(
        self,
        n: NativeLayer,
        h: Tensor,
        ropes: Ropes,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> Tensor:
        """The same layer in two native calls around attention (the module path's math)."""
        a = self.self_attn
        kv_like = batch.kv_pool.k[a.layer_idx]  # k and v come back in the pool's dtype
        table = ropes[a.rope] if a.rope else NO_TENSOR  # (T, 2, R) or none
        q, k, v = n.ops.pre_attention(
            h, n.input_norm, n.eps, n.qkv, table, a.num_heads, a.num_kv_heads, a.head_dim,
            n.q_norm, n.k_norm, kv_like,
        )  # fmt: skip
        out = attn.forward(q, k, v, a.layer_idx, batch, a.scale, a.window, a.softcap, a.sinks)
        attn_out = out.reshape(h.shape[0], a.q_size)
        m = n.mlp
        if isinstance(m, NativeMoE):
            return n.ops.post_attention_moe(
                h, attn_out, n.o, n.mlp_norm, n.eps, m.router, m.router_bias, m.top_k,
                m.renormalise, m.topk_softmax, m.experts,
            )  # fmt: skip
        return n.ops.post_attention(
            h, attn_out, n.o, n.mlp_norm, n.eps, m.gate_up, m.down, n.attn_out_norm,
            n.mlp_out_norm, m.gelu,
        )  # fmt: skip


NO_TENSOR = torch.empty(0)  # an absent norm or RoPE table, for the native layer halves


def _factors(norm: RMSNorm | None) -> Tensor:
    """What `norm` multiplies the normalised rows by, float32 (Gemma's: 1 + w), or empty."""
    if norm is None:
        return NO_TENSOR
    return (norm.offset + norm.weight.float()) if norm.offset else norm.weight


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        w = fresh_weight(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=w)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp_size) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config.norm_offset, config.norm_weight_f32
        )


class LlamaForCausalLM(nn.Module):
    """Serving forward over a ForwardBatch.

    Parameter names mirror HF except the fused `qkv_proj` and `gate_up_proj`; with tied
    embeddings there is no `lm_head` and logits use `model.embed_tokens.weight`.
    The RoPE tables are non-persistent buffers (not in state_dict): `rope` for the full
    layers (and all layers without `local_rope_theta`), `rope_local` for the sliding layers
    of a family with their own base (else empty); after loading weights onto a device, call
    `build_rope_cache()` (the loader does).

    Tensor parallel (`tp_size` > 1, see radixserve.distributed.parallel): the layers hold one
    rank's shard of the projections (built from `local_config`) and all-reduce after o_proj
    and down_proj; embeddings, norms and the head are replicated. `config` stays the full
    model's. Needs the TP process group to exist before `forward`.
    """

    def __init__(self, config: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.tp_size = tp_size
        self.model = LlamaModel(config if tp_size == 1 else local_config(config, tp_size), tp_size)
        self.lm_head: Linear | QuantLinear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_head_packed: Tensor | None = None  # packed copy of the tied embedding
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.register_buffer("rope_local", torch.empty(0), persistent=False)
        if self.model.norm.weight.device.type != "meta":
            self.build_rope_cache()

    def build_rope_cache(self) -> None:
        """(Re)compute the RoPE tables on the device and in the dtype of the weights."""
        w = self.model.norm.weight  # always a plain tensor in the model dtype
        c = self.config
        self.rope = rope_table(c.rope, c.max_position_embeddings, w.dtype, w.device)
        self.rope_local = torch.empty(0, dtype=w.dtype, device=w.device)
        if c.local_rope is not None:
            self.rope_local = rope_table(c.local_rope, c.max_position_embeddings, w.dtype, w.device)

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids (T,) -> (T, hidden) in the model dtype (a quantized table dequantizes
        just those rows)."""
        table, dtype = self.model.embed_tokens, self.model.norm.weight.dtype
        rows = (
            table.rows(ids).to(dtype)
            if isinstance(table, QuantLinear)
            else F.embedding(ids, table.weight)
        )
        if self.config.embed_scale == 1.0:
            return rows
        # As HF: the scale rounded to float32, then to the model dtype.
        return rows * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(dtype)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> Tensor:
        """Run all layers over the batch's new tokens -> (T, hidden) final-normed states.

        Expects `attn.plan(batch)` to have been called for this step. Mutates only the KV
        pool (through the backend). Positions must be < max_position_embeddings.
        """
        assert self.rope.shape[0] > 0, "RoPE cache not built: call build_rope_cache()"
        # (T, 2, R) rows: [cos | cos], [-sin | sin] at each token's position
        ropes = {"global": self.rope[batch.positions]}
        if self.rope_local.numel():
            ropes["local"] = self.rope_local[batch.positions]
        h = self.embed(batch.input_ids)  # (T, hidden)
        for layer in self.model.layers:
            h = layer(h, ropes, batch, attn)
        return self.model.norm(h)

    def use_native_layers(self) -> bool:
        """Run each decoder layer as two native calls around attention where that is the
        same math: CPU, float32 activations, one rank, every projection quantized (a
        mixture of experts' too, its router a float32 Linear) and the quantized kernels
        built. A batch-1 decode
        step makes ~25 small torch ops and Python calls a layer otherwise (measured ~1/3 of
        the step at 1K context on the AVX2 EPYC). Returns whether it applies."""
        ops, norm = quant.ops(), self.model.norm.weight
        on_cpu_f32 = norm.device.type == "cpu" and norm.dtype == torch.float32
        if ops is None or self.tp_size > 1 or not on_cpu_f32:
            return False
        layers = [ly for ly in self.model.layers if isinstance(ly, LlamaDecoderLayer)]
        natives = [layer.native_layer(ops) for layer in layers]
        if any(n is None for n in natives):
            return False
        for layer, n in zip(layers, natives, strict=True):
            layer.native = n
        return True

    def pack_linear_weights(self) -> None:
        """Switch every projection and the LM head to oneDNN packed weights (see Linear).

        Irreversible; the model must already be on CPU in its final dtype. The tied
        embedding table stays plain (token lookup needs it) and the head gets a packed copy.
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None and not isinstance(self.model.embed_tokens, QuantLinear):
            w = self.model.embed_tokens.weight.detach()
            self.tied_head_packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)

    @torch.no_grad()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (n, hidden) -> logits (n, vocab) float32 (matmul in the model dtype, as HF),
        soft-capped as cap * tanh(logits / cap) where the config has a final cap."""
        logits = self._head(hidden).float()
        cap = self.config.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _head(self, hidden: Tensor) -> Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if isinstance(self.model.embed_tokens, QuantLinear):  # tied to a quantized table
            return self.model.embed_tokens(hidden)
        if self.tied_head_packed is not None:
            w = self.tied_head_packed
            return torch.ops.mkldnn._linear_pointwise(hidden, w, None, "none", [], "")
        return F.linear(hidden, self.model.embed_tokens.weight)
