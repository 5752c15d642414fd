"""Pure @triton.jit kernels for the attention ops; host wrappers live in triton_ops.py.

Conventions shared by all kernels:
- Rows of a tile are GQA-stacked: for KV head `kvh`, stacked row r is query row r // GROUP
  of query head kvh * GROUP + r % GROUP, so one K/V tile load serves the whole group.
- Softmax runs in base 2 (exp2/log2): logits are multiplied by qk_scale = scale * log2(e),
  and the natural-log LSE is recovered as ln(2) * (m + log2(l)).
- Online softmax state per row: m (running max, base-2 logits), l (sum of 2^(s - m)),
  acc (sum of 2^(s - m) * v). A row that has seen no visible key has m = -inf, and m is
  replaced by 0 before subtracting, so no inf - inf (NaN) is ever formed.
- Head-dim loads are masked to HEAD_DIM (BLOCK_D is the next power of two, >= 16);
  the innermost (head-dim) stride is 1 (the wrappers guarantee it).
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = 0.6931471805599453


@triton.jit
def _attend_keys(
    q,  # (BLOCK_M, BLOCK_D) tile, input dtype
    k_base,  # pointer to key 0 of this sequence and KV head
    v_base,
    stride_kl,
    stride_vl,
    hi,  # keys [0, hi) are loaded; per-row visibility is further limited by row_last
    row_last,  # (BLOCK_M,) int: last key index row may see (bottom-right causal, or hi - 1)
    qk_scale,
    offs_d,
    d_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Flash-style online softmax of q against keys [0, hi): returns (acc, m, l)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ld_mask = (offs_n < hi)[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :], mask=ld_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N) fp32
        visible = (offs_n[None, :] < hi) & (offs_n[None, :] <= row_last[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)  # rescales the old state; 0 while m_i is -inf
        p = tl.exp2(s - m_sub[:, None])  # (M, N), 0 where not visible
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :], mask=ld_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _store_state(o_ptrs, lse_ptrs, acc, m_i, l_i, row_ok, d_mask):
    """Normalize and store: out = acc / l, lse = ln2 * (m + log2 l); l == 0 -> 0 and -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def segment_fwd_kernel(
    Q, K, V, OUT, LSE,  # q/o (n, Hq, D); k/v (L, Hkv, D); lse (n, Hq) fp32
    n_rows,
    seg_len,
    qk_scale,
    stride_qn, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh,
    stride_on, stride_oh, stride_ln, stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(n * GROUP, BLOCK_M), Hkv): one tile of stacked rows against the whole
    segment, no mask; the segment K/V of a head is streamed once per tile of rows."""
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # stacked rows
    row_ok = r < n_rows * GROUP
    i = r // GROUP  # query row
    h = kvh * GROUP + r % GROUP  # query head
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_ptrs = Q + i[:, None] * stride_qn + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    row_last = tl.zeros([BLOCK_M], tl.int32) + (seg_len - 1)  # every key visible
    acc, m_i, l_i = _attend_keys(
        q, K + kvh * stride_kh, V + kvh * stride_vh, stride_kl, stride_vl, seg_len, row_last,
        qk_scale, offs_d, d_mask, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION,
    )  # fmt: skip
    o_ptrs = OUT + i[:, None] * stride_on + h[:, None] * stride_oh + offs_d[None, :]
    _store_state(o_ptrs, LSE + i * stride_ln + h * stride_lh, acc, m_i, l_i, row_ok, d_mask)


@triton.jit
def private_fwd_kernel(
    Q, K, V, OUT, LSE,  # q/o (T, Hq, D); k/v (S, Hkv, D); lse (T, Hq) fp32
    Q_START, K_START,  # (B + 1,) int32 prefix sums of q_lens / kv_lens
    qk_scale,
    stride_qn, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh,
    stride_on, stride_oh, stride_ln, stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(max q_len * GROUP, BLOCK_M), Hkv, B): one tile of request b's stacked rows.

    Bottom-right causal: query t (0-based among the request's q_len) is key position
    kv_len - q_len + t and sees keys 0 .. kv_len - q_len + t. Keys past the tile's last
    visible key are never loaded; tiles past the request's rows load nothing."""
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(Q_START + b)
    q_len = tl.load(Q_START + b + 1) - q0
    k0 = tl.load(K_START + b)
    kv_len = tl.load(K_START + b + 1) - k0
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < q_len * GROUP
    t = r // GROUP  # query index within the request
    h = kvh * GROUP + r % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_ptrs = Q + (q0 + t)[:, None] * stride_qn + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    row_last = kv_len - q_len + t
    t_max = (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP  # last query index in this tile
    hi = tl.minimum(kv_len, kv_len - q_len + t_max + 1)
    hi = tl.where(pid_m * BLOCK_M < q_len * GROUP, hi, 0)
    acc, m_i, l_i = _attend_keys(
        q, K + k0 * stride_kl + kvh * stride_kh, V + k0 * stride_vl + kvh * stride_vh,
        stride_kl, stride_vl, hi, row_last,
        qk_scale, offs_d, d_mask, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION,
    )  # fmt: skip
    o_ptrs = OUT + (q0 + t)[:, None] * stride_on + h[:, None] * stride_oh + offs_d[None, :]
    lse_ptrs = LSE + (q0 + t) * stride_ln + h * stride_lh
    _store_state(o_ptrs, lse_ptrs, acc, m_i, l_i, row_ok, d_mask)


@triton.jit
def merge_kernel(
    OUTS, LSES, OUT, LSE,  # outs (N, R, D); lses (N, R) fp32; o (R, D); lse (R,) fp32
    n_parts,
    n_rows,
    stride_on, stride_or, stride_ln,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(R, BLOCK_R),), R = T * Hq rows: one pass over the N parts with a running
    max, the same online rescaling as attention (a part with lse -inf has weight 0)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for j in range(0, n_parts):
        lj = tl.load(LSES + j * stride_ln + rows, mask=row_ok, other=float("-inf"))
        oj = tl.load(OUTS + j * stride_on + rows[:, None] * stride_or + offs_d[None, :], mask=mask)
        m_new = tl.maximum(m, lj)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_sub)
        w = tl.exp(lj - m_sub)
        s = s * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * oj.to(tl.float32)
        m = m_new
    empty = s == 0.0
    out = acc / tl.where(empty, 1.0, s)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, s)))
    tl.store(
        OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask
    )
    tl.store(LSE + rows, lse, mask=row_ok)
