// Native CPU attention that reads K/V straight from the KV pool by slot index
// (kernels/native.py builds it; contracts in kernels/__init__.py).
//
// Built per ISA from this one file: with -mavx2 -mfma -mf16c (RS_AVX2 in common.h: 8-lane
// AVX2 vectors, F16C half loads), or portable (the same algorithm on a plain 8-float struct).
// The AVX-512 build (RS_AVX512, compiled for AVX-512F/BW/VL/DQ: the same 8-lane code with 32
// registers, so wider micro-tiles, kRowsMicro) adds one path, taken where the CPU has
// AVX512-BF16: a bf16 query against a bf16 pool with many rows per KV head gets its scores
// from vdpbf16ps (bf16 pairs multiplied exactly, summed in float32: 32 products an
// instruction against 8 for an AVX2 FMA), the online softmax in float32, and P.V from
// vdpbf16ps on the weights rounded to bf16 (what torch's bf16 flash attention does: ~2^-9
// relative per weight). Every op is a set of UNITS, one per (query group, KV head):
//
//   segment:  one unit per KV head; rows = every query row of every request under the
//             segment, GQA group stacked: row r = (token r / group, q head h*group + r%group)
//   private:  one unit per (request, KV head); rows the same stacking of the request's
//             q_len tokens; row r sees keys [0, kv_len - q_len + r / group + 1)
//
// A unit is cut into ITEMS = (row block, key chunk); items run on all threads (dynamic
// scheduling, biggest first). An item streams its keys in blocks of kBlock: the block's K/V
// rows are loaded once (in place for fp32; converted once for bf16 / fp16) and used by every
// query tile of kRows rows, with an online softmax (running max m, sum l, unnormalized O).
// Long key ranges are split into chunks across threads (flash-decoding) and the chunks'
// partial states merged by log-sum-exp afterwards. Everything accumulates in float32.
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;          // keys per block (K+V of a block: 32 KiB fp32 at D=64)
constexpr int kRows = 6;                // query rows per tile of a transposed block (6 rows x 16 keys)
#if defined(RS_AVX512)  // 32 vector registers
constexpr int kRowsMicro = 4;           // ... of key rows read in place (4 rows x 4 keys)
constexpr int kAccs = 24;               // accumulators a micro-kernel may hold
#else                                   // 16
constexpr int kRowsMicro = 3;
constexpr int kAccs = 12;
#endif
constexpr int kRowsBf16 = 6;            // ... on the vdpbf16ps path (6 rows x 64 keys = 24 zmm)
constexpr int64_t kMaxRows = 1024;      // rows per item: O accumulators stay in L2
constexpr int64_t kMinChunkKeys = 256;  // never split keys finer than this
constexpr int64_t kItemsPerThread = 8;  // split keys until there is about this much work
constexpr int64_t kPackRows = 12;       // items with this many rows transpose each K block
constexpr int64_t kConvertRows = 48;    // ... and convert a bf16 / fp16 block to fp32 first
constexpr int64_t kAllHeadsRows = 48;   // units with fewer rows per head span all KV heads
constexpr int64_t kStageKeys = 256;     // keys read ahead in address order by few-row items
constexpr float kLog2e = 1.44269504088896341f;  // scores are kept in base 2: exp2 is cheaper
constexpr float kLn2 = 0.693147180559945309f;

