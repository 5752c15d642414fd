"""Attention ops for tree-structured (Hydragen) attention, with one dispatch point.

Public ops (shapes: n/T query rows, L/S key rows, Hq query heads, Hkv KV heads, D head dim;
Hq % Hkv == 0; q/k/v share a dtype; LSE is float32 natural-log of the scaled scores):

- segment_attention(q (n,Hq,D), k (L,Hkv,D), v (L,Hkv,D), scale) -> out (n,Hq,D), lse (n,Hq)
- private_attention(q (T,Hq,D), k (S,Hkv,D), v, q_lens, kv_lens, scale) -> out, lse
- merge_states(outs (N,T,Hq,D), lses (N,T,Hq)) -> out (T,Hq,D), lse (T,Hq)

Implementations: "reference" (readable torch, the oracle).
"""

from __future__ import annotations

from radixserve.kernels.reference import merge_states, private_attention, segment_attention

__all__ = ["merge_states", "private_attention", "segment_attention"]
