"""Pure @triton.jit kernels for the attention ops; host wrappers live in triton_ops.py.

Conventions shared by all kernels:
- Rows of a tile are GQA-stacked: for KV head `kvh`, stacked row r is query row r // GROUP
  of query head kvh * GROUP + r % GROUP, so one K/V tile load serves the whole group.
- Softmax runs in base 2 (exp2/log2): logits are multiplied by qk_scale = scale * log2(e),
  and the natural-log LSE is recovered as ln(2) * (m + log2(l)).
- Online softmax state per row: m (running max, base-2 logits), l (sum of 2^(s - m)),
  acc (sum of 2^(s - m) * v). A row that has seen no visible key has m = -inf, and m is
  replaced by 0 before subtracting, so no inf - inf (NaN) is ever formed. A finished state
  (out, lse) is resumed exactly as m = lse * log2(e), l = 1, acc = out.
- Key rows are read in place: row j of a request is K[SLOTS[k0 + j]] (INDEXED: a KV pool
  read by slot) or K[k0 + j] (dense, requests concatenated).
- Head-dim loads are masked to HEAD_DIM (BLOCK_D is the next power of two, >= 16);
  the innermost (head-dim) stride is 1 (the wrappers guarantee it).
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_keys(
    q,  # (BLOCK_M, BLOCK_D) tile, input dtype
    m_i,  # (BLOCK_M,) fp32 running state, updated and returned
    l_i,
    acc,  # (BLOCK_M, BLOCK_D) fp32
    k_head,  # pointer to row 0 of this KV head's keys
    v_head,
    slots,  # pointer to this request's first slot (INDEXED), else unused
    k0,  # this request's first key row (dense)
    stride_kl,
    stride_vl,
    lo,  # keys [lo, hi) are loaded; per-row visibility is further limited by row_last
    hi,
    row_last,  # (BLOCK_M,) int: last key index row may see (bottom-right causal, or hi - 1)
    qk_scale,
    offs_d,
    d_mask,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INDEXED: tl.constexpr,
):
    """Flash-style online softmax of q against keys [lo, hi), continuing (m_i, l_i, acc)."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        if INDEXED:
            rows = tl.load(slots + offs_n, mask=in_range, other=0).to(tl.int64)
        else:
            rows = (k0 + offs_n).to(tl.int64)
        ld_mask = in_range[:, None] & d_mask[None, :]
        k = tl.load(k_head + rows[:, None] * stride_kl + offs_d[None, :], mask=ld_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        visible = in_range[None, :] & (offs_n[None, :] <= row_last[:, None])
        s = tl.where(visible, s, float("-inf"))  # (M, N) fp32
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)  # rescales the old state; 0 while m_i is -inf
        p = tl.exp2(s - m_sub[:, None])  # (M, N), 0 where not visible
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + rows[:, None] * stride_vl + offs_d[None, :], mask=ld_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def attend_fwd_kernel(
    Q, K, V, SLOTS,  # q (T, Hq, D); k/v (rows, Hkv, D): dense keys or a pool layer
    Q_START,  # (B + 1,) prefix sums of q_lens (int64); unread if SINGLE
    K_START, K_LEN,  # (B,) each request's first key (a row of K, or of SLOTS) and key count
    PRIOR_O, PRIOR_LSE,  # (T, Hq, D), (T, Hq) fp32: the state to resume (HAS_PRIOR)
    OUT, LSE,  # (SPLITS, T, Hq, D), (SPLITS, T, Hq) fp32; the SPLITS axis only when > 1
    single_q_len,  # SINGLE: the one request's q_len and kv_len
    single_kv_len,
    qk_scale,
    stride_qn, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh,
    stride_pn, stride_ph, stride_pln, stride_plh,
    stride_os, stride_on, stride_oh, stride_ls, stride_ln, stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
    INDEXED: tl.constexpr,
    HAS_PRIOR: tl.constexpr,
    SPLITS: tl.constexpr,
    SINGLE: tl.constexpr,
):  # fmt: skip
    """Grid (m tiles, Hkv, B * SPLITS): one tile of request b's stacked rows against split s
    of its keys (the keys cut into SPLITS runs of whole BLOCK_N blocks; SPLITS > 1 writes
    partial states for a merge, and then has no prior).

    CAUSAL (bottom-right): query t (0-based among the request's q_len) is key position
    kv_len - q_len + t and sees keys 0 .. kv_len - q_len + t; keys past the tile's last
    visible key are never loaded. Otherwise every query sees all of the request's keys.
    Tiles past the request's rows load nothing. SINGLE: one request whose lengths are
    scalar arguments (a shared segment; no offsets tensor to build per call)."""
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    if SINGLE:
        q0 = 0
        q_len = single_q_len
        k0 = 0
        kv_len = single_kv_len
    else:
        q0 = tl.load(Q_START + b)
        q_len = tl.load(Q_START + b + 1) - q0
        k0 = tl.load(K_START + b)
        kv_len = tl.load(K_LEN + b)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < q_len * GROUP
    t = r // GROUP  # query index within the request
    h = kvh * GROUP + r % GROUP
    row = (q0 + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tile_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(Q + row[:, None] * stride_qn + h[:, None] * stride_qh + offs_d[None, :],
                mask=tile_mask, other=0.0)  # fmt: skip
    if CAUSAL:
        row_last = kv_len - q_len + t
        t_max = (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP  # last query index in this tile
        hi = tl.minimum(kv_len, kv_len - q_len + t_max + 1)
    else:
        row_last = tl.zeros([BLOCK_M], tl.int32) + (kv_len - 1)
        hi = kv_len
    hi = tl.where(pid_m * BLOCK_M < q_len * GROUP, hi, 0)
    chunk = tl.cdiv(tl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(hi, lo + chunk)
    if HAS_PRIOR:
        p_lse = tl.load(PRIOR_LSE + row * stride_pln + h * stride_plh, mask=row_ok,
                        other=float("-inf"))  # fmt: skip
        m_i = p_lse * LOG2E
        l_i = tl.where(p_lse == float("-inf"), 0.0, 1.0)
        p_o = tl.load(PRIOR_O + row[:, None] * stride_pn + h[:, None] * stride_ph
                      + offs_d[None, :], mask=tile_mask, other=0.0)  # fmt: skip
        acc = p_o.to(tl.float32) * l_i[:, None]
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, K + kvh * stride_kh, V + kvh * stride_vh, SLOTS + k0, k0,
        stride_kl, stride_vl, lo, hi, row_last, qk_scale, offs_d, d_mask,
        BLOCK_N, DOT_PRECISION, INDEXED,
    )  # fmt: skip
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = OUT + split * stride_os + row[:, None] * stride_on + h[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=tile_mask)
    tl.store(LSE + split * stride_ls + row * stride_ln + h * stride_lh, lse, mask=row_ok)


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