// ------------------------------------------------------------------ 8-lane float vectors
#if defined(RS_AVX2)
using V8 = __m256;
inline V8 vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V8 a) { _mm256_storeu_ps(p, a); }
inline V8 vset1(float x) { return _mm256_set1_ps(x); }
inline V8 vfma(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }
inline V8 vmul(V8 a, V8 b) { return _mm256_mul_ps(a, b); }
inline V8 vadd(V8 a, V8 b) { return _mm256_add_ps(a, b); }
inline V8 vmax(V8 a, V8 b) { return _mm256_max_ps(a, b); }
// hsum, hmax and load8 (8 stored values -> 8 float lanes): common.h
// out[0..4) = horizontal sums of a[0..4)
inline void hsum4(const V8* a, float* out) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
// 2^x for x <= 0: x = n + f, |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative
// error ~1e-7), 2^n in the exponent bits; x < -126 (or -inf) gives exactly 0.
inline V8 vexp2(V8 x) {
  const V8 tiny = _mm256_cmp_ps(x, vset1(-126.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, vset1(-126.f));
  const V8 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const V8 f = _mm256_sub_ps(x, n);
  V8 p = vset1(1.5403530393381609e-4f);  // ln2^k / k!, k = 6 .. 0
  p = vfma(p, f, vset1(1.3333558146428443e-3f));
  p = vfma(p, f, vset1(9.6181291076284772e-3f));
  p = vfma(p, f, vset1(5.5504108664821580e-2f));
  p = vfma(p, f, vset1(2.4022650695910071e-1f));
  p = vfma(p, f, vset1(6.9314718055994531e-1f));
  p = vfma(p, f, vset1(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, vmul(p, _mm256_castsi256_ps(e)));
}
// dst[i * ldd + j] = rows[j][off + i] for an 8 x 8 block (8 key rows -> 8 columns of K^T).
inline void transpose8(const float* const* rows, int64_t off, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + off);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then rows 4-7
    r[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#else
struct V8 {
  float x[8];
};
inline V8 vload(const float* p) {
  V8 a;
  for (int i = 0; i < 8; ++i) a.x[i] = p[i];
  return a;
}
inline void vstore(float* p, V8 a) {
  for (int i = 0; i < 8; ++i) p[i] = a.x[i];
}
inline V8 vset1(float v) {
  V8 a;
  for (int i = 0; i < 8; ++i) a.x[i] = v;
  return a;
}
inline V8 vfma(V8 a, V8 b, V8 c) {
  for (int i = 0; i < 8; ++i) c.x[i] = a.x[i] * b.x[i] + c.x[i];
  return c;
}
inline V8 vmul(V8 a, V8 b) {
  for (int i = 0; i < 8; ++i) a.x[i] *= b.x[i];
  return a;
}
inline V8 vadd(V8 a, V8 b) {
  for (int i = 0; i < 8; ++i) a.x[i] += b.x[i];
  return a;
}
inline V8 vmax(V8 a, V8 b) {
  for (int i = 0; i < 8; ++i) a.x[i] = std::max(a.x[i], b.x[i]);
  return a;
}
inline float hmax(V8 a) { return *std::max_element(a.x, a.x + 8); }
inline float hsum(V8 a) { return std::accumulate(a.x, a.x + 8, 0.0f); }
inline void hsum4(const V8* a, float* out) {
  for (int c = 0; c < 4; ++c) out[c] = hsum(a[c]);
}
inline V8 vexp2(V8 a) {
  for (int i = 0; i < 8; ++i) a.x[i] = std::exp2(a.x[i]);
  return a;
}
// 8 stored values -> 8 float lanes (the AVX2 build: common.h's load8)
template <typename T>
inline V8 load8(const T* p) {
  V8 a;
  for (int i = 0; i < 8; ++i) a.x[i] = static_cast<float>(p[i]);
  return a;
}
inline void transpose8(const float* const* rows, int64_t off, float* dst, int64_t ldd) {
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) dst[i * ldd + j] = rows[j][off + i];
}
#endif

// ------------------------------------------------------------------ problem description

// One layer's K or V pool: (num_slots, Hkv, D) of fp32 / bf16 / fp16, unit stride in D.
struct Cache {
  const char* data;
  at::ScalarType dtype;
  int64_t elt, slot_stride, head_stride;  // bytes per element; strides in elements

  const char* row(int64_t slot, int64_t head) const {
    return data + (slot * slot_stride + head * head_stride) * elt;
  }
};

// Query rows of a unit (see the file comment): row r of KV head h -> token tok0 + r / group,
// query head h * group + r % group. The same map addresses out and lse. A unit spans KV
// heads [head, head + heads): several when its rows per head are few (decode), so that one
// item streams whole pool rows (all heads of a slot are adjacent) instead of a strided slice.
struct Unit {
  int64_t tok0, q_len, head, heads;
  const int64_t* slots;  // the unit's keys, in position order
  int64_t kv_len;
  int64_t shift;  // row r sees keys [0, min(kv_len, shift + r / group + 1))
};

struct Item {
  int64_t unit, r0, r1, k0, k1;
  int64_t partial;  // first row in the partial buffers, or -1: write the output directly
  int64_t cost;
};

struct Problem {
  const at::Tensor* q;  // (T, Hq, D)
  at::Tensor out;       // (T, Hq, D), q's dtype
  at::Tensor lse;       // (T, Hq) float32
  Cache k, v;
  int64_t group, d;
  float scale;
  float softcap = 0.f;  // scores become softcap * tanh(score / softcap); 0 = none
  std::vector<Unit> units;
  std::vector<Item> items;
  at::Tensor part_o;    // (rows, D) float32: normalized O of each chunk
  at::Tensor part_lse;  // (rows,) float32
  // Optional prior state of the same query rows (out like `out`, lse like `lse`): the
  // attention over other keys that this op's result is merged with (see init_state).
  at::Tensor prior_o, prior_lse;

  int64_t limit(const Unit& u, int64_t row) const {
    return std::min(u.kv_len, u.shift + row / group + 1);
  }
};

// Row pointers of one key block, in the element type the micro-kernels read.
template <typename T>
struct Rows {
  const T* k[kBlock + 4];  // padded: the kernels read keys 4 (or 64, transposed) at a time
  const T* v[kBlock];
};

// Per-thread scratch, grown on demand and reused across calls.
struct Scratch {
  std::vector<float> q, o, m, l, s, kbuf, vbuf, kt;
  std::vector<uint32_t> qb;  // bf16 query pairs, unscaled (the vdpbf16ps path)
  std::vector<int64_t> lim;
  Rows<float> f32;
  Rows<at::BFloat16> bf16;
  Rows<at::Half> f16;
  float cap = 0.f;  // the problem's soft cap in base-2 score units (0 = none)
  int sink = 0;  // what warm_rows read, kept so the reads are not optimized away

  void fit(int64_t rows, int64_t d) {
    auto grow = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(q, rows * d), grow(o, rows * d), grow(m, rows), grow(l, rows), grow(lim, rows);
    grow(qb, rows * d / 2);
    grow(s, std::max(kRows, kRowsBf16) * kBlock), grow(kbuf, kBlock * d), grow(vbuf, kBlock * d);
    grow(kt, kBlock * d);
  }

  template <typename T>
  Rows<T>& rows() {
    if constexpr (std::is_same_v<T, float>) return f32;
    else if constexpr (std::is_same_v<T, at::BFloat16>) return bf16;
    else return f16;
  }
};

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// ------------------------------------------------------------------ loads and stores

template <typename T>
void to_float(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; i += 8) vstore(dst + i, load8(src + i));
}

void row_to_float(const char* src, at::ScalarType dt, float* dst, int64_t d) {
  switch (dt) {
    case at::kFloat: return to_float(reinterpret_cast<const float*>(src), dst, d);
    case at::kBFloat16: return to_float(reinterpret_cast<const at::BFloat16*>(src), dst, d);
    default: return to_float(reinterpret_cast<const at::Half*>(src), dst, d);
  }
}

template <typename T>
void store_row(const float* src, float mul, T* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

void row_from_float(const float* src, float mul, char* dst, at::ScalarType dt, int64_t d) {
  switch (dt) {
    case at::kFloat: return store_row(src, mul, reinterpret_cast<float*>(dst), d);
    case at::kBFloat16: return store_row(src, mul, reinterpret_cast<at::BFloat16*>(dst), d);
    default: return store_row(src, mul, reinterpret_cast<at::Half*>(dst), d);
  }
}

// Pointers to the rows of keys slots[0..n) of `head` as T: the pool rows themselves when
// they are T, else (T = float) copies converted once into `buf`, shared by every query tile.
template <typename T>
void block_rows(const Cache& c, const int64_t* slots, int64_t n, int64_t head, int64_t d,
                float* buf, const T** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const char* src = c.row(slots[j], head);
    if constexpr (std::is_same_v<T, float>) {
      if (c.dtype != at::kFloat) {
        row_to_float(src, c.dtype, buf + j * d, d);
        src = reinterpret_cast<const char*>(buf + j * d);
      }
    }
    rows[j] = reinterpret_cast<const T*>(src);
  }
}

// Ask for the K and V rows of the next block while this one is computed (rows by slot are
// scattered, so the hardware prefetcher alone sees no stream).
void prefetch_rows(const Problem& P, const int64_t* slots, int64_t n, int64_t head, int64_t heads) {
  const int64_t bytes = P.d * P.k.elt;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t h = head; h < head + heads; ++h) {
      const char* k = P.k.row(slots[j], h);
      const char* v = P.v.row(slots[j], h);
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b);
        __builtin_prefetch(v + b);
      }
    }
  }
}

// ------------------------------------------------------------------ micro-kernels
//
// Their loops over d or keys are unrolled 4x (`#pragma GCC unroll 4`): fewer loop branches
// between the FMAs made the segment op 5 % and the flat decode op ~20 % faster on AVX2 (Zen 3).

// s[r][j..j+4) = q_r . k_{j..j+4} for the MR query rows (stride d) and 4 key rows.
template <int MR, typename T>
inline void qk_micro(const float* q, int64_t d, const T* const* k, float* s, int64_t lds) {
  V8 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vset1(0.f);
#pragma GCC unroll 4
  for (int64_t i = 0; i < d; i += 8) {
    V8 qv[MR];
    for (int r = 0; r < MR; ++r) qv[r] = vload(q + r * d + i);
    for (int c = 0; c < 4; ++c) {
      const V8 kv = load8(k[c] + i);
      for (int r = 0; r < MR; ++r) acc[r][c] = vfma(qv[r], kv, acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) hsum4(acc[r], s + r * lds);
}

// acc[r][c] += a[r * lda] * b(c) for MR scalars a (broadcast) and NC vectors b(c), in the
// order that fits the 16 vector registers: MR * NC accumulators, then the NC vectors and one
// broadcast at a time (NC <= 2), else the MR broadcasts and one vector at a time.
template <int MR, int NC, typename B>
inline void outer_fma(V8 (&acc)[MR][NC], const float* a, int64_t lda, const B& b) {
  if constexpr (NC <= 2) {
    V8 bv[NC];
    for (int c = 0; c < NC; ++c) bv[c] = b(c);
    for (int r = 0; r < MR; ++r) {
      const V8 ab = vset1(a[r * lda]);
      for (int c = 0; c < NC; ++c) acc[r][c] = vfma(ab, bv[c], acc[r][c]);
    }
  } else {
    V8 ab[MR];
    for (int r = 0; r < MR; ++r) ab[r] = vset1(a[r * lda]);
    for (int c = 0; c < NC; ++c) {
      const V8 bv = b(c);
      for (int r = 0; r < MR; ++r) acc[r][c] = vfma(ab[r], bv, acc[r][c]);
    }
  }
}

// Keys per qk_packed call for MR rows: 12 accumulators at most.
template <int MR>
constexpr int64_t kPackedKeys = MR <= 3 ? 32 : 16;

// Same scores from the block transposed, kt (d, kBlock): s[r][0..K) for keys kt[:, 0..K),
// K = kPackedKeys. No horizontal sums: K / 8 vector FMAs per query row and dimension.
template <int MR>
inline void qk_packed(const float* q, int64_t d, const float* kt, float* s, int64_t lds) {
  constexpr int NC = kPackedKeys<MR> / 8;
  V8 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = vset1(0.f);
#pragma GCC unroll 4
  for (int64_t i = 0; i < d; ++i) {
    outer_fma<MR, NC>(acc, q + i, d, [&](int c) { return vload(kt + i * kBlock + 8 * c); });
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) vstore(s + r * lds + 8 * c, acc[r][c]);
}

// kt (d, kBlock) = the kBlock key rows (padded by the caller), transposed.
void pack_kt(const float* const* rows, int64_t d, float* kt) {
  for (int64_t j = 0; j < kBlock; j += 8)
    for (int64_t i = 0; i < d; i += 8) transpose8(rows + j, i, kt + i * kBlock + j, kBlock);
}

// o[r][i0 .. i0 + 8NV) = alpha[r] * o[r][...] + sum_j p[r][j] * v_j[...] over n keys.
template <int MR, int NV, typename T>
inline void pv_slice(float* o, int64_t d, int64_t i0, const float* alpha, const float* p,
                     int64_t ldp, const T* const* v, int64_t n) {
  V8 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    const V8 a = vset1(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = vmul(vload(o + r * d + i0 + 8 * c), a);
  }
#pragma GCC unroll 4
  for (int64_t j = 0; j < n; ++j) {
    outer_fma<MR, NV>(acc, p + j, ldp, [&](int c) { return load8(v[j] + i0 + 8 * c); });
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) vstore(o + r * d + i0 + 8 * c, acc[r][c]);
}

template <int MR, typename T>
void pv_tile(float* o, int64_t d, const float* alpha, const float* p, int64_t ldp,
             const T* const* v, int64_t n) {
  constexpr int NV = MR * 8 <= kAccs ? 8 : MR * 4 <= kAccs ? 4 : 2;  // MR * NV <= kAccs
  int64_t i0 = 0;
  for (; i0 + 8 * NV <= d; i0 += 8 * NV) pv_slice<MR, NV, T>(o, d, i0, alpha, p, ldp, v, n);
  for (; i0 < d; i0 += 8) pv_slice<MR, 1, T>(o, d, i0, alpha, p, ldp, v, n);
}

// Online-softmax step of MR rows (stride kBlock) over the block's scores s[r][0..n8) (n8 = n
// rounded up to 8), in base 2 (the queries carry scale * log2(e)): row r's keys at lim[r] - kb..
// are masked; with a soft cap (cap > 0, base 2) each visible score becomes cap * tanh(s / cap);
// s becomes the weights 2^(s - m_new); alpha[r] = the factor that rescales the row's earlier
// O and l. The rows go through each pass together: their max, exp and sum chains are
// independent, so they overlap instead of waiting on each other's latency.
template <int MR>
void softmax_tile(float* s, const int64_t* lim, int64_t kb, int64_t n8, float* m, float* l, float* alpha,
                  float cap) {
  V8 mx[MR], neg[MR], sum[MR];
  for (int r = 0; r < MR; ++r) {
    const int64_t seen = std::clamp<int64_t>(lim[r] - kb, 0, n8);
    if (cap > 0.f)
      for (int64_t j = 0; j < seen; ++j) s[r * kBlock + j] = cap * std::tanh(s[r * kBlock + j] / cap);
    for (int64_t j = seen; j < n8; ++j) s[r * kBlock + j] = kNegInf;
    mx[r] = vset1(kNegInf), sum[r] = vset1(0.f);
  }
  for (int64_t j = 0; j < n8; j += 8)
    for (int r = 0; r < MR; ++r) mx[r] = vmax(mx[r], vload(s + r * kBlock + j));
  float m_new[MR];
  for (int r = 0; r < MR; ++r) {
    m_new[r] = std::max(m[r], hmax(mx[r]));
    // nothing visible yet (m_new -inf): -inf - 0 gives weights 0, and l, O stay 0
    neg[r] = vset1(m_new[r] == kNegInf ? 0.f : -m_new[r]);
  }
  for (int64_t j = 0; j < n8; j += 8) {
    for (int r = 0; r < MR; ++r) {
      const V8 p = vexp2(vadd(vload(s + r * kBlock + j), neg[r]));
      vstore(s + r * kBlock + j, p);
      sum[r] = vadd(sum[r], p);
    }
  }
  for (int r = 0; r < MR; ++r) {
    alpha[r] = m[r] == kNegInf ? 0.f : std::exp2(m[r] - m_new[r]);
    l[r] = l[r] * alpha[r] + hsum(sum[r]);
    m[r] = m_new[r];
  }
}

// One query tile (MR rows of the item, from `row`) against the first n keys of the block
// starting at key kb: scores from kt when the block was transposed (kt non-null), else from
// the key rows (padded to a multiple of 4 by the caller).
template <int MR, typename T>
void tile_block(Scratch& sc, int64_t row, int64_t d, const float* kt, const T* const* k,
                const T* const* v, int64_t n, int64_t kb) {
  float* s = sc.s.data();
  const float* q = sc.q.data() + row * d;
  if (kt != nullptr) {
    for (int64_t j = 0; j < n; j += kPackedKeys<MR>) qk_packed<MR>(q, d, kt + j, s + j, kBlock);
  } else {
    for (int64_t j = 0; j < n; j += 4) qk_micro<MR, T>(q, d, k + j, s + j, kBlock);
  }
  const int64_t n8 = (n + 7) & ~int64_t{7};
  float alpha[MR];
  softmax_tile<MR>(s, sc.lim.data() + row, kb, n8, sc.m.data() + row, sc.l.data() + row, alpha, sc.cap);
  pv_tile<MR, T>(sc.o.data() + row * d, d, alpha, s, kBlock, v, n);
}

// ------------------------------------------------------------------ items

// Scratch row i of an item with `rows` rows per head is row it.r0 + i % rows of head
// u.head + i / rows: query token `tok`, query head `hq` (q / out / lse / prior index).
struct RowRef {
  int64_t tok, hq;

  int64_t in(const at::Tensor& t) const { return tok * t.stride(0) + hq * t.stride(1); }
};

RowRef locate(const Problem& P, const Unit& u, const Item& it, int64_t i) {
  const int64_t rows = it.r1 - it.r0, row = it.r0 + i % rows;
  return {u.tok0 + row / P.group, (u.head + i / rows) * P.group + row % P.group};
}

// Scaled float copies of the item's query rows, and each row's key limit.
void load_queries(const Problem& P, const Unit& u, const Item& it, Scratch& sc) {
  const char* base = static_cast<const char*>(P.q->data_ptr());
  const int64_t elt = P.q->element_size(), rows = it.r1 - it.r0;
  for (int64_t i = 0; i < rows * u.heads; ++i) {
    float* dst = sc.q.data() + i * P.d;
    row_to_float(base + locate(P, u, it, i).in(*P.q) * elt, P.q->scalar_type(), dst, P.d);
    for (int64_t c = 0; c < P.d; ++c) dst[c] *= P.scale * kLog2e;
    sc.lim[i] = std::min(it.k1, P.limit(u, it.r0 + i % rows));
  }
}

// The item's bf16 query rows as they are (unscaled pairs) for the vdpbf16ps path.
void load_query_pairs(const Problem& P, const Unit& u, const Item& it, Scratch& sc) {
  const char* base = static_cast<const char*>(P.q->data_ptr());
  for (int64_t i = 0; i < (it.r1 - it.r0) * u.heads; ++i)
    std::memcpy(sc.qb.data() + i * P.d / 2, base + locate(P, u, it, i).in(*P.q) * 2, P.d * 2);
}

// Normalize the item's rows and write them to the output (or its chunk's partial buffers).
void finish_item(Problem& P, const Unit& u, const Item& it, Scratch& sc) {
  const int64_t d = P.d;
  char* out = static_cast<char*>(P.out.data_ptr());
  float* lse_out = P.lse.data_ptr<float>();
  float* part_o = it.partial >= 0 ? P.part_o.data_ptr<float>() + it.partial * d : nullptr;
  float* part_lse = it.partial >= 0 ? P.part_lse.data_ptr<float>() + it.partial : nullptr;
  for (int64_t i = 0; i < (it.r1 - it.r0) * u.heads; ++i) {
    const float l = sc.l[i];
    const float lse = l > 0.f ? (sc.m[i] + std::log2(l)) * kLn2 : kNegInf;  // natural log
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (part_o != nullptr) {
      for (int64_t c = 0; c < d; ++c) part_o[i * d + c] = sc.o[i * d + c] * inv;
      part_lse[i] = lse;
      continue;
    }
    const RowRef at = locate(P, u, it, i);
    row_from_float(sc.o.data() + i * d, inv, out + at.in(P.out) * P.out.element_size(), P.out.scalar_type(), d);
    lse_out[at.in(P.lse)] = lse;
  }
}

// One key block [kb, kb + n) of one KV head through the query tiles of that head, whose
// scratch rows are [base, base + rows). The next block's `ahead` rows of this head are
// prefetched a few per tile: issued all at once they overflow the core's miss buffers.
template <typename T>
void head_block(Problem& P, const Unit& u, int64_t head, int64_t base, int64_t rows, int64_t kb, int64_t n,
                int64_t ahead, Scratch& sc) {
  const int64_t d = P.d;
  Rows<T>& br = sc.rows<T>();
  block_rows<T>(P.k, u.slots + kb, n, head, d, sc.kbuf.data(), br.k);
  block_rows<T>(P.v, u.slots + kb, n, head, d, sc.vbuf.data(), br.v);
  for (int64_t j = n; j < kBlock + 4; ++j) br.k[j] = br.k[n - 1];  // pad the block
  const float* kt = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (rows >= kPackRows) pack_kt(br.k, d, sc.kt.data()), kt = sc.kt.data();
  }
  const int64_t step = kt != nullptr ? kRows : kRowsMicro;
  const int64_t tiles = (rows + step - 1) / step, per = (ahead + tiles - 1) / tiles;
  for (int64_t t = base, j = 0; t < base + rows; t += step, j += per) {
    prefetch_rows(P, u.slots + kb + n + j, std::min(per, ahead - j), head, 1);
    const int mr = static_cast<int>(std::min<int64_t>(step, base + rows - t));
    const int64_t seen = std::min(n, sc.lim[t + mr - 1] - kb);  // keys any tile row sees
    if (seen <= 0) continue;
    switch (mr) {
      case 6: tile_block<6, T>(sc, t, d, kt, br.k, br.v, seen, kb); break;
      case 5: tile_block<5, T>(sc, t, d, kt, br.k, br.v, seen, kb); break;
      case 4: tile_block<4, T>(sc, t, d, kt, br.k, br.v, seen, kb); break;
      case 3: tile_block<3, T>(sc, t, d, kt, br.k, br.v, seen, kb); break;
      case 2: tile_block<2, T>(sc, t, d, kt, br.k, br.v, seen, kb); break;
      default: tile_block<1, T>(sc, t, d, kt, br.k, br.v, seen, kb);
    }
  }
}

#if defined(RS_AVX512)
#define RS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_bf16_dot() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
}

// s[r][0..kBlock) = mul * (q_r . k_j) for MR query rows given as bf16 pairs q (stride d2 pairs)
// and the block's keys as pairs kp (d2, kBlock): kp[i][j] = (k_j[2i], k_j[2i+1]).
template <int MR>
RS_BF16_TARGET inline void qk_bf16(const uint32_t* q, int64_t d2, const float* kp, float mul, float* s) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d2; ++i) {
    __m512bh kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + i * kBlock + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * d2 + i]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
    }
  }
  const __m512 m = _mm512_set1_ps(mul);
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kBlock + 16 * c, _mm512_mul_ps(acc[r][c], m));
}

// vp (ceil(n / 2), d) bf16 pairs of consecutive keys: vp[j][i] = (v_2j[i], v_2j+1[i]); a
// missing partner (odd n) is 0.
RS_BF16_TARGET void pack_v_pairs(const at::BFloat16* const* v, int64_t n, int64_t d, uint32_t* vp) {
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(v[j]);
    const uint16_t* b = j + 1 < n ? reinterpret_cast<const uint16_t*>(v[j + 1]) : nullptr;
    uint32_t* dst = vp + j / 2 * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = a[i] | (b != nullptr ? uint32_t{b[i]} << 16 : 0u);
  }
}

// o[r][i0 .. i0 + 16 NV) = alpha[r] o[r][...] + sum_j bf16(p[r][j]) v_j[...] over n keys, from
// pw (MR rows of ceil(n / 2) bf16 pairs of weights, stride ldw words) and vp (pack_v_pairs).
template <int MR, int NV>
RS_BF16_TARGET inline void pv_bf16(float* o, int64_t d, int64_t i0, const float* alpha, const uint32_t* pw,
                                   int64_t ldw, const uint32_t* vp, int64_t n2) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + i0 + 16 * c), _mm512_set1_ps(alpha[r]));
  for (int64_t j = 0; j < n2; ++j) {
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + j * d + i0 + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r * ldw + j]));
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * d + i0 + 16 * c, acc[r][c]);
}

// One tile: scores, online softmax (float32), then the weights rounded to bf16 (as torch's
// bf16 flash attention does for its P.V product) and P.V from vdpbf16ps.
template <int MR>
RS_BF16_TARGET void tile_bf16(Scratch& sc, int64_t row, int64_t d, const uint32_t* vp, int64_t n, int64_t kb,
                              float mul) {
  float* s = sc.s.data();
  qk_bf16<MR>(sc.qb.data() + row * d / 2, d / 2, sc.kt.data(), mul, s);
  const int64_t n8 = (n + 7) & ~int64_t{7}, n2 = (n + 1) / 2;
  float alpha[MR];
  uint32_t pw[MR][kBlock / 2];
  softmax_tile<MR>(s, sc.lim.data() + row, kb, n8, sc.m.data() + row, sc.l.data() + row, alpha, sc.cap);
  for (int r = 0; r < MR; ++r) {
    float* p = s + r * kBlock;
    for (int64_t j = 0; j < n8; j += 32)  // n8 <= kBlock; weights past n8 are never read
      _mm512_storeu_si512(pw[r] + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + j + 16), _mm512_loadu_ps(p + j)));
  }
  float* o = sc.o.data() + row * d;
  int64_t i0 = 0;
  for (; i0 + 64 <= d; i0 += 64) pv_bf16<MR, 4>(o, d, i0, alpha, pw[0], kBlock / 2, vp, n2);
  for (; i0 < d; i0 += 16) pv_bf16<MR, 1>(o, d, i0, alpha, pw[0], kBlock / 2, vp, n2);
}

// head_block for a bf16 query against bf16 K/V (stream_blocks' dot_bf16): the block's keys transposed
// pairwise (the 8x8 float transpose moves the 32-bit bf16 pairs as they are), its values
// interleaved in key pairs, then every tile of kRowsBf16 rows.
RS_BF16_TARGET void head_block_bf16(Problem& P, const Unit& u, int64_t head, int64_t base, int64_t rows,
                                    int64_t kb, int64_t n, int64_t ahead, Scratch& sc) {
  const int64_t d = P.d;
  const at::BFloat16** kr = sc.bf16.k;
  block_rows<at::BFloat16>(P.k, u.slots + kb, n, head, d, nullptr, kr);
  const float* pairs[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) pairs[j] = reinterpret_cast<const float*>(kr[std::min(j, n - 1)]);
  pack_kt(pairs, d / 2, sc.kt.data());
  block_rows<at::BFloat16>(P.v, u.slots + kb, n, head, d, nullptr, sc.bf16.v);
  uint32_t* vp = reinterpret_cast<uint32_t*>(sc.vbuf.data());  // (kBlock / 2, d) pairs fit
  pack_v_pairs(sc.bf16.v, n, d, vp);
  prefetch_rows(P, u.slots + kb + n, ahead, head, 1);
  const float mul = P.scale * kLog2e;
  for (int64_t t = base; t < base + rows; t += kRowsBf16) {
    const int mr = static_cast<int>(std::min<int64_t>(kRowsBf16, base + rows - t));
    const int64_t seen = std::min(n, sc.lim[t + mr - 1] - kb);  // keys any tile row sees
    if (seen <= 0) continue;
    switch (mr) {
      case 6: tile_bf16<6>(sc, t, d, vp, seen, kb, mul); break;
      case 5: tile_bf16<5>(sc, t, d, vp, seen, kb, mul); break;
      case 4: tile_bf16<4>(sc, t, d, vp, seen, kb, mul); break;
      case 3: tile_bf16<3>(sc, t, d, vp, seen, kb, mul); break;
      case 2: tile_bf16<2>(sc, t, d, vp, seen, kb, mul); break;
      default: tile_bf16<1>(sc, t, d, vp, seen, kb, mul);
    }
  }
}
#else
bool cpu_has_bf16_dot() { return false; }
#endif

// Read the K and V pool rows of keys slots[0..n) (all `heads` heads, bytes each) once, in
// address order, touching every cache line.
int warm_rows(const Problem& P, const int64_t* slots, int64_t n, int64_t head, int64_t bytes) {
  int acc = 0;
  for (const Cache* c : {&P.k, &P.v}) {
    for (int64_t j = 0; j < n; ++j) {
      const char* r = c->row(slots[j], head);
      for (int64_t b = 0; b < bytes; b += 64) acc += r[b];
      acc += r[bytes - 1];
    }
  }
  return acc;
}

// Stream the item's keys block by block through every head's query tiles. T is what the
// micro-kernels read: float (fp32 pool rows, or bf16 / fp16 rows converted once per block,
// which pays when many tiles share the block) or the stored type (converted in registers).
//
// An all-heads unit (few query rows per KV head: decode) is bound by memory, and its loads
// (one head's slice of each pool row, K then V, a block at a time) keep too few cache
// misses in flight: from DRAM it ran at 3-6 GB/s. So it works in stages of kStageKeys keys
// whose whole rows are in L2 before the stage's blocks are computed: the first stage read
// once in address order (warm_rows: the hardware prefetcher streams that at full
// bandwidth), each later one prefetched while the stage before computes, a share before
// each block and head. (Prefetching the first stage of the thread's next item the same way
// made batch-1 decode items slower than warm_rows: 0.50-0.73 ms against 0.36-0.40.)
template <typename T>
void stream_blocks(Problem& P, const Unit& u, const Item& it, Scratch& sc, bool dot_bf16 = false) {
  const int64_t rows = it.r1 - it.r0;
  const int64_t kend = sc.lim[rows - 1];  // limits grow with the row
  const bool staged = u.heads > 1;
  const int64_t stage = staged ? kStageKeys : kend;
  if (staged) sc.sink += warm_rows(P, u.slots + it.k0, std::min(stage, kend - it.k0), u.head, u.heads * P.d * P.k.elt);
  for (int64_t k0 = it.k0; k0 < kend; k0 += stage) {
    const int64_t k1 = std::min(kend, k0 + stage);
    // the next stage's rows, prefetched a share per (block, head) call
    const int64_t pre = staged ? std::min(stage, kend - k1) : 0, calls = (k1 - k0 + kBlock - 1) / kBlock * u.heads;
    const int64_t share = (pre + calls - 1) / calls;
    for (int64_t kb = k0, done = 0; kb < k1; kb += kBlock) {
      const int64_t n = std::min(kBlock, k1 - kb), ahead = staged ? 0 : std::min(kBlock, kend - kb - n);
      for (int64_t h = 0; h < u.heads; ++h, done += share) {
        if (done < pre) prefetch_rows(P, u.slots + k1 + done, std::min(share, pre - done), u.head, u.heads);
#if defined(RS_AVX512)
        if (dot_bf16) {
          head_block_bf16(P, u, u.head + h, h * rows, rows, kb, n, ahead, sc);
          continue;
        }
#endif
        head_block<T>(P, u, u.head + h, h * rows, rows, kb, n, ahead, sc);
      }
    }
  }
}

// The item's online-softmax state before its first key: empty (m -inf, l 0, O 0), or, for
// the first key chunk of an op given a prior (out, lse), that state itself: m = lse, l = 1,
// O = out is exactly a normalized attention with that lse, so continuing the online softmax
// over this op's keys yields the exact LSE merge of both. (Base 2: m = lse * log2 e.)
void init_state(const Problem& P, const Unit& u, const Item& it, Scratch& sc) {
  const int64_t rows = (it.r1 - it.r0) * u.heads, d = P.d;
  std::fill(sc.o.begin(), sc.o.begin() + rows * d, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);
  if (!P.prior_o.defined() || it.k0 != 0) return;
  const char* base = static_cast<const char*>(P.prior_o.data_ptr());
  const float* prior_lse = P.prior_lse.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) {
    const RowRef at = locate(P, u, it, i);
    const float lse = prior_lse[at.in(P.prior_lse)];
    if (lse == kNegInf) continue;
    row_to_float(base + at.in(P.prior_o) * P.prior_o.element_size(), P.prior_o.scalar_type(), sc.o.data() + i * d, d);
    sc.m[i] = lse * kLog2e, sc.l[i] = 1.f;
  }
}

void run_item(Problem& P, const Item& it) {
  const Unit& u = P.units[it.unit];
  const int64_t rows = (it.r1 - it.r0) * u.heads, d = P.d;
  Scratch& sc = scratch();
  sc.fit(rows, d);
  sc.cap = P.softcap * kLog2e;
  load_queries(P, u, it, sc);
  // Scores (and P.V) from vdpbf16ps: bf16 queries and pool, many rows, AVX512-BF16.
  const bool dot_bf16 = P.q->scalar_type() == at::kBFloat16 && P.k.dtype == at::kBFloat16 && P.d % 16 == 0 &&
                        it.r1 - it.r0 >= kPackRows && cpu_has_bf16_dot();
  if (dot_bf16) load_query_pairs(P, u, it, sc);
  init_state(P, u, it, sc);
  // A narrow pool's blocks are converted once per block for many rows, else in registers (segment
  // op, AVX2 Zen 3: 12 and 24 rows per head ran 0.76x and 0.90x the time that way).
  if (P.k.dtype == at::kFloat || it.r1 - it.r0 >= kConvertRows || dot_bf16) stream_blocks<float>(P, u, it, sc, dot_bf16);
  else if (P.k.dtype == at::kBFloat16) stream_blocks<at::BFloat16>(P, u, it, sc);
  else stream_blocks<at::Half>(P, u, it, sc);
  finish_item(P, u, it, sc);
}

// Cut every unit into items: row blocks of <= kMaxRows, and key chunks (multiples of kBlock)
// while the work is too coarse for the threads. A one-token unit (a decode row, or one
// position of a speculative draft) is chunked as it would be alone, whatever else the op
// holds: its keys are summed in the same chunks, so its output does not depend on the
// batch. Items of one (unit, row block) are adjacent.
void plan_items(Problem& P, int64_t threads) {
  int64_t total = 0;
  for (const Unit& u : P.units) total += u.heads * u.q_len * P.group * std::max<int64_t>(u.kv_len, 1);
  const int64_t target = std::max<int64_t>(total / (kItemsPerThread * threads), 1);
  int64_t partial = 0;
  for (int64_t ui = 0; ui < static_cast<int64_t>(P.units.size()); ++ui) {
    const Unit& u = P.units[ui];
    const int64_t rows = u.q_len * P.group;
    const int64_t nrb = (rows + kMaxRows - 1) / kMaxRows;
    for (int64_t b = 0; b < nrb; ++b) {
      const int64_t r0 = rows * b / nrb, r1 = rows * (b + 1) / nrb;
      const int64_t kend = P.limit(u, r1 - 1);
      const int64_t want = u.q_len == 1 ? kItemsPerThread * threads : (u.heads * (r1 - r0) * kend + target - 1) / target;
      const int64_t chunks = std::max<int64_t>(1, std::min(want, kend / kMinChunkKeys));
      const int64_t step = ((kend + chunks - 1) / chunks + kBlock - 1) / kBlock * kBlock;
      const int64_t n = chunks == 1 ? 1 : (kend + step - 1) / step;
      for (int64_t c = 0; c < n; ++c) {
        const int64_t k0 = c * step, k1 = std::min(kend, k0 + step);
        const int64_t cost = u.heads * (r1 - r0) * (k1 - k0 + 16);
        P.items.push_back({ui, r0, r1, k0, k1, n == 1 ? -1 : partial, cost});
        if (n > 1) partial += u.heads * (r1 - r0);
      }
    }
  }
  P.part_o = at::empty({partial, P.d}, at::kFloat);
  P.part_lse = at::empty({partial}, at::kFloat);
}

// Run fn(i) for i in [0, n) on all threads, taking indices from a shared counter. Each
// thread claims its next index before running the current one and calls ahead(next) first,
// so the next item's first loads are in flight while this one computes.
template <typename F, typename A>
void run_dynamic(int64_t n, int64_t threads, const F& fn, const A& ahead) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n;) {
      const int64_t j = next.fetch_add(1);
      if (j < n) ahead(j);
      fn(i);
      i = j;
    }
  });
}

template <typename F>
void run_dynamic(int64_t n, int64_t threads, const F& fn) {
  run_dynamic(n, threads, fn, [](int64_t) {});
}

// Prefetch the first key block of an item.
void prefetch_item(const Problem& P, const Item& it) {
  const Unit& u = P.units[it.unit];
  prefetch_rows(P, u.slots + it.k0, std::min(kBlock, it.k1 - it.k0), u.head, u.heads);
}

// Exact LSE merge of n float rows (stride `step` apart) into one output row.
void merge_rows(const float* o, const float* lse, int64_t n, int64_t step, int64_t d,
                float* acc, char* out, at::ScalarType dt, float* out_lse) {
  float mx = kNegInf;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, lse[j * step]);
  std::fill(acc, acc + d, 0.f);
  if (mx == kNegInf) {
    row_from_float(acc, 0.f, out, dt, d);
    *out_lse = kNegInf;
    return;
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float w = std::exp(lse[j * step] - mx);
    if (w == 0.f) continue;
    sum += w;
    const float* src = o + j * step * d;
    for (int64_t i = 0; i < d; ++i) acc[i] += w * src[i];
  }
  row_from_float(acc, 1.f / sum, out, dt, d);
  *out_lse = mx + std::log(sum);
}

// Merge the key chunks of every split (unit, row block) into the output.
void merge_chunks(Problem& P, int64_t threads) {
  std::vector<std::pair<int64_t, int64_t>> groups;  // (first item, chunk count)
  for (int64_t i = 0; i < static_cast<int64_t>(P.items.size()); ++i) {
    const Item& it = P.items[i];
    if (it.partial < 0) continue;
    if (!groups.empty()) {
      const Item& first = P.items[groups.back().first];
      if (first.unit == it.unit && first.r0 == it.r0) {
        ++groups.back().second;
        continue;
      }
    }
    groups.push_back({i, 1});
  }
  run_dynamic(static_cast<int64_t>(groups.size()), threads, [&](int64_t g) {
    const Item& it = P.items[groups[g].first];
    const Unit& u = P.units[it.unit];
    const int64_t rows = (it.r1 - it.r0) * u.heads, d = P.d;  // scratch rows of one chunk
    std::vector<float> acc(d);
    char* out = static_cast<char*>(P.out.data_ptr());
    const float* part_o = P.part_o.data_ptr<float>() + it.partial * d;
    const float* part_lse = P.part_lse.data_ptr<float>() + it.partial;
    float* lse = P.lse.data_ptr<float>();
    for (int64_t i = 0; i < rows; ++i) {
      const RowRef at = locate(P, u, it, i);
      merge_rows(part_o + i * d, part_lse + i, groups[g].second, rows, d, acc.data(),
                 out + at.in(P.out) * P.out.element_size(), P.out.scalar_type(), lse + at.in(P.lse));
    }
  });
}

void run(Problem& P) {
  const int64_t threads = at::get_num_threads();
  plan_items(P, threads);
  std::vector<int64_t> order(P.items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return P.items[a].cost > P.items[b].cost; });
  run_dynamic(
      static_cast<int64_t>(order.size()), threads, [&](int64_t i) { run_item(P, P.items[order[i]]); },
      [&](int64_t i) { prefetch_item(P, P.items[order[i]]); });
  if (P.part_o.size(0) > 0) merge_chunks(P, threads);
}

// ------------------------------------------------------------------ checks and entry points

Cache make_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 3 && c.stride(2) == 1, name, ": (num_slots, Hkv, D) with unit stride in D expected, got ",
              c.sizes(), " strides ", c.strides());
  return {static_cast<const char*>(c.data_ptr()), c.scalar_type(), c.element_size(), c.stride(0), c.stride(1)};
}

// `all` spans every KV head. Few rows per head (decode, small segments): keep it whole, so an
// item streams whole pool rows (the heads of a slot are adjacent); else one unit per head,
// for more parallel work and a per-head O that stays in L2.
void add_units(Problem& P, const Unit& all) {
  if (all.q_len * P.group < kAllHeadsRows) {
    P.units.push_back(all);
    return;
  }
  for (int64_t h = 0; h < all.heads; ++h) {
    Unit u = all;
    u.head = h, u.heads = 1;
    P.units.push_back(u);
  }
}

using Prior = std::optional<at::Tensor>;

void set_prior(Problem& P, const Prior& out, const Prior& lse) {
  TORCH_CHECK(out.has_value() == lse.has_value(), "prior_out and prior_lse come together");
  if (!out.has_value()) return;
  const at::Tensor& q = *P.q;
  TORCH_CHECK(out->sizes() == q.sizes() && out->stride(2) == 1 && out->scalar_type() == q.scalar_type(),
              "prior_out: like q ", q.sizes(), " (dtype, unit stride in D) expected, got ", out->sizes());
  TORCH_CHECK(lse->dim() == 2 && lse->size(0) == q.size(0) && lse->size(1) == q.size(1) &&
                  lse->scalar_type() == at::kFloat && lse->stride(1) == 1,
              "prior_lse: float32 (T, Hq) with unit stride expected, got ", lse->sizes());
  P.prior_o = *out, P.prior_lse = *lse;
}

// Every slot of s[0..n) names a row of a pool of `rows` rows.
void check_slots(const int64_t* s, int64_t n, int64_t rows) {
  if (n == 0) return;
  const auto [lo, hi] = std::minmax_element(s, s + n);
  TORCH_CHECK(*lo >= 0 && *hi < rows, "slot out of range [0, ", rows, "): ", *lo, " .. ", *hi);
}

// The checks and state every op shares; the slots each op reads are checked by the op
// (check_slots), a table's unread entries never.
Problem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                     double scale, double softcap) {
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: (T, Hq, D) with unit stride in D expected, got ", q.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "k ", k.sizes(), " and v ", v.sizes(), " differ");
  // K/V may be stored narrower than q (e.g. an fp16 pool under float32 compute): every
  // row is converted to float32 on load, and out takes q's dtype.
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k/v dtypes differ: ", k.scalar_type(), ", ", v.scalar_type());
  for (const auto dt : {q.scalar_type(), k.scalar_type()}) {
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "fp32 / bf16 / fp16 expected, got ", dt);
  }
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % 8 == 0, "head dim must match and be a multiple of 8: q ",
              q.size(2), ", k ", k.size(2));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "q heads ", q.size(1), " not a multiple of kv heads ",
              k.size(1));
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots: contiguous int64 (S,) expected");
  Problem P;
  P.q = &q;
  P.out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  P.lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  P.k = make_cache(k, "k"), P.v = make_cache(v, "v");
  P.group = q.size(1) / k.size(1), P.d = q.size(2);
  P.scale = static_cast<float>(scale);
  P.softcap = static_cast<float>(softcap);
  return P;
}

}  // namespace

// q (n, Hq, D) against the L keys at `slots` (L,) of the pool k/v (N, Hkv, D), no mask:
// one unit per KV head, every query row of all n requests stacked.
// -> [out (n, Hq, D) in q's dtype, lse (n, Hq) float32]; L == 0 gives out 0, lse -inf.
// With prior_out / prior_lse (like out / lse): the exact LSE merge of the prior and this.
std::vector<at::Tensor> segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& slots, double scale, const Prior& prior_out,
                                          const Prior& prior_lse, double softcap) {
  Problem P = make_problem(q, k, v, slots, scale, softcap);
  set_prior(P, prior_out, prior_lse);
  const int64_t len = slots.numel();
  check_slots(slots.data_ptr<int64_t>(), len, k.size(0));
  if (q.size(0) > 0) add_units(P, {0, q.size(0), 0, k.size(1), slots.data_ptr<int64_t>(), len, len});
  run(P);
  return {P.out, P.lse};
}

// Per request b: its q_len = q_off[b+1] - q_off[b] queries (rows q_off[b]..) are the last
// positions of its kv_len[b] keys slots[kv_start[b] ..]; query i sees keys 0 .. kv_len - q_len + i.
// q_off: (B + 1,) int64 ascending from 0 to the q rows; kv_start / kv_len: (B,) int64, each run
// inside `slots` (runs may overlap or leave gaps: `slots` may be a whole request-to-token
// table). Prior: as segment_attention (rows of requests without queries have none).
std::vector<at::Tensor> private_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& slots, const at::Tensor& q_off,
                                          const at::Tensor& kv_start, const at::Tensor& kv_len, double scale,
                                          const Prior& prior_out, const Prior& prior_lse, double softcap) {
  Problem P = make_problem(q, k, v, slots, scale, softcap);
  set_prior(P, prior_out, prior_lse);
  const int64_t b = q_off.numel() - 1;
  TORCH_CHECK(q_off.scalar_type() == at::kLong && kv_start.scalar_type() == at::kLong &&
                  kv_len.scalar_type() == at::kLong && q_off.is_contiguous() && kv_start.is_contiguous() &&
                  kv_len.is_contiguous() && b >= 0 && kv_start.numel() == b && kv_len.numel() == b,
              "q_off (B + 1,), kv_start (B,), kv_len (B,): contiguous int64 expected");
  const int64_t* qo = q_off.data_ptr<int64_t>();
  const int64_t* ks = kv_start.data_ptr<int64_t>();
  const int64_t* kl = kv_len.data_ptr<int64_t>();
  TORCH_CHECK(qo[0] == 0 && qo[b] == q.size(0), "q_off must run from 0 to the q rows (", q.size(0), ")");
  const int64_t num_slots = slots.numel();
  for (int64_t r = 0; r < b; ++r) {
    const int64_t ql = qo[r + 1] - qo[r];
    TORCH_CHECK(0 <= ql && ql <= kl[r], "request ", r, ": need 0 <= q_len <= kv_len, got ", ql, ", ", kl[r]);
    TORCH_CHECK(0 <= ks[r] && ks[r] + kl[r] <= num_slots, "request ", r, ": keys [", ks[r], ", ", ks[r] + kl[r],
                ") outside the ", num_slots, " slots");
    if (ql == 0) continue;
    const int64_t* keys = slots.data_ptr<int64_t>() + ks[r];
    check_slots(keys, kl[r], k.size(0));
    add_units(P, {qo[r], ql, 0, k.size(1), keys, kl[r], kl[r] - ql});
  }
  run(P);
  return {P.out, P.lse};
}

// outs (N, T, Hq, D), lses (N, T, Hq) float32 -> [out (T, Hq, D) in outs' dtype, lse (T, Hq)].
std::vector<at::Tensor> merge_states(const at::Tensor& outs, const at::Tensor& lses) {
  TORCH_CHECK(outs.dim() == 4 && lses.dim() == 3 && lses.scalar_type() == at::kFloat, "outs (N,T,H,D), lses (N,T,H) f32");
  const at::Tensor o = outs.to(at::kFloat).contiguous(), l = lses.contiguous();
  const int64_t n = o.size(0), rows = o.size(1) * o.size(2), d = o.size(3);
  at::Tensor out = at::empty({o.size(1), o.size(2), d}, outs.options());
  at::Tensor lse = at::empty({o.size(1), o.size(2)}, lses.options());
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t r = begin; r < end; ++r) {
      char* dst = static_cast<char*>(out.data_ptr()) + r * d * out.element_size();
      merge_rows(o.data_ptr<float>() + r * d, l.data_ptr<float>() + r, n, rows, d, acc.data(), dst,
                 out.scalar_type(), lse.data_ptr<float>() + r);
    }
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("segment_attention", &segment_attention, NoGil(), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("slots"), py::arg("scale"), py::arg("prior_out") = py::none(), py::arg("prior_lse") = py::none(),
        py::arg("softcap") = 0.0);
  m.def("private_attention", &private_attention, NoGil(), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("slots"), py::arg("q_off"), py::arg("kv_start"), py::arg("kv_len"), py::arg("scale"), py::arg("prior_out") = py::none(),
        py::arg("prior_lse") = py::none(), py::arg("softcap") = 0.0);
  m.def("merge_states", &merge_states, NoGil());
  m.attr("bf16_dot") = cpu_has_bf16_dot();  // the vdpbf16ps score path is live here
#if defined(RS_AVX512)
  m.attr("isa") = "avx512";
#elif defined(RS_AVX2)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "scalar";
#endif
}
