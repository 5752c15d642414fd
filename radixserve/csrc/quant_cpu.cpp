// Matmuls on GGUF block-quantized weights, read in their file layout (Q4_K and Q6_K with
// int8 x: packed once at load into tiles of 8 rows, section "packed K-quant tiles"; MXFP4
// with int8 x into tiles of 16, section "legacy blocks with int8 x").
//
// A weight (N, K) is stored as N rows of K/32 blocks; each block holds 32 consecutive
// weights of one row:
//   Q4_0 (18 B): fp16 d, uint8 qs[16]           w_j = d * (q_j - 8)
//   Q4_1 (20 B): fp16 d, fp16 m, uint8 qs[16]   w_j = d * q_j + m
//   Q8_0 (34 B): fp16 d, int8 qs[32]            w_j = d * q_j
//   Q5_0 (22 B): fp16 d, qh[4], qs[16]          w_j = d * (q_j - 16)
//   Q5_1 (24 B): fp16 d, fp16 m, qh[4], qs[16]  w_j = d * q_j + m
//   MXFP4 (17 B): uint8 e, qs[16]               w_j = d * kv[q_j], d = 2^(e - 128)
// where, for the 4- and 5-bit formats, q_j = qs[j] & 15 for j < 16 and qs[j - 16] >> 4
// otherwise, plus 16 where bit j of the little-endian uint32 qh is set (5-bit). MXFP4's
// code is an FP4 (e2m1) value, kv its double, (0, 1, 2, 3, 4, 6, 8, 12) and their negatives
// for codes 8-15, and d the E8M0 exponent e halved (e < 2: the subnormal 2^-128 or 2^-127),
// so that the paths below see an integer quant kv[q_j] under a float32 scale and no offset.
// The K-quants store a row as super-blocks of 256 weights, 8 sub-blocks of 32; block b of a
// row is sub-block b % 8 of super-block b / 8:
//   Q4_K (144 B): fp16 d, fp16 dmin, scales[12] (6-bit sc_j and m_j, j < 8), qs[128]
//                 w = (d * sc_j) * q - dmin * m_j; sub-block j's 4-bit q are the low (even j)
//                 or high (odd j) nibbles of qs[32 * (j / 2) + l], l < 32
//   Q5_K (176 B): fp16 d, fp16 dmin, scales[12], qh[32], qs[128]: as Q4_K, plus bit j of
//                 qh[l] as q's fifth bit (16)
//   Q6_K (210 B): ql[128], qh[64], int8 sc[16], fp16 d; w = d * sc * (q - 32), one scale per
//                 16 weights; in half h = j / 4, k = j % 4: the low (k < 2) or high nibbles
//                 of ql[64 h + 32 (k % 2) + l] and bits 2k, 2k + 1 of qh[32 h + l]
// The dequantizing paths see a block as w = d * q + m (d, m float32, q integer): for the
// K-quants d = d * sc_j and m = -dmin * m_j, and for Q6_K q = sc * (q6 - 32) (|q| <= 4096)
// with the super-block's d, so that one d covers the 32-block. Every d * q is exact in
// float32 (at most 24 significant bits; MXFP4's a power of two times |q| <= 12), so each
// path's dequantized weight equals the reference's (gguf.quants.dequantize) bit for bit.
// The integer paths keep a K-quant super-block's d apart and multiply sc_j into the int16
// quants (sc_j * q, at most 945 for Q4_K), so that a super-block's products sum in int32
// under one scale.
//
// Four ways to multiply x (M, K) float32 by such a weight, picked by the caller per call:
// - `qmatmul_small` (M small: decode): x is rounded to int16 per 32-block (the K-quants: per
//   super-block, QRows), each weight block is widened to int16 once for up to 16 rows of
//   x, and the dot products of a block (K-quants: a super-block) run as exact int32 sums
//   (madd), scaled in float32.
//   Reads each weight byte once per 16 rows: the weight-bandwidth-bound case, where the
//   4-bit layout reads ~5x fewer bytes than fp32. (Dequantizing to float32 in registers
//   instead took ~2x the instructions and ran compute-bound on AVX2.)
// - `qmatmul_gemm` (larger M): the same int16 x and exact integer sums, as a GEMM:
//   x transposed so that each madd lane is one row of x and a broadcast weight pair one
//   column (no horizontal sums), at madd's 16 multiply-adds per instruction against the 8
//   of a float32 FMA.
// - Q4_K and Q6_K weights with x rounded to int8 (format codes kQ4_K_X8, kQ6_K_X8, section
//   "K-quants with int8 x" below): a weight-streaming kernel of byte multiply-adds, at any M.
// - `qmatmul_tiled`: dequantize a tile of kTile weight rows into a per-thread float32 (or,
//   for a bf16 x, bfloat16) buffer (it stays in L2) and run the BLAS GEMM on it, so the
//   arithmetic runs at the machine's matmul rate with the exact float32 x: the path of
//   builds without AVX2, and of bf16 models where bf16 matmuls are fast.
// Built per ISA: with -mavx2 -mfma -mf16c the AVX2 paths below are used (RS_AVX2, common.h),
// without them plain C++ (portable, slower; qmatmul_gemm then runs qmatmul_small's loops).
// The AVX512-VNNI build (RS_VNNI; for CPUs that have it) adds 512-bit paths: the streaming
// kernel takes 16 weight rows at a time and the GEMM 16 rows of x per vector, each block
// sum one vpdpwssd (32 int16 multiply-adds into int32) instead of a madd and an add; their
// results equal the AVX2 paths' bit for bit (same integer sums, same float32 operations per
// lane, same order).
#include "common.h"

#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_max.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Codes 8-11 are Q4_K / Q6_K with int8 x and their packed tiles, 13-15 Q8_0 / MXFP4 with
// int8 x and MXFP4 tiles (weight_format below).
enum Format : int64_t {
  kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kQ5_0 = 6, kQ5_1 = 7, kMXFP4 = 12
};
constexpr int64_t kBlock = 32;
constexpr int64_t kSuper = 256;  // weights of a K-quant super-block
constexpr int64_t kRows = 8;    // rows of x per pass of dot_rows (one weight row a task)
constexpr int64_t kTile = 64;   // weight rows dequantized per sgemm in qmatmul_tiled

constexpr bool is_kquant(int64_t fmt) { return fmt == kQ4_K || fmt == kQ5_K || fmt == kQ6_K; }
constexpr bool is_q5(int64_t fmt) { return fmt == kQ5_0 || fmt == kQ5_1; }
constexpr bool has_offset(int64_t fmt) { return fmt != kQ8_0 && fmt != kQ6_K && fmt != kMXFP4; }
// Bytes of a block (legacy formats: 32 weights) or super-block (K-quants: 256 weights).
constexpr int64_t unit_bytes(int64_t fmt) {
  constexpr int64_t bytes[] = {18, 20, 34, 144, 176, 210, 22, 24};
  return fmt == kMXFP4 ? 17 : bytes[fmt];
}
// Where a legacy block's quants start (after its scale fields).
constexpr int64_t quants_at(int64_t fmt) { return fmt == kMXFP4 ? 1 : fmt == kQ4_1 || fmt == kQ5_1 ? 4 : 2; }

void check_format(int64_t fmt) {
  TORCH_CHECK((fmt >= kQ4_0 && fmt <= kQ5_1) || fmt == kMXFP4, "unknown quant format ", fmt);
}

int64_t row_bytes_of(int64_t fmt, int64_t K) {
  check_format(fmt);
  return K / (is_kquant(fmt) ? kSuper : kBlock) * unit_bytes(fmt);
}

// x is rounded to int16 per unit of per_scale(fmt) blocks with this largest magnitude. The
// legacy formats: per 32-block, 32767. The K-quants: per 256-block, their products with the
// weights' integer quants times sub-block scales (|q * sc| <= 15 * 63 Q4_K, 31 * 63 Q5_K,
// 32 * 128 Q6_K) summed over a super-block within int32: 8191, 4095, 2047.
float qmax_of(int64_t fmt) {
  return fmt == kQ4_K ? 8191.f : fmt == kQ5_K ? 4095.f : fmt == kQ6_K ? 2047.f : 32767.f;
}

// Calls f(std::integral_constant<int64_t, fmt>) for the runtime format: one switch for all.
template <typename F>
decltype(auto) with_format(int64_t fmt, F&& f) {
  switch (fmt) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kMXFP4: return f(std::integral_constant<int64_t, kMXFP4>{});
  }
  TORCH_CHECK(false, "unknown quant format ", fmt);
}

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef RS_AVX2
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// MXFP4's scale: E8M0 exponent e -> 2^(e - 128) as float32 bits (e < 2: the subnormals
// 2^-128 and 2^-127), and its doubled FP4 values by code.
constexpr uint32_t e8m0_half_bits(uint32_t e) { return e < 2 ? 0x00200000u << e : (e - 1) << 23; }

float e8m0_half(uint8_t e) {
  const uint32_t bits = e8m0_half_bits(e);
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

constexpr int8_t kFp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block's scales[12]: bytes 0-3
// hold sc_0..3 (low 6 bits), 4-7 m_0..3, 8-11 the low 4 bits of sc_4..7 and m_4..7 (low and
// high nibble), whose top 2 bits are the top bits of bytes 0-3 (sc) and 4-7 (m).
inline void scale_min(const uint8_t* s, int64_t j, int32_t& sc, int32_t& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Block b of a Q4_K / Q5_K row: its super-block's d, its sub-block's integer scale sc and
// its offset m = -dmin * min (w = d * sc * q + m).
template <int64_t fmt>
inline void kquant_scales(const uint8_t* row, int64_t b, float& d, int32_t& sc, float& m) {
  const uint8_t* sb = row + (b >> 3) * unit_bytes(fmt);
  int32_t mn;
  scale_min(sb + 4, b & 7, sc, mn);
  d = half_to_float(sb);
  m = -(half_to_float(sb + 2) * static_cast<float>(mn));
}

// Block b of a row: its scale d and offset m (w = d * q + m; m = 0 without an offset).
template <int64_t fmt>
inline void block_scales(const uint8_t* row, int64_t b, float& d, float& m) {
  if constexpr (!is_kquant(fmt)) {
    const uint8_t* blk = row + b * unit_bytes(fmt);
    d = fmt == kMXFP4 ? e8m0_half(blk[0]) : half_to_float(blk);
    m = fmt == kQ4_1 || fmt == kQ5_1 ? half_to_float(blk + 2)
        : fmt == kQ4_0               ? -8.f * d
        : fmt == kQ5_0               ? -16.f * d
                                     : 0.f;
  } else if constexpr (fmt == kQ6_K) {
    d = half_to_float(row + (b >> 3) * unit_bytes(fmt) + 208), m = 0.f;
  } else {
    int32_t sc;
    kquant_scales<fmt>(row, b, d, sc, m);
    d *= static_cast<float>(sc);
  }
}

// The products' scales as the integer kernels apply them: blocks of `per_scale(fmt)` share
// one scale d of the weight (and one of x). Block b of a row: d, its integer sub-block
// scale sc (the legacy formats and Q6_K, whose quants hold theirs: 1) and offset m; its
// products are d * d_x * sc * sum(q * q_x) + m * s_x.
constexpr int64_t per_scale(int64_t fmt) { return is_kquant(fmt) ? kSuper / kBlock : 1; }

template <int64_t fmt>
inline void unit_scales(const uint8_t* row, int64_t b, float& d, int32_t& sc, float& m) {
  if constexpr (fmt == kQ4_K || fmt == kQ5_K) {
    kquant_scales<fmt>(row, b, d, sc, m);
  } else {
    sc = 1;
    block_scales<fmt>(row, b, d, m);
  }
}

// a * b + c as the vector kernels round it (one FMA) where they run; the portable build's
// kernels are these scalar loops alone.
inline float fma_like_vectors(float a, float b, float c) {
#ifdef RS_AVX2
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Block b of a Q6_K row: its low-nibble bytes, high-bit bytes, two 16-weight scales, and k
// (block b is the k-th 32-block of its half of the super-block; module comment above).
struct Q6Block {
  const uint8_t *ql, *qh;
  const int8_t* sc;
  int64_t k;
};

inline Q6Block q6_block(const uint8_t* row, int64_t b) {
  const uint8_t* sb = row + (b >> 3) * unit_bytes(kQ6_K);
  const int64_t h = (b & 7) >> 2, k = b & 3;
  return {sb + 64 * h + 32 * (k & 1), sb + 128 + 32 * h,
          reinterpret_cast<const int8_t*>(sb + 192 + 8 * h + 2 * k), k};
}

// Block b of a row: its 32 integer quants q (w = d * q + m; Q6_K's include their scale).
template <int64_t fmt>
inline void block_quants(const uint8_t* row, int64_t b, int32_t* q) {
  if constexpr (is_q5(fmt)) {
    const uint8_t* blk = row + b * unit_bytes(fmt) + quants_at(fmt);
    uint32_t qh;
    std::memcpy(&qh, blk, 4);
    for (int j = 0; j < kBlock; ++j) {
      q[j] = (j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4) | (((qh >> j) & 1) << 4);
    }
  } else if constexpr (!is_kquant(fmt)) {
    const uint8_t* qs = row + b * unit_bytes(fmt) + quants_at(fmt);
    for (int j = 0; j < kBlock; ++j) {
      q[j] = fmt == kQ8_0 ? static_cast<int8_t>(qs[j]) : j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
      if (fmt == kMXFP4) q[j] = kFp4[q[j]];
    }
  } else if constexpr (fmt == kQ6_K) {
    const Q6Block q6 = q6_block(row, b);
    for (int l = 0; l < kBlock; ++l) {
      const int32_t low = q6.k < 2 ? q6.ql[l] & 15 : q6.ql[l] >> 4;
      q[l] = q6.sc[l / 16] * ((low | (((q6.qh[l] >> (2 * q6.k)) & 3) << 4)) - 32);
    }
  } else {
    const uint8_t* sb = row + (b >> 3) * unit_bytes(fmt);
    const int64_t j = b & 7;
    const uint8_t* qs = sb + (fmt == kQ5_K ? 48 : 16) + 32 * (j >> 1);
    for (int l = 0; l < kBlock; ++l) {
      q[l] = (j & 1) ? qs[l] >> 4 : qs[l] & 15;
      if (fmt == kQ5_K) q[l] |= ((sb[16 + l] >> j) & 1) << 4;
    }
  }
}

// Block b of a row -> out[0..31] float32 (the reference semantics of every path).
template <int64_t fmt>
void dequant_block_scalar(const uint8_t* row, int64_t b, float* out) {
  float d, m;
  block_scales<fmt>(row, b, d, m);
  int32_t q[kBlock];
  block_quants<fmt>(row, b, q);
  for (int j = 0; j < kBlock; ++j) out[j] = has_offset(fmt) ? d * q[j] + m : d * q[j];
}

#ifdef RS_AVX2
inline __m256i widen16(const uint8_t* p) {  // 16 bytes -> 16 uint16 lanes
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Block b of a row: its 32 quants as int16, w0 = weights 0-15, w1 = weights 16-31 (the
// legacy 4-bit formats' 16 bytes widened once; low nibble and high nibble are then one op
// each). `fmt` is a template constant in the hot loops: the format branches compile away.
template <int64_t fmt>
inline void widen_block(const uint8_t* row, int64_t b, __m256i& w0, __m256i& w1) {
  const __m256i low4 = _mm256_set1_epi16(15);
  if constexpr (fmt == kQ8_0) {
    const uint8_t* blk = row + b * unit_bytes(fmt);
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
  } else if constexpr (is_q5(fmt)) {
    const uint8_t* blk = row + b * unit_bytes(fmt) + quants_at(fmt);
    uint32_t qh;
    std::memcpy(&qh, blk, 4);
    const __m256i bytes = widen16(blk + 4);
    // lane j of the first half holds bit j of qh, of the second bit j + 16: as 16 or 0
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                          16384, static_cast<int16_t>(-32768));
    const __m256i sixteen = _mm256_set1_epi16(16);
    const auto high = [&](uint32_t bits) {
      const __m256i set = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), bit);
      return _mm256_and_si256(_mm256_cmpeq_epi16(set, bit), sixteen);
    };
    w0 = _mm256_or_si256(_mm256_and_si256(bytes, low4), high(qh & 0xffff));
    w1 = _mm256_or_si256(_mm256_srli_epi16(bytes, 4), high(qh >> 16));
  } else if constexpr (fmt == kMXFP4) {  // the codes looked up as int8 values, then widened
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * unit_bytes(fmt) + 1));
    const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4)), mask = _mm_set1_epi8(15);
    w0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut, _mm_and_si128(v, mask)));
    w1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  } else if constexpr (!is_kquant(fmt)) {
    const __m256i bytes = widen16(row + b * unit_bytes(fmt) + quants_at(fmt));
    w0 = _mm256_and_si256(bytes, low4);
    w1 = _mm256_srli_epi16(bytes, 4);
  } else if constexpr (fmt == kQ6_K) {
    const Q6Block q6 = q6_block(row, b);
    const __m128i hshift = _mm_cvtsi32_si128(static_cast<int>(2 * q6.k));
    const __m256i three = _mm256_set1_epi16(3), bias = _mm256_set1_epi16(32);
    __m256i q[2];
    for (int i = 0; i < 2; ++i) {
      __m256i low = widen16(q6.ql + 16 * i);
      low = q6.k < 2 ? _mm256_and_si256(low, low4) : _mm256_srli_epi16(low, 4);
      const __m256i high = _mm256_and_si256(_mm256_srl_epi16(widen16(q6.qh + 16 * i), hshift), three);
      q[i] = _mm256_sub_epi16(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), bias);
    }
    w0 = _mm256_mullo_epi16(q[0], _mm256_set1_epi16(q6.sc[0]));
    w1 = _mm256_mullo_epi16(q[1], _mm256_set1_epi16(q6.sc[1]));
  } else {
    const uint8_t* sb = row + (b >> 3) * unit_bytes(fmt);
    const int64_t j = b & 7;
    const uint8_t* qs = sb + (fmt == kQ5_K ? 48 : 16) + 32 * (j >> 1);
    w0 = widen16(qs), w1 = widen16(qs + 16);
    if (j & 1) {
      w0 = _mm256_srli_epi16(w0, 4), w1 = _mm256_srli_epi16(w1, 4);
    } else {
      w0 = _mm256_and_si256(w0, low4), w1 = _mm256_and_si256(w1, low4);
    }
    if constexpr (fmt == kQ5_K) {
      const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(j));
      const __m256i one = _mm256_set1_epi16(1);
      const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(widen16(sb + 16), shift), one);
      const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(widen16(sb + 32), shift), one);
      w0 = _mm256_or_si256(w0, _mm256_slli_epi16(h0, 4)), w1 = _mm256_or_si256(w1, _mm256_slli_epi16(h1, 4));
    }
  }
}

// Block b of a row -> w[0..3], 8 weights each (elements 0-7, 8-15, 16-23, 24-31).
template <int64_t fmt>
inline void dequant_block_avx2(const uint8_t* row, int64_t b, __m256 w[4]) {
  if constexpr (fmt != kQ4_0 && fmt != kQ4_1 && fmt != kQ8_0) {  // through the int16 quants
    float d, m;
    block_scales<fmt>(row, b, d, m);
    __m256i q0, q1;
    widen_block<fmt>(row, b, q0, q1);
    const __m128i parts[4] = {_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1),
                              _mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1)};
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(parts[i]));
      w[i] = has_offset(fmt) ? _mm256_fmadd_ps(q, _mm256_set1_ps(d), _mm256_set1_ps(m))
                             : _mm256_mul_ps(q, _mm256_set1_ps(d));
    }
    return;
  }
  const uint8_t* blk = row + b * unit_bytes(fmt);
  const __m256 d = _mm256_set1_ps(half_to_float(blk));
  if (fmt == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
    return;
  }
  const __m256 m = fmt == kQ4_1 ? _mm256_set1_ps(half_to_float(blk + 2))
                                : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (fmt == kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(raw, mask);                     // q_0 .. q_15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // q_16 .. q_31
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), d, m);
  }
}

inline int32_t hsum(__m256i v) {  // exact; common.h has hsum(__m256)
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

// Rows [n0, n1) of the weight, all of it dequantized into dst (n1 - n0, K) of T (float32,
// or bfloat16 for the bf16 GEMM, rounded to nearest even as torch rounds: store8).
template <int64_t fmt, typename T>
void dequant_rows(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, T* dst) {
  const int64_t nb = K / kBlock, bytes = row_bytes_of(fmt, K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * bytes;
    T* out = dst + (n - n0) * K;
    for (int64_t b = 0; b < nb; ++b) {
#ifdef RS_AVX2
      __m256 v[4];
      dequant_block_avx2<fmt>(row, b, v);
      for (int i = 0; i < 4; ++i) store8(out + b * kBlock + 8 * i, v[i]);
#else
      float v[kBlock];
      dequant_block_scalar<fmt>(row, b, v);
      for (int i = 0; i < kBlock; ++i) out[b * kBlock + i] = static_cast<T>(v[i]);
#endif
    }
  }
}

template <typename T>
void dequant_rows(const uint8_t* w, int64_t fmt, int64_t K, int64_t n0, int64_t n1, T* dst) {
  with_format(fmt, [&](auto f) { dequant_rows<decltype(f)::value>(w, K, n0, n1, dst); });
}

// x rows quantized to int16 per unit of per_scale(fmt) blocks (32 values, or 256 for the
// K-quants): q = round(x * Q / amax), d = amax / Q (Q = qmax_of(fmt)), and per 32-block d and
// s = d * sum(q) (the weight formats' offset term multiplies it; a K-quant unit's 8 blocks
// share d). The rounding moves x by at most amax / 65534 of its 32-block (K-quants: amax /
// 16382, 8190, 4094 of its 256-block): 16-256x finer than llama.cpp's int8 activations
// (amax / 254 of a 256-block). A unit holding inf or NaN gets d = s = NaN in its blocks, so
// the bad value still reaches the output.
struct QRows {
  std::vector<int16_t> q;  // (M, K)
  std::vector<float> d, s;  // (M, K / 32)
};

// The largest |x| of x[0..n) (n a multiple of 8), or NaN where some x is inf or NaN.
float unit_amax(const float* x, int64_t n) {
#ifdef RS_AVX2
  const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
  __m256 amax = zero, bad = zero;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
    bad = _mm256_add_ps(bad, _mm256_mul_ps(v, zero));  // NaN iff some x is inf or NaN
  }
  if (std::isnan(hsum(bad))) return std::numeric_limits<float>::quiet_NaN();
  return hmax(amax);
#else
  float m = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    if (!std::isfinite(x[j])) return std::numeric_limits<float>::quiet_NaN();
    m = std::max(m, std::fabs(x[j]));
  }
  return m;
#endif
}

// A 32-block of x rounded with its unit's largest magnitude m.
void quantize_block(const float* x, float m, float qmax, int16_t* q, float* d, float* s) {
  if (std::isnan(m)) {
    std::memset(q, 0, kBlock * sizeof(int16_t));
    *d = *s = std::numeric_limits<float>::quiet_NaN();
    return;
  }
#ifdef RS_AVX2
  const __m256 id = _mm256_set1_ps(m > 0.f ? qmax / m : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) {
    i32[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  for (int i = 0; i < 2; ++i) {  // packs work within 128-bit lanes: a permute restores order
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[2 * i], i32[2 * i + 1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i), p);
  }
  const int32_t total = hsum(sum);
#else
  const float id = m > 0.f ? qmax / m : 0.f;
  int32_t total = 0;
  for (int j = 0; j < kBlock; ++j) q[j] = static_cast<int16_t>(std::nearbyint(x[j] * id)), total += q[j];
#endif
  *d = m / qmax;
  *s = *d * static_cast<float>(total);
}

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t fmt, QRows& out) {
  const int64_t nb = K / kBlock, per = per_scale(fmt);
  const float qmax = qmax_of(fmt);
  out.q.resize(M * K), out.d.resize(M * nb), out.s.resize(M * nb);
  for (int64_t u = 0; u < M * nb; u += per) {
    const float m = unit_amax(x + u * kBlock, per * kBlock);
    for (int64_t i = u; i < u + per; ++i) {
      quantize_block(x + i * kBlock, m, qmax, out.q.data() + i * kBlock, out.d.data() + i, out.s.data() + i);
    }
  }
}

// out[r * ldo] = dot(x[r], weight row) for r < R, with x quantized (QRows at row offset
// `xr`): per unit of per_scale(fmt) blocks d_w * d_x * sum(sc * q_w * q_x) in exact int32
// (qmax_of), plus m_w * s_x per block. The weight block is widened to int16 once for R rows;
// R is a template constant (registers). The scaling and sums are dot_wrows' in its order:
// the weight rows beyond whole 8-row tasks get the bits the others get.
template <int64_t fmt, int R>
void dot_rows(const uint8_t* wrow, int64_t nb, const QRows& x, int64_t xr, float* out, int64_t ldo) {
  constexpr int64_t per = per_scale(fmt);
  float acc[R] = {}, offset[R] = {};
  for (int64_t u = 0; u < nb; u += per) {
    int32_t total[R] = {};
    float dw = 0.f;
    for (int64_t b = u; b < u + per; ++b) {
      float mw;
      int32_t sc;
      unit_scales<fmt>(wrow, b, dw, sc, mw);
#ifdef RS_AVX2
      __m256i w0, w1;
      widen_block<fmt>(wrow, b, w0, w1);
#else
      int32_t wq[kBlock];
      block_quants<fmt>(wrow, b, wq);
#endif
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (xr + r) * nb + b;
#ifdef RS_AVX2
        const __m256i* xq = reinterpret_cast<const __m256i*>(x.q.data() + xb * kBlock);
        const int32_t dot = hsum(_mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xq)),
                                                  _mm256_madd_epi16(w1, _mm256_loadu_si256(xq + 1))));
#else
        const int16_t* xq = x.q.data() + xb * kBlock;
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) dot += wq[j] * xq[j];
#endif
        total[r] += sc * dot;
        if (has_offset(fmt)) offset[r] = fma_like_vectors(mw, x.s[xb], offset[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = fma_like_vectors(dw * x.d[(xr + r) * nb + u], static_cast<float>(total[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = acc[r] + offset[r];
}

#ifdef RS_AVX2
// Lane r = the sum of the 8 int32 lanes of s[r], r < 8 (exact integers).
inline __m256i reduce8(const __m256i s[8]) {
  // hadd twice: 128-bit lane halves hold rows 0-3 (and 4-7) summed over their 4 columns
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

#endif

#ifdef RS_AVX2
// The fp16 scale d (and Q4_1's / Q5_1's offset m; MXFP4: its E8M0 scale) of block `off`
// of 8 weight rows, as 8 float lanes.
template <int64_t fmt>
inline void block_scales8(const uint8_t* const* rows, int64_t off, __m256& d, __m256& m) {
  if constexpr (fmt == kMXFP4) {  // e8m0_half_bits per lane: (e - 1) << 23, or a subnormal
    const __m256i e = _mm256_setr_epi32(rows[0][off], rows[1][off], rows[2][off], rows[3][off], rows[4][off],
                                        rows[5][off], rows[6][off], rows[7][off]);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    d = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
    m = _mm256_setzero_ps();
    return;
  }
  auto half2 = [&](int i) {  // (d, m) of row i: 4 bytes (Q8_0/Q4_0: d and 2 bytes of quants)
    int32_t v;
    std::memcpy(&v, rows[i] + off, 4);
    return v;
  };
  const __m128i lo = _mm_setr_epi32(half2(0), half2(1), half2(2), half2(3));
  const __m128i hi = _mm_setr_epi32(half2(4), half2(5), half2(6), half2(7));
  // per 32-bit lane (d, m) as two halves: gather the d halves into the low 8 bytes, m high
  const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m128i l = _mm_shuffle_epi8(lo, split), h = _mm_shuffle_epi8(hi, split);
  d = _mm256_cvtph_ps(_mm_unpacklo_epi64(l, h));
  if (fmt == kQ4_1 || fmt == kQ5_1) m = _mm256_cvtph_ps(_mm_unpackhi_epi64(l, h));
  else if (fmt == kQ4_0) m = _mm256_mul_ps(_mm256_set1_ps(-8.f), d);
  else if (fmt == kQ5_0) m = _mm256_mul_ps(_mm256_set1_ps(-16.f), d);
  else m = _mm256_setzero_ps();
}

// K-quants: super-block `sb` of 8 weight rows (lane i = row i) -> d, its scale, and per
// sub-block j its offset m[j] and, for Q4_K / Q5_K, row i's integer scale sc[j * ld + i] (6
// bits, in both 16-bit halves: a multiplier of int16 quants, broadcast from memory; Q6_K's
// quants hold their scales): unit_scales for 8 rows a vector, decoded once for the
// super-block's 8 blocks (the scales[12] bit layout of scale_min; a lane holds one row's 4
// bytes of a word). sc null: only d and m (the int8 kernels take the scales with the quants).
template <int64_t fmt>
inline void super_scales8(const uint8_t* const* rows, int64_t sb, __m256& d, int32_t* sc, int64_t ld, __m256 m[8]) {
  const int64_t at = sb * unit_bytes(fmt);
  if constexpr (fmt == kQ6_K) {
    alignas(32) float dh[8];
    for (int i = 0; i < 8; ++i) dh[i] = half_to_float(rows[i] + at + 208);
    d = _mm256_load_ps(dh);
    for (int j = 0; j < 8; ++j) m[j] = _mm256_setzero_ps();
    return;
  }
  // The rows' 16-byte headers (d, dmin, scales[12]) as 4 vectors of their 4-byte words: row
  // i's header and row i + 4's in one vector, then a 4 x 4 transpose in each 128-bit half.
  __m256i r[4];
  for (int i = 0; i < 4; ++i) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + at));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 4] + at));
    r[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  }
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i dm = _mm256_unpacklo_epi64(t0, t2), a = _mm256_unpackhi_epi64(t0, t2);
  const __m256i b = _mm256_unpacklo_epi64(t1, t3), c = _mm256_unpackhi_epi64(t1, t3);
  const auto halves = [](__m256i v) {  // the low 16 bits of each lane as fp16 -> float
    const __m256i p = _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), v);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08)));
  };
  d = halves(dm);
  const __m256 mv = _mm256_xor_ps(halves(_mm256_srli_epi32(dm, 16)), _mm256_set1_ps(-0.0f));  // -dmin
  const __m256i low6 = _mm256_set1_epi32(0x3f3f3f3f), low4 = _mm256_set1_epi32(0x0f0f0f0f);
  const __m256i top2 = _mm256_set1_epi32(0x30303030), byte = _mm256_set1_epi32(0xff);
  const __m256i scs[2] = {_mm256_and_si256(a, low6),
                          _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_srli_epi32(a, 2), top2))};
  const __m256i mns[2] = {_mm256_and_si256(b, low6),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), low4),
                                          _mm256_and_si256(_mm256_srli_epi32(b, 2), top2))};
  for (int j = 0; j < 8; ++j) {  // sub-block j: byte j % 4 of the word for j < 4 or j >= 4
    const __m256i shift = _mm256_set1_epi32(8 * (j % 4));
    if (sc != nullptr) {
      const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(scs[j / 4], shift), byte);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + j * ld), _mm256_or_si256(v, _mm256_slli_epi32(v, 16)));
    }
    m[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(mns[j / 4], shift), byte)), mv);
  }
}

#endif

#ifdef RS_VNNI
// The AVX512-VNNI build's weight-streaming blocks (V16 below): a block of one weight row
// widened to 32 int16 lanes in one register and multiplied into int32 by one vpdpwssd, the
// same exact integer sums as the AVX2 build's two madds.
inline __m512i widen32(__m256i bytes) { return _mm512_cvtepu8_epi16(bytes); }

// Block b of a row: its 32 quants as int16 lanes (w = d * q + m, as widen_block).
template <int64_t fmt>
inline __m512i widen_block16(const uint8_t* row, int64_t b) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const auto nibbles = [&](const uint8_t* qs) {  // 16 bytes -> low nibbles, then high nibbles
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, low4);
  };
  if constexpr (fmt == kQ8_0) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * unit_bytes(fmt) + 2)));
  } else if constexpr (is_q5(fmt)) {
    const uint8_t* blk = row + b * unit_bytes(fmt) + quants_at(fmt);
    uint32_t qh;
    std::memcpy(&qh, blk, 4);
    const __m512i q = widen32(nibbles(blk + 4));
    return _mm512_mask_add_epi16(q, static_cast<__mmask32>(qh), q, _mm512_set1_epi16(16));
  } else if constexpr (fmt == kMXFP4) {  // the codes looked up as int8 values, sign-extended
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4)));
    return _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(lut, nibbles(row + b * unit_bytes(fmt) + 1)));
  } else if constexpr (!is_kquant(fmt)) {
    return widen32(nibbles(row + b * unit_bytes(fmt) + quants_at(fmt)));
  } else if constexpr (fmt == kQ6_K) {
    const Q6Block q6 = q6_block(row, b);
    __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q6.ql));
    low = q6.k < 2 ? _mm256_and_si256(low, low4) : _mm256_and_si256(_mm256_srli_epi16(low, 4), low4);
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q6.qh));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(static_cast<int>(2 * q6.k))),
                                          _mm256_set1_epi8(3));
    const __m512i q = _mm512_sub_epi16(widen32(_mm256_or_si256(low, _mm256_slli_epi16(high, 4))),
                                       _mm512_set1_epi16(32));
    const __m512i sc = _mm512_inserti64x4(_mm512_set1_epi16(q6.sc[0]), _mm256_set1_epi16(q6.sc[1]), 1);
    return _mm512_mullo_epi16(q, sc);
  } else {
    const uint8_t* sb = row + (b >> 3) * unit_bytes(fmt);
    const int64_t j = b & 7;
    __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + (fmt == kQ5_K ? 48 : 16) + 32 * (j >> 1)));
    q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, low4);
    __m512i w = widen32(q);
    if constexpr (fmt == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16));
      const __mmask32 fifth = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << j)));
      w = _mm512_mask_add_epi16(w, fifth, w, _mm512_set1_epi16(16));
    }
    return w;
  }
}

// Lane i = the sum of the 16 int32 lanes of s[i], i < 16 (exact integers): pairs of rows are
// interleaved and added until each 128-bit chunk holds 4 rows, then chunks are added.
inline __m512i reduce16(const __m512i s[16]) {
  __m512i t[8], u[4];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_epi32(s[2 * i], s[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  }
  // u[i]: rows 4i..4i+3 in each chunk; chunks 0+1 and 2+3, then the two halves
  const __m512i v0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
  const __m512i v1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88), _mm512_shuffle_i32x4(u[2], u[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(v0, v1, 0x88), _mm512_shuffle_i32x4(v0, v1, 0xDD));
}

inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

#endif

#ifdef RS_AVX2
// qmatmul_gemm: x's int16 quants transposed so that a vector holds one int16 pair (x[2j],
// x[2j + 1]) of each of 8 (AVX2) or 16 (VNNI) rows: a madd (vpdpwssd) with a broadcast pair
// of weights then gives the block sums of those rows for one column in one int32 vector,
// with no horizontal reduction, and the block is scaled per lane (d_x of each row times
// d_w), as in dot_wrows. madd does 16 multiply-adds per instruction against 8 for a float32
// FMA (vpdpwssd 32, the add included), so this outruns dequantize + sgemm; the weights are
// only widened (kBlockCols columns at a time), never transposed.
inline void transpose8(__m256i r[8]) {  // 8x8 int32: r[i] lane j <- r[j] lane i
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// The GEMM's vector width: V8 (AVX2: 8 rows of x per int32 vector, madd then add) and, in
// the AVX512-VNNI build, V16 (16 rows, one vpdpwssd). Every lane does the same integer and
// float32 operations in the same order in both, so their results are equal bit for bit.
struct V8 {
  static constexpr int L = 8;
  using I = __m256i;
  using F = __m256;
  static I izero() { return _mm256_setzero_si256(); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static F zero() { return _mm256_setzero_ps(); }
  static I dot(I acc, int32_t pair, I x) {
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi32(pair), x));
    asm("" : "+x"(acc));  // keep the chain: GCC would reassociate it into a tree and spill
    return acc;
  }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static constexpr int C = 4, RG = 2;  // register block: C weight columns x RG groups of rows
  // The weight-streaming kernel (dot_wrows): L weight rows a task, a block of one row as two
  // int16 vectors (elements 0-15, 16-31), its sums with an x block by two madds.
  struct Q {
    __m256i lo, hi;
  };
  template <int64_t fmt>
  static Q widen(const uint8_t* row, int64_t b) {
    Q q;
    widen_block<fmt>(row, b, q.lo, q.hi);
    return q;
  }
  static Q scale(const Q& w, int32_t sc) {  // sc: the scale in both 16-bit halves
    const __m256i s = _mm256_set1_epi32(sc);
    return {_mm256_mullo_epi16(w.lo, s), _mm256_mullo_epi16(w.hi, s)};
  }
  static Q loadq(const int16_t* p) {
    const __m256i* v = reinterpret_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
  }
  // w[i]: a block of weight row i -> t[p] lane i = its int16 pair p (p < 16)
  static void pairs(const Q w[L], I t[16]) {
    for (int i = 0; i < L; ++i) t[i] = w[i].lo, t[L + i] = w[i].hi;
    transpose8(t), transpose8(t + L);
  }
  static I block_dot(I acc, const Q& w, const Q& x) {
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(w.lo, x.lo), _mm256_madd_epi16(w.hi, x.hi)));
  }
  static I reduce(const I s[L]) { return reduce8(s); }
  template <int64_t fmt>
  static void super_scales(const uint8_t* const* rows, int64_t sb, F& d, int32_t sc[8][L], F m[8]) {
    super_scales8<fmt>(rows, sb, d, sc == nullptr ? nullptr : sc[0], L, m);
  }
  template <int64_t fmt>
  static void block_scales(const uint8_t* const* rows, int64_t off, F& d, F& m) {
    block_scales8<fmt>(rows, off, d, m);
  }
};

#ifdef RS_VNNI
struct V16 {
  static constexpr int L = 16;
  using I = __m512i;
  using F = __m512;
  static I izero() { return _mm512_setzero_si512(); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static F zero() { return _mm512_setzero_ps(); }
  static I dot(I acc, int32_t pair, I x) { return _mm512_dpwssd_epi32(acc, _mm512_set1_epi32(pair), x); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  // 8 columns x 16 rows: 8 vpdpwssd chains hide its latency in 24 of the 32 registers
  static constexpr int C = 8, RG = 1;
  // dot_wrows: a block of one weight row in one register, its sums by one vpdpwssd; the
  // scales of rows 0-7 and 8-15 decoded as V8's and joined.
  using Q = __m512i;
  template <int64_t fmt>
  static Q widen(const uint8_t* row, int64_t b) { return widen_block16<fmt>(row, b); }
  static Q scale(Q w, int32_t sc) { return _mm512_mullo_epi16(w, _mm512_set1_epi32(sc)); }
  static Q loadq(const int16_t* p) { return _mm512_loadu_si512(p); }
  // w[i]: a block of weight row i -> t[p] lane i = its int16 pair p: a 16 x 16 dword
  // transpose (pairs within 128-bit chunks, then the chunks)
  static void pairs(const Q w[L], I t[16]) {
    I a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
      a[i] = _mm512_unpacklo_epi32(w[i], w[i + 1]), a[i + 1] = _mm512_unpackhi_epi32(w[i], w[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // b[i + k], chunk c: rows i..i+3 of pair 4c + k
      b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]), b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
      b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]), b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int k = 0; k < 4; ++k) {
      const I c0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44), c1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);
      const I c2 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44), c3 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
      t[k] = _mm512_shuffle_i32x4(c0, c2, 0x88), t[4 + k] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
      t[8 + k] = _mm512_shuffle_i32x4(c1, c3, 0x88), t[12 + k] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
  }
  static I block_dot(I acc, Q w, Q x) { return _mm512_dpwssd_epi32(acc, w, x); }
  static I reduce(const I s[L]) { return reduce16(s); }
  template <int64_t fmt>
  static void super_scales(const uint8_t* const* rows, int64_t sb, F& d, int32_t sc[8][L], F m[8]) {
    V8::F d0, d1, m0[8], m1[8];
    int32_t* lo = sc == nullptr ? nullptr : sc[0];  // rows 0-7's columns, then 8-15's
    super_scales8<fmt>(rows, sb, d0, lo, L, m0), super_scales8<fmt>(rows + 8, sb, d1, lo ? lo + 8 : nullptr, L, m1);
    d = join(d0, d1);
    for (int j = 0; j < 8; ++j) m[j] = join(m0[j], m1[j]);
  }
  template <int64_t fmt>
  static void block_scales(const uint8_t* const* rows, int64_t off, F& d, F& m) {
    V8::F d0, m0, d1, m1;
    block_scales8<fmt>(rows, off, d0, m0), block_scales8<fmt>(rows + 8, off, d1, m1);
    d = join(d0, d1), m = join(m0, m1);
  }
};
#endif

constexpr int64_t kChunkGroups = 16; // groups of x per pass over the widened columns (L2)
constexpr int64_t kBlockCols = 32;   // columns widened together; output rows written this wide

// The GEMM's x: int16 quants of whole groups of V::L rows as (groups, nb, 16 pairs) vectors
// of V::L rows, and each group's block scales d and offsets s as (groups, nb, V::L).
template <typename V>
struct GroupedX {
  std::vector<typename V::I> t;
  std::vector<float> d, s;

  GroupedX(const QRows& x, int64_t groups, int64_t nb) : t(groups * nb * 16), d(groups * nb * V::L), s(d.size()) {
    at::parallel_for(0, groups * nb, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t g = i / nb, b = i % nb;
        typename V::Q rows[V::L];  // block b of the group's rows, as pairs of them
        for (int r = 0; r < V::L; ++r) rows[r] = V::loadq(x.q.data() + ((g * V::L + r) * nb + b) * kBlock);
        V::pairs(rows, t.data() + i * 16);
        for (int r = 0; r < V::L; ++r) {
          d[i * V::L + r] = x.d[(g * V::L + r) * nb + b], s[i * V::L + r] = x.s[(g * V::L + r) * nb + b];
        }
      }
    });
  }
};

constexpr int kRun = 8;  // weight columns widened together

// Columns [n0, n0 + kRun) widened: w (nb, kRun, 16) int32 pairs, times their integer
// sub-block scales, d / m (nb, kRun) (unit_scales). The run's scales are decoded as vectors,
// as dot_wrows decodes them (the K-quants' once a super-block).
template <int64_t fmt>
void widen_run(const uint8_t* w, int64_t nb, int64_t n0, int32_t* wq, float* d, float* m) {
  const int64_t bytes = row_bytes_of(fmt, nb * kBlock);
  const uint8_t* rows[kRun];
  for (int c = 0; c < kRun; ++c) rows[c] = w + (n0 + c) * bytes;
  __m256 ds, msub[8];  // K-quants: the current super-block's scales
  int32_t sc[8][kRun];
  for (int64_t b = 0; b < nb; ++b) {
    __m256 db, mb;
    if constexpr (is_kquant(fmt)) {
      if ((b & 7) == 0) super_scales8<fmt>(rows, b >> 3, ds, sc[0], kRun, msub);
      db = ds, mb = msub[b & 7];
    } else {
      block_scales8<fmt>(rows, b * unit_bytes(fmt), db, mb);
    }
    _mm256_storeu_ps(d + b * kRun, db), _mm256_storeu_ps(m + b * kRun, mb);
    for (int c = 0; c < kRun; ++c) {
      int32_t* dst = wq + (b * kRun + c) * 16;
      constexpr bool scaled = fmt == kQ4_K || fmt == kQ5_K;
#ifdef RS_VNNI
      __m512i q = widen_block16<fmt>(rows[c], b);
      if constexpr (scaled) q = _mm512_mullo_epi16(q, _mm512_set1_epi32(sc[b & 7][c]));
      _mm512_storeu_si512(dst, q);
#else
      __m256i w0, w1;
      widen_block<fmt>(rows[c], b, w0, w1);
      if constexpr (scaled) {
        const __m256i s = _mm256_set1_epi32(sc[b & 7][c]);
        w0 = _mm256_mullo_epi16(w0, s), w1 = _mm256_mullo_epi16(w1, s);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), w0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + 1, w1);
#endif
    }
  }
}

// Column n0 alone (a run's leftover): w (nb, 1, 16) int32 pairs, d / m (nb), as widen_run.
template <int64_t fmt>
void widen_col(const uint8_t* w, int64_t nb, int64_t n0, int32_t* wq, float* d, float* m) {
  const uint8_t* row = w + n0 * row_bytes_of(fmt, nb * kBlock);
  for (int64_t b = 0; b < nb; ++b) {
    int32_t sc;
    unit_scales<fmt>(row, b, d[b], sc, m[b]);
    __m256i w0, w1;
    widen_block<fmt>(row, b, w0, w1);
    const __m256i s = _mm256_set1_epi16(static_cast<int16_t>(sc));
    __m256i* dst = reinterpret_cast<__m256i*>(wq + b * 16);
    _mm256_storeu_si256(dst, _mm256_mullo_epi16(w0, s)), _mm256_storeu_si256(dst + 1, _mm256_mullo_epi16(w1, s));
  }
}

// out[row, n0 + c] for the V::L * RG rows of groups [g0, g0 + RG) and columns c < C.
template <typename V, int64_t fmt, int C, int S, int RG>
__attribute__((noinline))  // inlined into the callers, it spilled its sums (Q8_0: 1.4x slower)
void gemm_block(const int32_t* wq, const float* wd, const float* wm, const GroupedX<V>& x, int64_t nb, int64_t g0,
                float* y, int64_t ldy) {
  typename V::F acc[C][RG], off[C][RG];
  for (int c = 0; c < C; ++c) {
    for (int g = 0; g < RG; ++g) acc[c][g] = off[c][g] = V::zero();
  }
  constexpr int64_t per = per_scale(fmt);
  typename V::I sum[C][RG];
  for (int64_t b = 0; b < nb; ++b) {
    if (b % per == 0) {  // a unit of one scale of w and of x: its exact sums start
      for (int c = 0; c < C; ++c) {
        for (int g = 0; g < RG; ++g) sum[c][g] = V::izero();
      }
    }
    for (int j = 0; j < 16; ++j) {
      typename V::I xv[RG];
      for (int g = 0; g < RG; ++g) xv[g] = x.t[((g0 + g) * nb + b) * 16 + j];
      for (int c = 0; c < C; ++c) {
        const int32_t pair = wq[(b * S + c) * 16 + j];  // w[2j], w[2j + 1]
        for (int g = 0; g < RG; ++g) sum[c][g] = V::dot(sum[c][g], pair, xv[g]);
      }
    }
    for (int g = 0; g < RG; ++g) {
      const typename V::F sx = V::loadf(x.s.data() + ((g0 + g) * nb + b) * V::L);
      for (int c = 0; c < C; ++c) {
        if (has_offset(fmt)) off[c][g] = V::fmadd(V::set1(wm[b * S + c]), sx, off[c][g]);
      }
    }
    if (b % per != per - 1) continue;
    for (int g = 0; g < RG; ++g) {
      const typename V::F dx = V::loadf(x.d.data() + ((g0 + g) * nb + b) * V::L);
      for (int c = 0; c < C; ++c) {
        const typename V::F scale = V::mul(V::set1(wd[b * S + c]), dx);
        acc[c][g] = V::fmadd(scale, V::cvt(sum[c][g]), acc[c][g]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int g = 0; g < RG; ++g) {
      alignas(64) float lanes[V::L];
      V::storef(lanes, V::add(acc[c][g], off[c][g]));
      for (int r = 0; r < V::L; ++r) y[(g * V::L + r) * ldy + c] = lanes[r];
    }
  }
}

// Output columns [0, cols) of the widened block (cols <= kBlockCols) for the rows of groups
// [g, g + RG), into a tile whose rows are copied out whole. (Writing C columns of each
// output row at a time touched every row's cache line again and again; with a row stride of
// a multiple of 4 KB, as for 3072 or 49152 columns, those lines also share one L1 set.)
template <typename V, int64_t fmt, int RG>
void gemm_rows(const int32_t* wq, const float* wd, const float* wm, int64_t nb, int64_t cols, const GroupedX<V>& x,
               int64_t g, float* tile) {
  constexpr int C = V::C;
  static_assert(kRun % C == 0, "a run is whole register blocks");
  int64_t n = 0;
  for (; n + kRun <= cols; n += kRun) {
    for (int c = 0; c < kRun; c += C) {
      const int64_t at = n * nb + c;  // the run's (nb, kRun) scales, column c
      gemm_block<V, fmt, C, kRun, RG>(wq + at * 16, wd + at, wm + at, x, nb, g, tile + n + c, kBlockCols);
    }
  }
  for (; n < cols; ++n) {  // the last block's odd columns
    gemm_block<V, fmt, 1, 1, RG>(wq + n * nb * 16, wd + n * nb, wm + n * nb, x, nb, g, tile + n, kBlockCols);
  }
}

// Output columns [n0, n0 + cols) (cols <= kBlockCols) for the rows of groups [g0, g1): the
// columns are widened once (runs of kRun columns, then single ones), then each register block
// of rows meets them all.
template <typename V, int64_t fmt>
void gemm_cols(const uint8_t* w, int64_t nb, int64_t n0, int64_t cols, const GroupedX<V>& x, int64_t g0, int64_t g1,
               int64_t M, float* out, int64_t ldo, int32_t* wq, float* wd, float* wm, float* tile) {
  int64_t n = 0;
  for (; n + kRun <= cols; n += kRun) widen_run<fmt>(w, nb, n0 + n, wq + n * nb * 16, wd + n * nb, wm + n * nb);
  for (; n < cols; ++n) widen_col<fmt>(w, nb, n0 + n, wq + n * nb * 16, wd + n * nb, wm + n * nb);
  for (int64_t g = g0; g < g1;) {
    const int64_t step = g + V::RG <= g1 ? V::RG : 1;
    if (step == V::RG) gemm_rows<V, fmt, V::RG>(wq, wd, wm, nb, cols, x, g, tile);
    else gemm_rows<V, fmt, 1>(wq, wd, wm, nb, cols, x, g, tile);
    for (int64_t r = 0; r < step * V::L && g * V::L + r < M; ++r) {
      std::memcpy(out + (g * V::L + r) * ldo + n0, tile + r * kBlockCols, cols * sizeof(float));
    }
    g += step;
  }
}

template <typename V, int64_t fmt>
void gemm(const uint8_t* w, int64_t N, int64_t nb, const QRows& x, int64_t M, float* out) {
  const int64_t groups = (M + V::L - 1) / V::L;
  const GroupedX<V> xg(x, groups, nb);
  at::parallel_for(0, (N + kBlockCols - 1) / kBlockCols, 1, [&](int64_t b0, int64_t b1) {
    std::vector<__m256i> wbuf(nb * kBlockCols * 2);
    std::vector<float> wd(nb * kBlockCols), wm(nb * kBlockCols), tile(V::RG * V::L * kBlockCols);
    int32_t* wq = reinterpret_cast<int32_t*>(wbuf.data());
    for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
      const int64_t g1 = std::min(groups, g0 + kChunkGroups);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kBlockCols;
        gemm_cols<V, fmt>(w, nb, n0, std::min(kBlockCols, N - n0), xg, g0, g1, M, out, N, wq, wd.data(), wm.data(),
                          tile.data());
      }
    }
  });
}

#ifdef RS_VNNI
using GemmV = V16;
#else
using GemmV = V8;
#endif

// Rows of x per pass of dot_wrows / dot_wrows8 over a task's weight rows: up to kStreamRows
// rows in one pass, more in passes of kWideRows. A pass widens (arranges) its weight blocks
// once for all its rows, so wider passes repeat less of that work, but their accumulators
// no longer fit in registers: passes of 32 at every M ran 8-16 rows at 0.83-0.9x the speed
// of passes of 16, and 17-64 rows 1.06-1.27x faster (Zen 4, SmolLM2's and a 1B model's
// shapes, Q4_1 with int16 x and Q4_K / Q6_K with int8 x, the two builds side by side).
constexpr int64_t kStreamRows = 16;
constexpr int64_t kWideRows = 32;
constexpr int64_t kPairRows = 8;     // rows of x from which dot_wrows transposes the weight blocks

// run(pass, r0, rows) over M > 1 rows of x: one pass of up to kStreamRows rows, else passes
// of kWideRows (`pass`: the pass's capacity, an integral constant).
template <typename Run>
void in_passes(int64_t M, Run&& run) {
  if (M <= kStreamRows) return run(std::integral_constant<int64_t, kStreamRows>{}, 0, M);
  for (int64_t r0 = 0; r0 < M; r0 += kWideRows) {
    run(std::integral_constant<int64_t, kWideRows>{}, r0, std::min(kWideRows, M - r0));
  }
}

// out[r * ldo + i] = x row xr + r . weight row i of w, for the V::L weight rows from w and
// r < M <= kPass (kM: M where it is known at compile time, else 0). Per unit of
// per_scale(fmt) blocks (a K-quant super-block: one scale of the weight row and of x) the
// L rows' quants are widened once, times their integer sub-block scales, for the M rows of
// x; for each row of x each weight row's unit sum accumulates in one int32 vector, the L
// vectors are reduced into one (lane i = weight row i) and scaled by the L rows' d times
// x's d in one FMA: no scalar work and no horizontal sums at the end. From kPairRows rows
// of x the reduction, done for every row of x, costs more than transposing the widened
// blocks once, in registers, into int16 pairs of the L rows: each row of x then meets them
// by broadcast pairs and its sums land one weight row a lane (SmolLM2's Q4_1 gate/up and LM
// head: 0.7x the reduction's time at 9 rows, 0.65x at 16; bench_quant.py, Zen 4). Each output is the
// same exact integer unit sums, scaled and summed in unit order, for any M, V and position
// of the row in the batch: a row's result does not depend on the rows beside it, and the
// AVX512-VNNI build (V16) equals the AVX2 one (V8) bit for bit.
template <typename V, int64_t fmt, int kM, int64_t kPass = kStreamRows>
void dot_wrows(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRows& x, int64_t xr, int64_t M, float* out,
               int64_t ldo) {
  constexpr int L = V::L;
  constexpr int per = per_scale(fmt);
  const int64_t rows_x = kM ? kM : M;
  const uint8_t* rows[L];
  for (int i = 0; i < L; ++i) rows[i] = w + i * row_bytes;
  // The L rows are one contiguous run of bytes, but read L blocks apart they make L streams
  // the hardware prefetchers follow badly (~2x slower than reading one row at a time from
  // DRAM): ask for the next task's bytes in order instead, a share per block.
  const char* next = reinterpret_cast<const char*>(w + L * row_bytes);
  const int64_t share = (L * row_bytes + nb - 1) / nb;
  typename V::F acc[kPass], off[kPass];
  for (int64_t r = 0; r < rows_x; ++r) acc[r] = off[r] = V::zero();
  typename V::Q wq[per][L];  // the unit's widened blocks
  typename V::I wt[per][kBlock / 2];  // ... transposed into pairs (rows_x >= kPairRows)
  for (int64_t u = 0; u < nb; u += per) {
    typename V::F d, m[per];
    int32_t sc[8][L];  // K-quants: sub-block j's scale of row i, broadcast from here
    if constexpr (is_kquant(fmt)) V::template super_scales<fmt>(rows, u / per, d, sc, m);
    else V::template block_scales<fmt>(rows, u * unit_bytes(fmt), d, m[0]);
    const auto widened = [&](int j, int i) {
      const typename V::Q q = V::template widen<fmt>(rows[i], u + j);
      if constexpr (fmt == kQ4_K || fmt == kQ5_K) return V::scale(q, sc[j][i]);
      return q;
    };
    const auto prefetch = [&](int j) {  // the next task's share for block u + j
      for (int64_t p = (u + j) * share; p < (u + j + 1) * share; p += 64) _mm_prefetch(next + p, _MM_HINT_T0);
    };
    if constexpr (kM == 1) {  // one row of x: each block's sums straight from its registers
      const int64_t xb = xr * nb + u;
      typename V::I sums[L];
      for (int i = 0; i < L; ++i) sums[i] = V::izero();
      for (int j = 0; j < per; ++j) {
        prefetch(j);
        const typename V::Q xq = V::loadq(x.q.data() + (xb + j) * kBlock);
        for (int i = 0; i < L; ++i) sums[i] = V::block_dot(sums[i], widened(j, i), xq);
        if (has_offset(fmt)) off[0] = V::fmadd(m[j], V::set1(x.s[xb + j]), off[0]);
      }
      acc[0] = V::fmadd(V::mul(d, V::set1(x.d[xb])), V::cvt(V::reduce(sums)), acc[0]);
      continue;
    }
    if (rows_x >= kPairRows) {
      // the unit's widened blocks transposed: wt[j][p] lane i = pair p of row i's block j;
      // a row of x then meets them by broadcast pairs, each lane one weight row's sum
      for (int j = 0; j < per; ++j) {
        prefetch(j);
        typename V::Q blocks[L];
        for (int i = 0; i < L; ++i) blocks[i] = widened(j, i);
        V::pairs(blocks, wt[j]);
      }
      for (int64_t r = 0; r < rows_x; ++r) {
        const int64_t xb = (xr + r) * nb + u;
        typename V::I sums[4] = {V::izero(), V::izero(), V::izero(), V::izero()};  // 4 chains
        for (int j = 0; j < per; ++j) {
          const int16_t* xq = x.q.data() + (xb + j) * kBlock;
          for (int p = 0; p < kBlock / 2; ++p) {
            int32_t pair;
            std::memcpy(&pair, xq + 2 * p, sizeof(pair));
            sums[p % 4] = V::dot(sums[p % 4], pair, wt[j][p]);
          }
          if (has_offset(fmt)) off[r] = V::fmadd(m[j], V::set1(x.s[xb + j]), off[r]);
        }
        const typename V::I sum = V::iadd(V::iadd(sums[0], sums[1]), V::iadd(sums[2], sums[3]));
        acc[r] = V::fmadd(V::mul(d, V::set1(x.d[xb])), V::cvt(sum), acc[r]);
      }
      continue;
    }
    for (int j = 0; j < per; ++j) {
      prefetch(j);
      for (int i = 0; i < L; ++i) wq[j][i] = widened(j, i);
    }
    for (int64_t r = 0; r < rows_x; ++r) {
      const int64_t xb = (xr + r) * nb + u;
      typename V::I sums[L];
      for (int i = 0; i < L; ++i) sums[i] = V::izero();
      for (int j = 0; j < per; ++j) {
        const typename V::Q xq = V::loadq(x.q.data() + (xb + j) * kBlock);
        for (int i = 0; i < L; ++i) sums[i] = V::block_dot(sums[i], wq[j][i], xq);
        if (has_offset(fmt)) off[r] = V::fmadd(m[j], V::set1(x.s[xb + j]), off[r]);
      }
      acc[r] = V::fmadd(V::mul(d, V::set1(x.d[xb])), V::cvt(V::reduce(sums)), acc[r]);
    }
  }
  for (int64_t r = 0; r < rows_x; ++r) V::storef(out + r * ldo, V::add(acc[r], off[r]));
}

// dot_wrows for every row of x (M of them), in_passes.
template <typename V>
void dot_wrows(const uint8_t* w, int64_t fmt, int64_t row_bytes, int64_t nb, const QRows& x, int64_t M, float* out,
               int64_t ldo) {
  with_format(fmt, [&](auto f) {
    constexpr int64_t F = decltype(f)::value;
    if (M == 1) return dot_wrows<V, F, 1>(w, row_bytes, nb, x, 0, 1, out, ldo);
    in_passes(M, [&](auto pass, int64_t r0, int64_t rows) {
      dot_wrows<V, F, 0, decltype(pass)::value>(w, row_bytes, nb, x, r0, rows, out + r0 * ldo, ldo);
    });
  });
}
#endif

// ------------------------------------------------------------------ K-quants with int8 x
//
// Format codes kQ4_K_X8 and kQ6_K_X8: Q4_K and Q6_K weights with x rounded to int8 per
// 256-block, as llama.cpp rounds activations for its K-quant dot products (Q8_K: the value
// of largest magnitude maps to -127, d = its magnitude / 127; error <= amax / 254, 64x the
// int16 path's). The integer products then take unsigned x signed byte multiply-adds
// (vpdpbusd: 64 a VNNI instruction, against vpdpwssd's 32), and the quants are only put
// into bytes, never widened to int16 or multiplied by their scales one by one.
//
// Lane layout: each 256-block of x is stored as 4 vectors of 64 bytes, and the weight's
// super-block bytes are arranged the same way, so that after the 4 multiply-adds each
// 32-bit lane l (l < 16) sums the products of one group of weights under one scale:
// - Q4_K (x8_pos_q4k): in vector k lane l holds elements 8k + 4 (l % 2) .. + 3 of 32-weight
//   sub-block l / 2; |lane| <= 16 * 15 * 127 < 2^15, so one madd with the 6-bit scales
//   gives sum_j sc_j * sum(q * x). Per super-block, weight row and row of x: 4 vpdpbusd and
//   a madd, against 8 vpdpwssd.
// - Q6_K (x8_pos_q6k): in vector k lane l holds elements 4k .. 4k + 3 of 16-weight group
//   g(l) = 4 (l % 4) + l / 4 (the order a 4 x 4 dword transpose of the natural vectors
//   gives); q = q6 - 32 is applied as 32 * the group's sum of x (x's `b`), then one 32-bit
//   multiply by the int8 scales: sum_g sc_g * sum((q6 - 32) * x).
// Both sums are exact in int32 under the super-block's one weight scale and one x scale.
// The AVX2 kernels form the same lane sums from maddubs (int16 pairs) and madd, the portable
// loop from scalars: every path gives a row the same integer sums and the same float32
// operations in the same order.
constexpr int64_t kQ4_K_X8 = 8, kQ6_K_X8 = 9;
// The same weights packed into tiles of kPackRows rows (section "packed K-quant tiles").
constexpr int64_t kQ4_K_P8 = 10, kQ6_K_P8 = 11;
constexpr int64_t kPackRows = 8;

constexpr bool is_packed(int64_t code) { return code == kQ4_K_P8 || code == kQ6_K_P8; }
constexpr bool is_x8(int64_t code) { return code == kQ4_K_X8 || code == kQ6_K_X8 || is_packed(code); }
constexpr int64_t packed_bytes(int64_t fmt) { return fmt == kQ6_K ? 210 : 148; }

// Q8_0 and MXFP4 weights with x rounded to int8 per 32-block, and MXFP4 packed into tiles
// of 16 rows (section "legacy blocks with int8 x").
constexpr int64_t kQ8_0_B8 = 13, kMXFP4_B8 = 14, kMXFP4_P16 = 15;
constexpr bool is_b8(int64_t code) { return code == kQ8_0_B8 || code == kMXFP4_B8 || code == kMXFP4_P16; }
// Whether a code's weights are in tiles (K-quants' of 8 rows, MXFP4's of 16), and their rows.
constexpr int64_t kTileRows = 16;  // rows of a kMXFP4_P16 tile
constexpr bool is_tiled(int64_t code) { return is_packed(code) || code == kMXFP4_P16; }
constexpr int64_t tile_rows(int64_t code) { return code == kMXFP4_P16 ? kTileRows : kPackRows; }

// The weight format of a format code.
constexpr int64_t weight_format(int64_t code) {
  return code == kQ4_K_X8 || code == kQ4_K_P8   ? kQ4_K
         : code == kQ6_K_X8 || code == kQ6_K_P8 ? kQ6_K
         : code == kQ8_0_B8                     ? kQ8_0
         : code == kMXFP4_B8 || code == kMXFP4_P16 ? kMXFP4
                                                : code;
}

struct Q8Rows {
  std::vector<int8_t> q;   // (M, K), each 256-block in its format's lane order
  std::vector<float> d;    // (M, K / 256)
  std::vector<float> s;    // (M, K / 32): d * the sum of the 32-block's q (Q4_K's offsets)
  std::vector<int32_t> b;  // (M, K / 256, 16) Q6_K only: 32 * the sum of group g(l)'s q, lane l
};

// Where element e (< 256) of a block lies in its format's lane order.
constexpr int64_t x8_pos_q4k(int64_t e) {
  const int64_t j = e / 32, k = (e % 32) / 8, h = (e % 8) / 4;
  return 64 * k + 4 * (2 * j + h) + e % 4;
}
constexpr int64_t x8_group(int64_t l) { return 4 * (l % 4) + l / 4; }  // its own inverse
constexpr int64_t x8_pos_q6k(int64_t e) { return 64 * ((e % 16) / 4) + 4 * x8_group(e / 16) + e % 4; }
constexpr int64_t x8_pos(int64_t fmt, int64_t e) { return fmt == kQ6_K ? x8_pos_q6k(e) : x8_pos_q4k(e); }

// x (M, K) -> int8 per 256-block, in fmt's lane order: iscale = -127 / v (v the block's first
// value of largest magnitude), q = min(127, round-half-even(x * iscale)), d = 1 / iscale; d =
// 0 for an all-zero block; a block holding inf or NaN gets q = 0 and d = s = NaN.
void quantize_rows8(const float* x, int64_t M, int64_t K, int64_t fmt, Q8Rows& out) {
  const int64_t units = M * K / kSuper;
  out.q.resize(M * K), out.d.resize(units), out.s.resize(units * 8), out.b.resize(fmt == kQ6_K ? units * 16 : 0);
  at::parallel_for(0, units, 16, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const float* xb = x + u * kSuper;
      int8_t* q = out.q.data() + u * kSuper;
      float* s = out.s.data() + u * 8;
      int32_t* b = fmt == kQ6_K ? out.b.data() + u * 16 : nullptr;
      const float amax = unit_amax(xb, kSuper);
      if (std::isnan(amax) || amax == 0.f) {
        std::memset(q, 0, kSuper);
        if (b) std::memset(b, 0, 16 * sizeof(int32_t));
        out.d[u] = std::isnan(amax) ? amax : 0.f;
        for (int j = 0; j < 8; ++j) s[j] = out.d[u];
        continue;
      }
      int64_t first = 0;
      while (std::fabs(xb[first]) != amax) ++first;
      const float iscale = -127.f / xb[first], d = 1.f / iscale;
      alignas(64) int8_t v[kSuper];
#ifdef RS_AVX2
      const __m256 is = _mm256_set1_ps(iscale);
      const __m256i top = _mm256_set1_epi32(127);
      for (int64_t e = 0; e < kSuper; e += 32) {
        __m256i i32[4];
        for (int i = 0; i < 4; ++i) {
          const __m256 p = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + e + 8 * i), is),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          i32[i] = _mm256_min_epi32(_mm256_cvtps_epi32(p), top);
        }
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        s[e / 32] = d * static_cast<float>(hsum(sum));
        // packs work within 128-bit lanes; the dword permute restores element order
        const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(v + e),
                           _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      }
#else
      for (int64_t e = 0; e < kSuper; e += 32) {
        int32_t total = 0;
        for (int64_t i = e; i < e + 32; ++i) {
          v[i] = static_cast<int8_t>(std::min(127.f, std::nearbyint(xb[i] * iscale))), total += v[i];
        }
        s[e / 32] = d * static_cast<float>(total);
      }
#endif
      for (int64_t e = 0; e < kSuper; e += 4) std::memcpy(q + x8_pos(fmt, e), v + e, 4);
      for (int64_t l = 0; l < 16 && b; ++l) {
        int32_t sum = 0;
        for (int64_t e = 16 * x8_group(l); e < 16 * x8_group(l) + 16; ++e) sum += v[e];
        b[l] = 32 * sum;
      }
      out.d[u] = d;
    }
  });
}

// out[r * ldo] = dot(x row xr + r, weight row), r < R, fmt Q4_K or Q6_K: per super-block
// d_w * d_x * (the exact integer sum of q_w * q_x, the sub-block scales in q_w), plus
// (Q4_K) m_j * s_x per sub-block: the vector kernels' operations, one row at a time (the
// rows beyond whole vector tasks; the portable build).
template <int64_t fmt>
void dot_rows8(const uint8_t* wrow, int64_t nb, const Q8Rows& x, int64_t xr, int64_t R, float* out, int64_t ldo) {
  for (int64_t r = 0; r < R; ++r) {
    float acc = 0.f, off = 0.f;
    for (int64_t u = 0; u < nb / 8; ++u) {
      const int64_t xu = (xr + r) * nb / 8 + u;
      const int8_t* xq = x.q.data() + xu * kSuper;
      int32_t total = 0;
      float dw = 0.f;
      for (int64_t j = 0; j < 8; ++j) {
        float mw;
        int32_t sc, q[kBlock];
        unit_scales<fmt>(wrow, 8 * u + j, dw, sc, mw);
        block_quants<fmt>(wrow, 8 * u + j, q);  // Q6_K's include their scales
        int32_t dot = 0;
        for (int64_t l = 0; l < kBlock; ++l) dot += q[l] * xq[x8_pos(fmt, 32 * j + l)];
        total += sc * dot;
        if (fmt == kQ4_K) off = fma_like_vectors(mw, x.s[xu * 8 + j], off);
      }
      acc = fma_like_vectors(dw * x.d[xu], static_cast<float>(total), acc);
    }
    out[r * ldo] = acc + off;
  }
}

void dot_rows8(const uint8_t* wrow, int64_t fmt, int64_t nb, const Q8Rows& x, int64_t xr, int64_t R, float* out,
               int64_t ldo) {
  if (fmt == kQ6_K) dot_rows8<kQ6_K>(wrow, nb, x, xr, R, out, ldo);
  else dot_rows8<kQ4_K>(wrow, nb, x, xr, R, out, ldo);
}

#ifdef RS_AVX2
// A Q4_K super-block's sub-block scales as bytes, byte p = sc_{p / 2}: scales[12] as in
// scale_min, the header's bytes 4-15.
inline __m128i q4k_scale_bytes(const uint8_t* sb) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb));
  const __m128i low = _mm_setr_epi8(4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15);
  const __m128i high = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m128i bits = _mm_setr_epi8(63, 63, 63, 63, 63, 63, 63, 63, 15, 15, 15, 15, 15, 15, 15, 15);
  const __m128i lo = _mm_and_si128(_mm_shuffle_epi8(h, low), bits);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(_mm_shuffle_epi8(h, high), 2), _mm_set1_epi8(0x30));
  return _mm_or_si128(lo, hi);
}

// A Q6_K super-block's 16 int8 scales in lane order, byte l = sc_{g(l)}.
inline __m128i q6k_scale_bytes(const uint8_t* sb) {
  const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);  // g(l)
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)), order);
}

// v[0..3] -> in each 128-bit chunk, dword n of output k = dword k of input n (a 4 x 4
// transpose per chunk).
inline void transpose4(__m256i v[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
  v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The AVX2 int8 kernels' weight super-block: the 4 lane-order vectors as 8 halves (half h of
// vector k: lanes 8h .. 8h + 7) and, per half, the lanes' scales (Q4_K: int16 pairs (sc, sc);
// Q6_K: int32).
struct KBytes8 {
  __m256i q[2][4], sc[2];
};

template <int64_t fmt>
inline KBytes8 kquant_bytes(V8, const uint8_t* sb) {
  const __m256i low4 = _mm256_set1_epi8(15);
  KBytes8 w;
  if constexpr (fmt == kQ4_K) {
    for (int h = 0; h < 2; ++h) {  // qwords 8h .. 8h + 7 of qs: sub-blocks 4h .. 4h + 3
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 64 * h));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 48 + 64 * h));
      const __m256i la = _mm256_and_si256(a, low4), ha = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
      const __m256i lb = _mm256_and_si256(b, low4), hb = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
      const __m256i a0 = _mm256_unpacklo_epi64(la, ha), a1 = _mm256_unpackhi_epi64(la, ha);
      const __m256i b0 = _mm256_unpacklo_epi64(lb, hb), b1 = _mm256_unpackhi_epi64(lb, hb);
      w.q[h][0] = _mm256_permute2x128_si256(a0, b0, 0x20), w.q[h][1] = _mm256_permute2x128_si256(a1, b1, 0x20);
      w.q[h][2] = _mm256_permute2x128_si256(a0, b0, 0x31), w.q[h][3] = _mm256_permute2x128_si256(a1, b1, 0x31);
    }
    const __m128i bytes = q4k_scale_bytes(sb);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(bytes, 8) : bytes);
      w.sc[h] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
    }
  } else {
    // natural vector n (elements 64n .. 64n + 63), half h: the low (n even) or high nibbles
    // of ql[64 (n / 2) + 32 h ..] and bits 4 (n % 2) + 2h, + 1 of qh[32 (n / 2) ..] as 16, 32
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      __m256i v[4];
      for (int n = 0; n < 4; ++n) {
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * (n / 2) + 32 * h));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * (n / 2)));
        const __m256i nib = n % 2 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4) : _mm256_and_si256(ql, low4);
        const int shift = 4 * (n % 2) + 2 * h;  // qh's bits at shift, shift + 1 -> bits 4, 5
        const __m256i hi = shift <= 4 ? _mm256_slli_epi16(qh, 4 - shift) : _mm256_srli_epi16(qh, shift - 4);
        v[n] = _mm256_or_si256(nib, _mm256_and_si256(hi, top));
      }
      transpose4(v);
      for (int k = 0; k < 4; ++k) w.q[h][k] = v[k];
    }
    const __m128i bytes = q6k_scale_bytes(sb);
    w.sc[0] = _mm256_cvtepi8_epi32(bytes), w.sc[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8));
  }
  return w;
}

// Per weight row i < 8: the super-block's integer sum (scales included), spread over the 8
// int32 lanes of sums[i]; xq the super-block's 256 bytes of x, xb its group sums (Q6_K).
template <int64_t fmt>
inline void kquant_dot(const KBytes8* w, const int8_t* xq, const int32_t* xb, __m256i sums[8]) {
  for (int i = 0; i < 8; ++i) sums[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256i s[8] = {};  // Q4_K: int16 pairs, 8 products a lane (|s| <= 15240); Q6_K: int32
    for (int k = 0; k < 4; ++k) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * k + 32 * h));
      for (int i = 0; i < 8; ++i) {
        const __m256i p = _mm256_maddubs_epi16(w[i].q[h][k], xv);  // |pair| <= 2 * 63 * 127
        s[i] = fmt == kQ4_K ? _mm256_add_epi16(s[i], p) : _mm256_add_epi32(s[i], _mm256_madd_epi16(p, ones));
      }
    }
    if constexpr (fmt == kQ4_K) {
      for (int i = 0; i < 8; ++i) sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(s[i], w[i].sc[h]));
    } else {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 8 * h));
      for (int i = 0; i < 8; ++i) {
        sums[i] = _mm256_add_epi32(sums[i], _mm256_mullo_epi32(_mm256_sub_epi32(s[i], b), w[i].sc[h]));
      }
    }
  }
}

#ifdef RS_VNNI
inline void transpose4(__m512i v[4]) {  // as above, in each of the 4 chunks
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
  v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}

struct KBytes16 {
  __m512i q[4], sc;  // sc, lane l: Q4_K sc_{l / 2} in its low 16 bits; Q6_K sc_{g(l)}
};

template <int64_t fmt>
inline KBytes16 kquant_bytes(V16, const uint8_t* sb) {
  const __m512i low4 = _mm512_set1_epi8(15);
  KBytes16 w;
  if constexpr (fmt == kQ4_K) {
    const __m512i a = _mm512_loadu_si512(sb + 16), b = _mm512_loadu_si512(sb + 80);
    const __m512i la = _mm512_and_si512(a, low4), ha = _mm512_and_si512(_mm512_srli_epi16(a, 4), low4);
    const __m512i lb = _mm512_and_si512(b, low4), hb = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    // 128-bit chunk c of u0 (u1): qword 2c (2c + 1) of qs as low then high nibbles; of u2, u3
    // qwords 8 + 2c, 9 + 2c. Vector k takes qwords k, 4 + k, 8 + k, 12 + k.
    const __m512i u0 = _mm512_unpacklo_epi64(la, ha), u1 = _mm512_unpackhi_epi64(la, ha);
    const __m512i u2 = _mm512_unpacklo_epi64(lb, hb), u3 = _mm512_unpackhi_epi64(lb, hb);
    w.q[0] = _mm512_shuffle_i64x2(u0, u2, 0x88), w.q[1] = _mm512_shuffle_i64x2(u1, u3, 0x88);
    w.q[2] = _mm512_shuffle_i64x2(u0, u2, 0xDD), w.q[3] = _mm512_shuffle_i64x2(u1, u3, 0xDD);
    w.sc = _mm512_cvtepu8_epi32(q4k_scale_bytes(sb));
  } else {
    // natural vector n: ql's nibbles as in the AVX2 kquant_bytes, qh (32 bytes, in both halves)
    // shifted per half so that its bits 4 (n % 2) + 2h, + 1 land on bits 4, 5
    const __m512i top = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int n = 0; n < 4; ++n) {
      const __m512i ql = _mm512_loadu_si512(sb + 64 * (n / 2));
      const __m256i qh32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * (n / 2)));
      const __m512i qh = _mm512_broadcast_i64x4(qh32);
      const __m512i nib = n % 2 ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4) : _mm512_and_si512(ql, low4);
      const __m512i hi = n % 2 ? _mm512_srlv_epi16(qh, down) : _mm512_sllv_epi16(qh, up);
      w.q[n] = _mm512_or_si512(nib, _mm512_and_si512(hi, top));
    }
    transpose4(w.q);
    w.sc = _mm512_cvtepi8_epi32(q6k_scale_bytes(sb));
  }
  return w;
}

template <int64_t fmt>
inline void kquant_dot(const KBytes16* w, const int8_t* xq, const int32_t* xb, __m512i sums[16]) {
  for (int i = 0; i < 16; ++i) sums[i] = _mm512_setzero_si512();
  for (int k = 0; k < 4; ++k) {
    const __m512i xv = _mm512_loadu_si512(xq + 64 * k);
    for (int i = 0; i < 16; ++i) sums[i] = _mm512_dpbusd_epi32(sums[i], w[i].q[k], xv);
  }
  if constexpr (fmt == kQ4_K) {
    for (int i = 0; i < 16; ++i) sums[i] = _mm512_madd_epi16(sums[i], w[i].sc);
  } else {
    const __m512i b = _mm512_loadu_si512(xb);
    for (int i = 0; i < 16; ++i) sums[i] = _mm512_mullo_epi32(_mm512_sub_epi32(sums[i], b), w[i].sc);
  }
}
#endif

// ------------------------------------------------------------------ packed K-quant tiles
//
// Format codes kQ4_K_P8 and kQ6_K_P8: the int8-x kernels' Q4_K and Q6_K weights packed once
// at load (`pack`) into tiles of 8 weight rows, each super-block's bytes already in the
// kernels' lane order, so that a task no longer shuffles the quants and decodes the 6-bit
// scales of every (weight row, super-block) it reads: it masks and shifts nibbles. A row's
// super-block takes packed_bytes(fmt): 148 for Q4_K (144 in the file: the scales take a byte
// each), 210 for Q6_K; a tile's super-blocks follow each other, so a task of 8 or 16 rows
// reads one or two sequential streams instead of 8 or 16. Tile t (rows 8t .. 8t + 7) starts
// at byte 8t * the packed row bytes; its super-block u at 8 * u * packed_bytes(fmt), laid out
// as
// - Q4_K: quants, row i at 128 i: two 64-byte chunks c, whose byte b holds byte b of
//   lane-order vector 2c in its low nibble and of vector 2c + 1 in its high one; at 1024 the
//   rows' sc_j (8 bytes a row); at 1088 the mins m_j of the 8 rows (8 bytes per j); at 1152
//   the rows' fp16 d, at 1168 their fp16 dmin.
// - Q6_K: the quants' low 4 bits as Q4_K's; at 1024 their top 2 bits, row i at 1024 + 64 i,
//   byte b holding those of vector k's byte b in bits 2k, 2k + 1; at 1536 the rows' int8
//   scales in lane order (16 a row, byte l = sc_{g(l)}); at 1664 the rows' fp16 d.
// The kernels form the same lane vectors, scales and float32 operations from a tile as from
// the file layout, so a packed weight's products equal the file layout's bit for bit.
// Byte p = sc_{p / 2} (q4k_scale_bytes' order) from a row's 8 packed scale bytes.
inline __m128i q4k_packed_scales(const uint8_t* sc) {
  const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)), pairs);
}

// Row i's super-block of a tile (`unit`: its first byte) as kquant_bytes makes it.
template <int64_t fmt>
inline KBytes8 packed_kquant_bytes(V8, const uint8_t* unit, int i) {
  const __m256i low4 = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  const uint8_t* q = unit + 128 * i;
  KBytes8 w;
  for (int h = 0; h < 2; ++h) {
    const __m256i hb = fmt == kQ6_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 1024 + 64 * i + 32 * h))
                                    : _mm256_setzero_si256();
    for (int c = 0; c < 2; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32 * h));
      w.q[h][2 * c] = _mm256_and_si256(v, low4), w.q[h][2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if constexpr (fmt == kQ6_K) {  // bits 2k, 2k + 1 of hb -> bits 4, 5 of vector k
      w.q[h][0] = _mm256_or_si256(w.q[h][0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
      w.q[h][1] = _mm256_or_si256(w.q[h][1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
      w.q[h][2] = _mm256_or_si256(w.q[h][2], _mm256_and_si256(hb, top));
      w.q[h][3] = _mm256_or_si256(w.q[h][3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
    }
  }
  if constexpr (fmt == kQ4_K) {
    const __m128i bytes = q4k_packed_scales(unit + 1024 + 8 * i);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(bytes, 8) : bytes);
      w.sc[h] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
    }
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 1536 + 16 * i));
    w.sc[0] = _mm256_cvtepi8_epi32(bytes), w.sc[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8));
  }
  return w;
}

// A tile's super-block scales as super_scales8 gives them for the same 8 rows: d and, for
// Q4_K, m[j] = -dmin * m_j.
template <int64_t fmt>
inline void packed_scales8(const uint8_t* unit, __m256& d, __m256 m[8]) {
  if constexpr (fmt == kQ6_K) {
    d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 1664)));
    for (int j = 0; j < 8; ++j) m[j] = _mm256_setzero_ps();
    return;
  }
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 1152)));
  const __m256 mv =
      _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 1168))), _mm256_set1_ps(-0.0f));
  for (int j = 0; j < 8; ++j) {
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + 1088 + 8 * j)));
    m[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(mins), mv);
  }
}

template <int64_t fmt>
inline void packed_scales(V8, const uint8_t* const* tiles, __m256& d, __m256 m[8]) {
  packed_scales8<fmt>(tiles[0], d, m);
}

#ifdef RS_VNNI
template <int64_t fmt>
inline KBytes16 packed_kquant_bytes(V16, const uint8_t* unit, int i) {
  const __m512i low4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  const uint8_t* q = unit + 128 * i;
  KBytes16 w;
  for (int c = 0; c < 2; ++c) {
    const __m512i v = _mm512_loadu_si512(q + 64 * c);
    w.q[2 * c] = _mm512_and_si512(v, low4), w.q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
  if constexpr (fmt == kQ6_K) {
    const __m512i hb = _mm512_loadu_si512(unit + 1024 + 64 * i);
    w.q[0] = _mm512_or_si512(w.q[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), top));
    w.q[1] = _mm512_or_si512(w.q[1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), top));
    w.q[2] = _mm512_or_si512(w.q[2], _mm512_and_si512(hb, top));
    w.q[3] = _mm512_or_si512(w.q[3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), top));
    w.sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 1536 + 16 * i)));
  } else {
    w.sc = _mm512_cvtepu8_epi32(q4k_packed_scales(unit + 1024 + 8 * i));
  }
  return w;
}

template <int64_t fmt>
inline void packed_scales(V16, const uint8_t* const* tiles, __m512& d, __m512 m[8]) {
  __m256 d0, d1, m0[8], m1[8];
  packed_scales8<fmt>(tiles[0], d0, m0), packed_scales8<fmt>(tiles[1], d1, m1);
  d = join(d0, d1);
  for (int j = 0; j < 8; ++j) m[j] = join(m0[j], m1[j]);
}
#endif

// w (N, row_bytes) in the file layout, N a multiple of 8 -> its tiles (N, units * packed_bytes).
void pack_rows(const uint8_t* w, int64_t fmt, int64_t N, int64_t units, uint8_t* out) {
  const int64_t row_bytes = units * unit_bytes(fmt), tile_unit = kPackRows * packed_bytes(fmt);
  const int64_t tile_bytes = units * tile_unit;
  at::parallel_for(0, N / kPackRows * units, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t tile = t / units, u = t % units;
      uint8_t* unit = out + tile * tile_bytes + u * tile_unit;
      for (int i = 0; i < kPackRows; ++i) {
        const uint8_t* sb = w + (tile * kPackRows + i) * row_bytes + u * unit_bytes(fmt);
        const KBytes8 b = fmt == kQ6_K ? kquant_bytes<kQ6_K>(V8{}, sb) : kquant_bytes<kQ4_K>(V8{}, sb);
        const __m256i low4 = _mm256_set1_epi8(15);
        __m256i hb[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int h = 0; h < 2; ++h) {
          for (int c = 0; c < 2; ++c) {
            const __m256i lo = _mm256_and_si256(b.q[h][2 * c], low4), hi = _mm256_and_si256(b.q[h][2 * c + 1], low4);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(unit + 128 * i + 64 * c + 32 * h),
                                _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
          }
          for (int k = 0; k < 4 && fmt == kQ6_K; ++k) {  // q6 >> 4 (2 bits) into bits 2k, 2k + 1
            const __m256i top = _mm256_and_si256(_mm256_srli_epi16(b.q[h][k], 4), _mm256_set1_epi8(3));
            hb[h] = _mm256_or_si256(hb[h], _mm256_slli_epi16(top, 2 * k));
          }
        }
        if (fmt == kQ6_K) {
          for (int h = 0; h < 2; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(unit + 1024 + 64 * i + 32 * h), hb[h]);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(unit + 1536 + 16 * i), q6k_scale_bytes(sb));
          std::memcpy(unit + 1664 + 2 * i, sb + 208, 2);
          continue;
        }
        for (int j = 0; j < 8; ++j) {
          int32_t sc, mn;
          scale_min(sb + 4, j, sc, mn);
          unit[1024 + 8 * i + j] = static_cast<uint8_t>(sc), unit[1088 + 8 * j + i] = static_cast<uint8_t>(mn);
        }
        std::memcpy(unit + 1152 + 2 * i, sb, 2), std::memcpy(unit + 1168 + 2 * i, sb + 2, 2);
      }
    }
  });
}
// dot_wrows for K-quant weights and int8 x: the V::L weight rows from w (8 a task with AVX2,
// 16 with AVX512-VNNI), r < M <= kPass rows of x from xr. Per super-block the rows'
// bytes are arranged once for the M rows of x (kquant_bytes), each (weight row, x row) gives
// one int32 vector (kquant_dot: the rows' chains interleaved), the L vectors are reduced into
// one and scaled once, Q4_K's offsets m_j * s_x added per sub-block: dot_rows8's operations.
template <typename V, int64_t fmt, int kM, bool kPacked, int64_t kPass = kStreamRows>
void dot_wrows8(const uint8_t* w, int64_t row_bytes, int64_t nb, const Q8Rows& x, int64_t xr, int64_t M, float* out,
                int64_t ldo) {
  constexpr int L = V::L;
  const int64_t rows_x = kM ? kM : M, units = nb / 8;
  const uint8_t* rows[L];  // the file layout's rows, or the packed layout's L / 8 tiles
  for (int i = 0; i < (kPacked ? L / kPackRows : L); ++i) rows[i] = w + i * (kPacked ? kPackRows : 1) * row_bytes;
  // As dot_wrows: the next task's bytes asked for in order, a share per (unit, weight row),
  // into L2 (into L1 they evicted the current task's rows: 1.4x slower from DRAM at one row)
  const char* next = reinterpret_cast<const char*>(w + L * row_bytes);
  const int64_t share = (L * row_bytes + units * L - 1) / (units * L);
  typename V::F acc[kPass], off[kPass];
  for (int64_t r = 0; r < rows_x; ++r) acc[r] = off[r] = V::zero();
  decltype(kquant_bytes<fmt>(V{}, w)) wb[L];
  for (int64_t u = 0; u < units; ++u) {
    typename V::F d, m[8];
    const uint8_t* tiles[L / kPackRows];
    if constexpr (kPacked) {
      for (int s = 0; s < L / kPackRows; ++s) tiles[s] = rows[s] + u * kPackRows * packed_bytes(fmt);
      packed_scales<fmt>(V{}, tiles, d, m);
    } else {
      V::template super_scales<fmt>(rows, u, d, nullptr, m);  // the bytes carry the scales
    }
    const int64_t at = u * unit_bytes(fmt);
    for (int i = 0; i < L; ++i) {
      for (int64_t p = (u * L + i) * share; p < (u * L + i + 1) * share; p += 64) _mm_prefetch(next + p, _MM_HINT_T1);
      if constexpr (kPacked) wb[i] = packed_kquant_bytes<fmt>(V{}, tiles[i / kPackRows], i % kPackRows);
      else wb[i] = kquant_bytes<fmt>(V{}, rows[i] + at);
    }
    for (int64_t r = 0; r < rows_x; ++r) {
      const int64_t xu = (xr + r) * units + u;
      typename V::I sums[L];
      kquant_dot<fmt>(wb, x.q.data() + xu * kSuper, fmt == kQ6_K ? x.b.data() + xu * 16 : nullptr, sums);
      if constexpr (fmt == kQ4_K) {
        for (int j = 0; j < 8; ++j) off[r] = V::fmadd(m[j], V::set1(x.s[xu * 8 + j]), off[r]);
      }
      acc[r] = V::fmadd(V::mul(d, V::set1(x.d[xu])), V::cvt(V::reduce(sums)), acc[r]);
    }
  }
  for (int64_t r = 0; r < rows_x; ++r) V::storef(out + r * ldo, V::add(acc[r], off[r]));
}

template <typename V, bool kPacked>
void dot_wrows8(const uint8_t* w, int64_t fmt, int64_t row_bytes, int64_t nb, const Q8Rows& x, int64_t M, float* out,
                int64_t ldo) {
  const auto run = [&](auto f) {
    constexpr int64_t F = decltype(f)::value;
    if (M == 1) return dot_wrows8<V, F, 1, kPacked>(w, row_bytes, nb, x, 0, 1, out, ldo);
    in_passes(M, [&](auto pass, int64_t r0, int64_t rows) {
      dot_wrows8<V, F, 0, kPacked, decltype(pass)::value>(w, row_bytes, nb, x, r0, rows, out + r0 * ldo, ldo);
    });
  };
  if (fmt == kQ6_K) run(std::integral_constant<int64_t, kQ6_K>{});
  else run(std::integral_constant<int64_t, kQ4_K>{});
}

template <typename V>
void dot_wrows8(const uint8_t* w, int64_t fmt, bool packed, int64_t row_bytes, int64_t nb, const Q8Rows& x, int64_t M,
                float* out, int64_t ldo) {
  if (packed) dot_wrows8<V, true>(w, fmt, row_bytes, nb, x, M, out, ldo);
  else dot_wrows8<V, false>(w, fmt, row_bytes, nb, x, M, out, ldo);
}
#endif

template <int64_t fmt>
void dot_rows(const uint8_t* wrow, int64_t nb, const QRows& x, int64_t xr, int64_t rows, float* out,
              int64_t ldo) {
  switch (rows) {
    case 1: return dot_rows<fmt, 1>(wrow, nb, x, xr, out, ldo);
    case 2: return dot_rows<fmt, 2>(wrow, nb, x, xr, out, ldo);
    case 3: return dot_rows<fmt, 3>(wrow, nb, x, xr, out, ldo);
    case 4: return dot_rows<fmt, 4>(wrow, nb, x, xr, out, ldo);
    case 5: return dot_rows<fmt, 5>(wrow, nb, x, xr, out, ldo);
    case 6: return dot_rows<fmt, 6>(wrow, nb, x, xr, out, ldo);
    case 7: return dot_rows<fmt, 7>(wrow, nb, x, xr, out, ldo);
    default: return dot_rows<fmt, kRows>(wrow, nb, x, xr, out, ldo);
  }
}

void dot_rows(const uint8_t* wrow, int64_t fmt, int64_t nb, const QRows& x, int64_t xr, int64_t rows,
              float* out, int64_t ldo) {
  with_format(fmt, [&](auto f) { dot_rows<decltype(f)::value>(wrow, nb, x, xr, rows, out, ldo); });
}

// ------------------------------------------------------------------ legacy blocks with int8 x
//
// Format codes kQ8_0_B8 and kMXFP4_B8: Q8_0 and MXFP4 weights with x rounded to int8 per
// 32-block, as llama.cpp rounds activations for them (d = amax / 127, q = round(x / d);
// error <= amax / 254 of the block, 128x the int16 path's). A row's product is, block by
// block in order, acc = fma(d_w * d_x, s, acc) from 0, s the block's exact int32 sum of its
// 32 byte products (|w| as unsigned bytes times x with w's sign: vpdpbusd; AVX2: maddubs,
// whose int16 pairs <= 2 * 128 * 127 do not saturate, then madd). The streaming loop runs
// them up to their small_m rows (decode, draft verification); above it, the int16 GEMM of
// the same weights (prefill).
//
// Format code kMXFP4_P16: MXFP4 weights packed once into tiles of 16 rows (`pack`, AVX2
// builds), run by the streaming loop at any M with the file layout's bits. A tile's block b
// is 16 E8M0 scales (rows 0-15), then four 64-byte groups: byte 4i + t of group p holds
// row i's codes 8p + t (low nibble) and 8p + 4 + t (high nibble), so one vector of codes
// holds 4 consecutive weights of each of 16 rows, met by 4 bytes of x broadcast. The codes
// are looked up as w + 12 (unsigned, kFp4Biased) and each block's sum starts from
// -12 * sum(x's block), so a lane ends with the row's exact block sum and one FMA scales it:
// no horizontal sums, no sign fix-ups, a block's scales of 16 rows in one load.
struct B8Rows {
  std::vector<int8_t> q;       // (M, K)
  std::vector<float> d;        // (M, K / 32); NaN for a block holding inf or NaN (its q: 0)
  std::vector<int32_t> bias;   // (M, K / 32): -12 * the block's sum of q (kMXFP4_P16)
};

constexpr int32_t kFp4Bias = 12;
constexpr uint8_t kFp4Biased[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  // kFp4 + 12
constexpr int64_t kTileUnit = kTileRows * unit_bytes(kMXFP4);  // a tile's bytes per block
constexpr int64_t kTileXRows = 4;                                // rows of x per pass over a tile

void quantize_rows_b8(const float* x, int64_t M, int64_t K, B8Rows& out) {
  const int64_t blocks = M * K / kBlock;
  out.q.resize(M * K), out.d.resize(blocks), out.bias.resize(blocks);
  for (int64_t u = 0; u < blocks; ++u) {
    const float* xb = x + u * kBlock;
    int8_t* q = out.q.data() + u * kBlock;
    const float amax = unit_amax(xb, kBlock);
    out.d[u] = amax / 127.f;
    const float id = amax > 0.f ? 127.f / amax : 0.f;  // (NaN amax: q = 0)
#ifdef RS_AVX2
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), _mm256_set1_ps(std::isnan(amax) ? 0.f : id));
      i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int j = 0; j < kBlock; ++j) q[j] = std::isnan(amax) ? 0 : static_cast<int8_t>(std::nearbyint(xb[j] * id));
#endif
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) sum += q[j];
    out.bias[u] = -kFp4Bias * sum;
  }
}

template <int64_t fmt>
inline float b8_scale(const uint8_t* blk) {
  return fmt == kMXFP4 ? e8m0_half(blk[0]) : half_to_float(blk);
}

#ifdef RS_AVX2
// A block's 32 quants as bytes in element order: Q8_0's int8 weights, MXFP4's codes.
template <int64_t fmt>
inline __m256i b8_codes(const uint8_t* blk) {
  if constexpr (fmt == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1)), mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
  }
}

// A block's 32 weights as int8, in element order.
template <int64_t fmt>
inline __m256i b8_weights(const uint8_t* blk) {
  if constexpr (fmt == kQ8_0) return b8_codes<fmt>(blk);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4)));
  return _mm256_shuffle_epi8(lut, b8_codes<fmt>(blk));
}

// Lane i = acc + the sum of aw[4i + j] * sx[4i + j], j < 4 (aw unsigned, sx signed bytes), exact.
inline __m256i dot_b8(__m256i acc, __m256i aw, __m256i sx) {
#ifdef RS_VNNI
  return _mm256_dpbusd_epi32(acc, aw, sx);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}

inline int32_t hsum_i32(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}
#endif

// out[r * ldo] = x row xr + r . the weight row (file layout), r < R: block by block, each
// block's exact sum scaled into the row's float32 (the module comment's order).
template <int64_t fmt, int R>
void dot_rows_b8(const uint8_t* wrow, int64_t nb, const B8Rows& x, int64_t xr, float* out, int64_t ldo) {
  constexpr int64_t bytes = unit_bytes(fmt);
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bytes;
    const float dw = b8_scale<fmt>(blk);
#ifdef RS_AVX2
    const __m256i w = b8_weights<fmt>(blk), aw = _mm256_abs_epi8(w);
#else
    int32_t w[kBlock];
    block_quants<fmt>(wrow, b, w);
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (xr + r) * nb + b;
      const int8_t* xq = x.q.data() + xb * kBlock;
#ifdef RS_AVX2
      const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)), w);
      const int32_t sum = hsum_i32(dot_b8(_mm256_setzero_si256(), aw, sx));
#else
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) sum += w[j] * xq[j];
#endif
      acc[r] = fma_like_vectors(dw * x.d[xb], static_cast<float>(sum), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
}

// Weight rows [0, rows) from wrow (row_bytes apart) times the M rows of x, kRows at a time.
void dot_rows_b8(const uint8_t* wrow, int64_t fmt, int64_t row_bytes, int64_t rows, int64_t nb, const B8Rows& x,
                 int64_t M, float* out, int64_t ldo) {
  const auto run = [&](auto f) {
    constexpr int64_t F = decltype(f)::value;
    for (int64_t i = 0; i < rows; ++i) {
      const uint8_t* w = wrow + i * row_bytes;
      float* o = out + i;
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int64_t R = std::min(kRows, M - r0);
        switch (R) {
          case 1: dot_rows_b8<F, 1>(w, nb, x, r0, o + r0 * ldo, ldo); break;
          case 2: dot_rows_b8<F, 2>(w, nb, x, r0, o + r0 * ldo, ldo); break;
          case 3: dot_rows_b8<F, 3>(w, nb, x, r0, o + r0 * ldo, ldo); break;
          case 4: dot_rows_b8<F, 4>(w, nb, x, r0, o + r0 * ldo, ldo); break;
          case 5: dot_rows_b8<F, 5>(w, nb, x, r0, o + r0 * ldo, ldo); break;
          case 6: dot_rows_b8<F, 6>(w, nb, x, r0, o + r0 * ldo, ldo); break;
          case 7: dot_rows_b8<F, 7>(w, nb, x, r0, o + r0 * ldo, ldo); break;
          default: dot_rows_b8<F, kRows>(w, nb, x, r0, o + r0 * ldo, ldo);
        }
      }
    }
  };
  if (fmt == kQ8_0) run(std::integral_constant<int64_t, kQ8_0>{});
  else run(std::integral_constant<int64_t, kMXFP4>{});
}

#ifdef RS_AVX2
// MXFP4 rows r0..r0 + 15 (file layout, row_bytes apart) -> their tile (nb * kTileUnit bytes).
void pack_tile16(const uint8_t* rows, int64_t row_bytes, int64_t nb, uint8_t* tile) {
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* t = tile + b * kTileUnit;
    for (int64_t i = 0; i < kTileRows; ++i) {
      const uint8_t* blk = rows + i * row_bytes + b * unit_bytes(kMXFP4);
      t[i] = blk[0];
      uint8_t code[kBlock];  // element order: low nibbles are elements 0-15
      for (int j = 0; j < 16; ++j) code[j] = blk[1 + j] & 15, code[16 + j] = blk[1 + j] >> 4;
      for (int p = 0; p < 4; ++p) {
        for (int s = 0; s < 4; ++s) t[16 + 64 * p + 4 * i + s] = code[8 * p + s] | code[8 * p + 4 + s] << 4;
      }
    }
  }
}

// A tile's block scales (E8M0 bytes, halved as e8m0_half) of 8 rows from s.
inline __m256 e8m0_half8(const uint8_t* s) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A tile block's scales of rows L * h .. (V8: 8 rows, V16: all 16) and the codes of one of
// its 64-byte groups, looked up as w + 12: low nibbles (weights 8p .. 8p + 3 of each row),
// then high nibbles (8p + 4 ..); `dot_u8` adds the products of 4 such bytes of each row with
// 4 bytes of x, exactly.
inline __m256 tile_scales(V8, const uint8_t* s) { return e8m0_half8(s); }
inline void tile_codes(V8, const uint8_t* group, __m256i& lo, __m256i& hi) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4Biased)));
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group)), mask = _mm256_set1_epi8(15);
  lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, mask));
  hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
}
inline __m256i dot_u8(V8, __m256i acc, __m256i w, int32_t x4) { return dot_b8(acc, w, _mm256_set1_epi32(x4)); }
inline __m256i set1_i32(V8, int32_t v) { return _mm256_set1_epi32(v); }
#ifdef RS_VNNI
inline __m512 tile_scales(V16, const uint8_t* s) { return join(e8m0_half8(s), e8m0_half8(s + 8)); }
inline void tile_codes(V16, const uint8_t* group, __m512i& lo, __m512i& hi) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4Biased)));
  const __m512i v = _mm512_loadu_si512(group), mask = _mm512_set1_epi8(15);
  lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, mask));
  hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
}
inline __m512i dot_u8(V16, __m512i acc, __m512i w, int32_t x4) {
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
}
inline __m512i set1_i32(V16, int32_t v) { return _mm512_set1_epi32(v); }
#endif

// out[r * ldo + i] = x row xr + r . tile row i, r < R, i < 16 (the module comment's order),
// V::L rows at a time.
template <class V, int R>
void dot_tile16(const uint8_t* tile, int64_t nb, const B8Rows& x, int64_t xr, float* out, int64_t ldo) {
  for (int64_t h = 0; h < kTileRows / V::L; ++h) {
    typename V::F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::zero();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* t = tile + b * kTileUnit;
      const typename V::F dw = tile_scales(V{}, t + V::L * h);
      typename V::I w[8];
      for (int p = 0; p < 4; ++p) tile_codes(V{}, t + 16 + 64 * p + 4 * V::L * h, w[2 * p], w[2 * p + 1]);
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (xr + r) * nb + b;
        const int8_t* q = x.q.data() + xb * kBlock;
        typename V::I sum = set1_i32(V{}, x.bias[xb]);
        for (int g = 0; g < 8; ++g) sum = dot_u8(V{}, sum, w[g], load_i32(q + 4 * g));
        acc[r] = V::fmadd(V::mul(dw, V::set1(x.d[xb])), V::cvt(sum), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) V::storef(out + r * ldo + V::L * h, acc[r]);
  }
}

// Tile at `tile` times the M rows of x, kTileXRows at a time.
void dot_tile16(const uint8_t* tile, int64_t nb, const B8Rows& x, int64_t M, float* out, int64_t ldo) {
#ifdef RS_VNNI
  using V = V16;
#else
  using V = V8;
#endif
  for (int64_t r0 = 0; r0 < M; r0 += kTileXRows) {
    switch (std::min(kTileXRows, M - r0)) {
      case 1: dot_tile16<V, 1>(tile, nb, x, r0, out + r0 * ldo, ldo); break;
      case 2: dot_tile16<V, 2>(tile, nb, x, r0, out + r0 * ldo, ldo); break;
      case 3: dot_tile16<V, 3>(tile, nb, x, r0, out + r0 * ldo, ldo); break;
      default: dot_tile16<V, kTileXRows>(tile, nb, x, r0, out + r0 * ldo, ldo);
    }
  }
}
#endif

void check_args(const at::Tensor& x, const at::Tensor& w, int64_t code, int64_t K, bool bf16_ok = false) {
  const int64_t fmt = weight_format(code);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || (bf16_ok && x.scalar_type() == at::kBFloat16)),
              "x must be a contiguous (M, K) float32", bf16_ok ? " or bfloat16" : "", " tensor, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "w must be a contiguous (N, bytes) uint8 tensor, got ", w.sizes());
  check_format(fmt);
  const int64_t unit = is_kquant(fmt) ? kSuper : kBlock;
  TORCH_CHECK(K % unit == 0 && x.size(1) == K, "K must be a multiple of ", unit, " and equal x.size(1): K=", K,
              " x ", x.sizes());
  const int64_t row_bytes = is_packed(code) ? K / kSuper * packed_bytes(fmt) : row_bytes_of(fmt, K);
  TORCH_CHECK(w.size(1) == row_bytes, "w row bytes ", w.size(1), " do not match K=", K, " in format ", code);
#ifdef RS_AVX2
  TORCH_CHECK(!is_tiled(code) || w.size(0) % tile_rows(code) == 0, "packed tiles need rows in multiples of ",
              tile_rows(code));
#else
  TORCH_CHECK(!is_tiled(code), "packed tiles need the AVX2 build");
#endif
}

// A weight of the small kernels' loop: its bytes, weight format, its x (M rows of nb
// 32-blocks) quantized for its format (int16, or int8 for Q4_K and Q6_K: x8 set), and where
// its output columns start (out, rows ldo apart).
struct SmallPart {
  const uint8_t* w;
  int64_t fmt, rows, row_bytes;
  bool packed;  // w in packed tiles (int8 x)
  const QRows* x;
  const Q8Rows* x8;
  int64_t M, nb;
  float* out;
  int64_t ldo;
  const B8Rows* xb = nullptr;  // Q8_0 / MXFP4 with int8 x
};

// out (M, ldo) columns [0, rows) of every part = its x @ part.T, in ONE parallel loop over
// all parts' rows (a fused projection of several parts, or several experts' projections,
// cost one loop, as one part): 16 weight rows a task (dot_wrows, AVX512-VNNI; MXFP4 tiles
// in any AVX2 build), then 8 (AVX2), the rest (and every row in a build without AVX2) one
// row a task.
void run_small(const std::vector<SmallPart>& parts) {
  struct Task {
    int32_t part, rows;
    int64_t n;
  };
  std::vector<Task> tasks;
  for (size_t p = 0; p < parts.size(); ++p) {
    int64_t n = 0;
    if (parts[p].xb && parts[p].packed) {
      for (; n < parts[p].rows; n += kTileRows) tasks.push_back({static_cast<int32_t>(p), kTileRows, n});
    }
#ifdef RS_VNNI
    for (; n + 16 <= parts[p].rows; n += 16) tasks.push_back({static_cast<int32_t>(p), 16, n});
#endif
#ifdef RS_AVX2
    for (; n + 8 <= parts[p].rows; n += 8) tasks.push_back({static_cast<int32_t>(p), 8, n});
#endif
    for (; n < parts[p].rows; ++n) tasks.push_back({static_cast<int32_t>(p), 1, n});
  }
  const auto run_task = [&](int64_t t) {
    const Task& task = tasks[t];
    const SmallPart& part = parts[task.part];
    const uint8_t* row = part.w + task.n * part.row_bytes;
    float* o = part.out + task.n;
    const int64_t M = part.M, nb = part.nb, ldo = part.ldo;
#ifdef RS_AVX2
    if (part.xb && part.packed) return dot_tile16(row, nb, *part.xb, M, o, ldo);
#endif
    if (part.xb) return dot_rows_b8(row, part.fmt, part.row_bytes, task.rows, nb, *part.xb, M, o, ldo);
#ifdef RS_VNNI
    if (task.rows == 16) {
      if (part.x8) dot_wrows8<V16>(row, part.fmt, part.packed, part.row_bytes, nb, *part.x8, M, o, ldo);
      else dot_wrows<V16>(row, part.fmt, part.row_bytes, nb, *part.x, M, o, ldo);
      return;
    }
#endif
#ifdef RS_AVX2
    if (task.rows == 8) {
      if (part.x8) dot_wrows8<V8>(row, part.fmt, part.packed, part.row_bytes, nb, *part.x8, M, o, ldo);
      else dot_wrows<V8>(row, part.fmt, part.row_bytes, nb, *part.x, M, o, ldo);
      return;
    }
#endif
    if (part.x8) {
      dot_rows8(row, part.fmt, nb, *part.x8, 0, M, o, ldo);
      return;
    }
    for (int64_t r0 = 0; r0 < M; r0 += kRows) {
      dot_rows(row, part.fmt, nb, *part.x, r0, std::min(kRows, M - r0), o + r0 * ldo, ldo);
    }
  };
  // Threads take runs of tasks from a shared counter, not a fixed share each: a core slowed
  // by another process (or a VM neighbour) leaves the rest to the others, not a wait.
  const int64_t n = static_cast<int64_t>(tasks.size()), threads = at::get_num_threads();
  const int64_t run = std::max<int64_t>(1, n / (4 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, (n + run - 1) / run), 1, [&](int64_t, int64_t) {
    for (int64_t t0 = next.fetch_add(run); t0 < n; t0 = next.fetch_add(run)) {
      for (int64_t t = t0; t < std::min(n, t0 + run); ++t) run_task(t);
    }
  });
}

}  // namespace

// x (M, K) float32 @ w(N, K).T -> (M, N) float32; decode-sized M, x rounded to int16 (format
// codes kQ4_K_X8, kQ6_K_X8: int8).
at::Tensor qmatmul_small(const at::Tensor& x, const at::Tensor& w, int64_t code, int64_t K) {
  check_args(x, w, code, K);
  const int64_t M = x.size(0), N = w.size(0), fmt = weight_format(code);
  at::Tensor out = at::empty({M, N}, x.options());
  QRows xq;
  Q8Rows x8;
  B8Rows xb;
  if (is_x8(code)) quantize_rows8(x.data_ptr<float>(), M, K, fmt, x8);
  else if (is_b8(code)) quantize_rows_b8(x.data_ptr<float>(), M, K, xb);
  else quantize_rows(x.data_ptr<float>(), M, K, fmt, xq);
  run_small({{w.data_ptr<uint8_t>(), fmt, N, w.size(1), is_tiled(code), &xq, is_x8(code) ? &x8 : nullptr, M,
              K / kBlock, out.data_ptr<float>(), N, is_b8(code) ? &xb : nullptr}});
  return out;
}

// x (M, K) float32 @ w(N, K).T -> (M, N) float32, x rounded to int16 as in qmatmul_small;
// the int16 GEMM above for any M (AVX2 builds; `int_gemm` tells the caller whether it is
// there: the portable build, and int8 x at any M, run qmatmul_small's loops instead).
at::Tensor qmatmul_gemm(const at::Tensor& x, const at::Tensor& w, int64_t code, int64_t K) {
  if (code == kMXFP4_P16) return qmatmul_small(x, w, code, K);
  const int64_t fmt = is_b8(code) ? weight_format(code) : code;  // int8 x up to small_m only
#ifdef RS_AVX2
  if (is_x8(fmt)) return qmatmul_small(x, w, fmt, K);
  check_args(x, w, fmt, K);
  const int64_t M = x.size(0), N = w.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({M, N}, x.options());
  constexpr int64_t L = GemmV::L;
  const int64_t padded = (M + L - 1) / L * L;  // whole groups of rows; zero rows have d = s = 0
  const at::Tensor xp = padded == M ? x : at::constant_pad_nd(x, {0, 0, 0, padded - M});
  QRows xq;
  quantize_rows(xp.data_ptr<float>(), padded, K, fmt, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_format(fmt, [&](auto f) { gemm<GemmV, decltype(f)::value>(wp, N, nb, xq, M, op); });
  return out;
#else
  return qmatmul_small(x, w, fmt, K);
#endif
}

// x (M, K) @ w(N, K).T -> (M, N) in x's dtype; prefill-sized M. float32 x: the tiles are
// exact float32 weights and the sgemm sums in float32. bfloat16 x (a bf16 model): the tiles
// are the weights rounded to bf16, as a bf16 model holding the dequantized weights has them,
// and the bf16 GEMM (float32 accumulation) runs at the CPU's bf16 rate.
at::Tensor qmatmul_tiled(const at::Tensor& x, const at::Tensor& w, int64_t code, int64_t K) {
  check_args(x, w, code, K, true);
  TORCH_CHECK(!is_tiled(code), "qmatmul_tiled reads the file layout, not packed tiles");
  const int64_t fmt = weight_format(code);
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tiles = (N + kTile - 1) / kTile;
  const bool inference = c10::InferenceMode::is_enabled();
  const bool narrow = x.scalar_type() != at::kFloat;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);  // thread-local: the caller's mode, on every thread
    at::Tensor buf = at::empty({kTile, K}, x.options());  // this thread's tile, ~L2-sized
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, n1 = std::min(N, n0 + kTile);
      if (narrow) dequant_rows(wp, fmt, K, n0, n1, buf.data_ptr<at::BFloat16>());
      else dequant_rows(wp, fmt, K, n0, n1, buf.data_ptr<float>());
      at::Tensor dst = out.narrow(1, n0, n1 - n0);  // (M, tile) strided view: BLAS ldc = N
      at::mm_out(dst, x, buf.narrow(0, 0, n1 - n0).t());
    }
  });
  return out;
}

// A Q4_K, Q6_K or MXFP4 weight (N, row bytes) in the file layout -> its packed tiles in
// `out` (format codes kQ4_K_P8, kQ6_K_P8: (N, K / 256 * packed_bytes), N a multiple of 8;
// kMXFP4_P16: (N, row bytes), N a multiple of 16), AVX2 builds (`packs`).
void pack(const at::Tensor& w, int64_t fmt, int64_t K, at::Tensor& out) {
  TORCH_CHECK(fmt == kQ4_K || fmt == kQ6_K || fmt == kMXFP4, "only Q4_K, Q6_K and MXFP4 weights pack, got format ",
              fmt);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes_of(fmt, K),
              "w must be a contiguous (N, row bytes) uint8 tensor for K=", K, ", got ", w.sizes());
  const int64_t rows = fmt == kMXFP4 ? kTileRows : kPackRows;
  const int64_t out_bytes = fmt == kMXFP4 ? row_bytes_of(fmt, K) : K / kSuper * packed_bytes(fmt);
  TORCH_CHECK(w.size(0) % rows == 0, "packed tiles need rows in multiples of ", rows, ", got ", w.size(0));
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 && out.size(0) == w.size(0) &&
                  out.size(1) == out_bytes,
              "out must be a contiguous (N, ", out_bytes, ") uint8 tensor, got ", out.sizes());
#ifdef RS_AVX2
  if (fmt == kMXFP4) {
    const int64_t row_bytes = w.size(1), nb = K / kBlock;
    const uint8_t* src = w.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, w.size(0) / kTileRows, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) pack_tile16(src + t * kTileRows * row_bytes, row_bytes, nb, dst + t * kTileRows * row_bytes);
    });
    return;
  }
  pack_rows(w.data_ptr<uint8_t>(), fmt, w.size(0), K / kSuper, out.data_ptr<uint8_t>());
#else
  TORCH_CHECK(false, "packed tiles need the AVX2 build");
#endif
}

// Rows `ids` of the weight (e.g. token embeddings) -> (len(ids), K) float32.
at::Tensor dequant(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be 1-D int64");
  TORCH_CHECK(w.size(1) == row_bytes_of(fmt, K), "w row bytes do not match K=", K);
  const int64_t n = ids.size(0), rows = w.size(0);
  at::Tensor out = at::empty({n, K}, at::kFloat);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < rows, "row id ", idp[i], " out of range [0, ", rows, ")");
  }
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      dequant_rows(w.data_ptr<uint8_t>(), fmt, K, idp[i], idp[i] + 1, out.data_ptr<float>() + i * K);
    }
  });
  return out;
}

// ------------------------------------------------------------------ decoder-layer halves
//
// A Llama decoder layer whose projections are all quantized, float32 activations, in two
// calls around attention (radixserve/models/llama.py, LlamaDecoderLayer.forward): the same
// math as the module path (the kernels QuantLinear picks, HF RMSNorm, rotate-half RoPE,
// torch's SwiGLU), without the ~25 small torch ops and Python calls a layer otherwise makes
// (a batch-1 decode step is short enough for them to be a third of it).

namespace {

constexpr int64_t kMlpRows = 256;  // post_attention's MLP rows a block

// One quantized projection (QuantLinear): its parts stacked by rows, each part's bytes,
// format and the rows up to which the weight-streaming kernel runs (Format.small_m), and an
// optional bias.
struct QLinear {
  std::vector<at::Tensor> w;
  std::vector<int64_t> fmt, small_m;
  std::optional<at::Tensor> bias;
};

using LinearArg = std::tuple<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                             std::optional<at::Tensor>>;

QLinear qlinear_arg(const LinearArg& t) {
  QLinear l{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t)};
  TORCH_CHECK(!l.w.empty() && l.fmt.size() == l.w.size() && l.small_m.size() == l.w.size(),
              "a quantized linear needs blocks, a format and small_m per part");
  return l;
}

// x (M, K) float32 times one part -> (M, rows of the part) float32: the kernel for M rows.
at::Tensor apply_part(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t small_m) {
  const int64_t K = x.size(1);
  if (x.size(0) <= small_m) return qmatmul_small(x, w, fmt, K);
#ifdef RS_AVX2
  return qmatmul_gemm(x, w, fmt, K);
#else
  return qmatmul_tiled(x, w, fmt, K);
#endif
}

// A projection's rows of x and where its outputs go: y (M, ldy), the projection's
// columns from 0.
struct SmallJob {
  const QLinear* l;
  at::Tensor x;  // (M, K) float32
  float* y;
  int64_t ldy;
};

int64_t out_features(const QLinear& l) {
  int64_t n = 0;
  for (const at::Tensor& w : l.w) n += w.size(0);
  return n;
}

// Every job's x times every part of its projection (M <= each small_m), all in the small
// kernels' one loop; each job's x quantized once per format its parts need.
void run_jobs(const std::vector<SmallJob>& jobs) {
  // x as the legacy formats, Q4_K, Q5_K and Q6_K take it in int16, and Q4_K and Q6_K in int8
  struct Quantized {
    QRows xq[4];
    Q8Rows x8[2];
    B8Rows xb;
    bool done[7] = {false, false, false, false, false, false, false};
  };
  std::vector<Quantized> quantized(jobs.size());  // sized once: the parts point into it
  std::vector<SmallPart> parts;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const QLinear& l = *jobs[j].l;
    const at::Tensor& x = jobs[j].x;
    Quantized& xs = quantized[j];
    const int64_t M = x.size(0), K = x.size(1);
    int64_t col = 0;
    for (size_t i = 0; i < l.w.size(); ++i) {
      const int64_t code = l.fmt[i], fmt = weight_format(code);
      check_args(x, l.w[i], code, K);
      const int64_t q = is_b8(code)   ? 6
                        : is_x8(code) ? 4 + (fmt == kQ6_K)
                        : is_kquant(fmt) ? fmt - kQ4_K + 1
                                         : 0;
      if (!xs.done[q] && q == 6) quantize_rows_b8(x.data_ptr<float>(), M, K, xs.xb);
      else if (!xs.done[q] && q >= 4) quantize_rows8(x.data_ptr<float>(), M, K, fmt, xs.x8[q - 4]);
      else if (!xs.done[q]) quantize_rows(x.data_ptr<float>(), M, K, fmt, xs.xq[q]);
      xs.done[q] = true;
      parts.push_back({l.w[i].data_ptr<uint8_t>(), fmt, l.w[i].size(0), l.w[i].size(1), is_tiled(code),
                       q < 4 ? &xs.xq[q] : nullptr, q == 4 || q == 5 ? &xs.x8[q - 4] : nullptr, M, K / kBlock,
                       jobs[j].y + col, jobs[j].ldy, q == 6 ? &xs.xb : nullptr});
      col += l.w[i].size(0);
    }
  }
  run_small(parts);
}

bool fits_small(const QLinear& l, int64_t M) {
  for (int64_t m : l.small_m) {
    if (M > m) return false;
  }
  return true;
}

// x (M, K) float32 times every part, all in the small kernels' loop (M <= each small_m).
at::Tensor small_parts(const QLinear& l, const at::Tensor& x) {
  const int64_t n = out_features(l);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  run_jobs({{&l, x, y.data_ptr<float>(), n}});
  return y;
}

// x (M, K) float32 -> (M, N) float32 = x @ W.T + bias (QuantLinear.forward for float32 x).
at::Tensor apply(const QLinear& l, const at::Tensor& x) {
  at::Tensor y;
  if (fits_small(l, x.size(0))) {
    y = small_parts(l, x);
  } else if (l.w.size() == 1) {
    y = apply_part(x, l.w[0], l.fmt[0], l.small_m[0]);
  } else {
    y = at::empty({x.size(0), out_features(l)}, x.options());
    for (size_t i = 0, col = 0; i < l.w.size(); col += l.w[i].size(0), ++i) {
      y.narrow(1, col, l.w[i].size(0)).copy_(apply_part(x, l.w[i], l.fmt[i], l.small_m[i]));
    }
  }
  if (l.bias) y.add_(*l.bias);
  return y;
}

// HF LlamaRMSNorm on float32 rows (T, H) -> new (T, H).
at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor out = at::empty_like(x);
  rowops::rms_norm(x.data_ptr<float>(), x.size(1), w.data_ptr<float>(), x.size(0), x.size(1),
                   static_cast<float>(eps), out.data_ptr<float>());
  return out;
}

void check_f32(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim, name,
              ": contiguous float32 CPU tensor of ", dim, " dims expected, got ", t.sizes(), " ", t.scalar_type());
}

}  // namespace

// x (M, K) float32 -> (M, N) float32 for a QuantLinear (its native_arg).
at::Tensor qlinear(const at::Tensor& x, const LinearArg& arg) {
  check_f32(x, 2, "x");
  return apply(qlinear_arg(arg), x);
}

// h (T, H) float32 -> [q (T, Hq, D) float32, k, v (T, Hkv, D) in kv_like's dtype]: RMSNorm,
// the quantized qkv projection, each q and k head RMS-normed by q_norm / k_norm (D,) when
// they are not empty (OLMoE's (Hq * D,) and (Hkv * D,): each token's whole q and k), then
// RoPE on the first R dims of each head with table (T, 2, R) (an empty table: no RoPE).
std::vector<at::Tensor> pre_attention(const at::Tensor& h, const at::Tensor& norm_w, double eps,
                                      const LinearArg& qkv_arg, const at::Tensor& table, int64_t q_heads,
                                      int64_t kv_heads, int64_t d, const at::Tensor& q_norm,
                                      const at::Tensor& k_norm, const at::Tensor& kv_like) {
  check_f32(h, 2, "h");
  const int64_t t = h.size(0);
  const at::Tensor qkv = apply(qlinear_arg(qkv_arg), rms_norm_f32(h, norm_w, eps));  // (T, (Hq + 2 Hkv) D)
  TORCH_CHECK(qkv.size(1) == (q_heads + 2 * kv_heads) * d, "qkv width ", qkv.size(1), " != (Hq + 2 Hkv) * D");
  TORCH_CHECK((q_norm.numel() == 0) == (k_norm.numel() == 0), "q_norm and k_norm: both or neither");
  const bool rotate = table.numel() > 0;
  if (rotate) {
    check_f32(table, 3, "table");
    TORCH_CHECK(table.size(0) == t && table.size(1) == 2 && table.size(2) % 2 == 0 && table.size(2) <= d,
                "table: (T, 2, R <= D) expected");
  }
  const int64_t r = rotate ? table.size(2) : 0;
  at::Tensor q = at::empty({t, q_heads, d}, h.options());
  at::Tensor k = at::empty({t, kv_heads, d}, h.options());
  if (q_norm.numel() == 0) {  // straight from the projection's rows
    rowops::rope(qkv.data_ptr<float>(), qkv.size(1), table.data_ptr<float>(), t, q_heads, kv_heads, d, r,
                 q.data_ptr<float>(), k.data_ptr<float>());
  } else {  // normed heads (or whole q and k rows) first, in place in contiguous copies, then rotated
    at::Tensor qn = qkv.narrow(1, 0, q_heads * d).contiguous();
    at::Tensor kn = qkv.narrow(1, q_heads * d, kv_heads * d).contiguous();
    check_f32(q_norm, 1, "q_norm");
    check_f32(k_norm, 1, "k_norm");
    const int64_t qw = q_norm.numel(), kw = k_norm.numel();  // D each, or Hq * D and Hkv * D
    TORCH_CHECK((qw == d && kw == d) || (qw == q_heads * d && kw == kv_heads * d),
                "q_norm / k_norm: (D,) per head or (Hq * D,) / (Hkv * D,) over the whole rows expected");
    rowops::rms_norm(qn.data_ptr<float>(), qw, q_norm.data_ptr<float>(), t * q_heads * d / qw, qw,
                     static_cast<float>(eps), qn.data_ptr<float>());
    rowops::rms_norm(kn.data_ptr<float>(), kw, k_norm.data_ptr<float>(), t * kv_heads * d / kw, kw,
                     static_cast<float>(eps), kn.data_ptr<float>());
    float* none = nullptr;  // the other kind of head: there are 0 of them
    rowops::rope(qn.data_ptr<float>(), q_heads * d, table.data_ptr<float>(), t, q_heads, 0, d, r,
                 q.data_ptr<float>(), none);
    rowops::rope(kn.data_ptr<float>(), kv_heads * d, table.data_ptr<float>(), t, 0, kv_heads, d, r, none,
                 k.data_ptr<float>());
  }
  const at::Tensor v = qkv.narrow(1, (q_heads + kv_heads) * d, kv_heads * d).view({t, kv_heads, d});
  const auto kv_dtype = kv_like.scalar_type();
  return {q, k.to(kv_dtype), v.to(kv_dtype)};
}

// h (T, H) float32, attn (T, Hq * D) float32 (the attention output) -> the layer's output
// h + a + m(h + a): a = o_proj(attn), m(x) = down(act(gate) * up) of mlp_norm(x), act SiLU or
// (`gelu`) tanh-approximated GELU; with Gemma's sandwich norms (attn_out_norm, mlp_out_norm
// not empty) a and m's output are RMS-normed by them before their residual adds.
at::Tensor post_attention(const at::Tensor& h, const at::Tensor& attn, const LinearArg& o_arg,
                          const at::Tensor& mlp_norm, double eps, const LinearArg& gate_up_arg,
                          const LinearArg& down_arg, const at::Tensor& attn_out_norm,
                          const at::Tensor& mlp_out_norm, bool gelu) {
  check_f32(h, 2, "h");
  TORCH_CHECK(attn.scalar_type() == at::kFloat && attn.dim() == 2, "attn: (T, Hq * D) float32 expected");
  TORCH_CHECK(attn_out_norm.numel() == mlp_out_norm.numel(), "sandwich norms: both or neither");
  const bool sandwich = attn_out_norm.numel() > 0;
  at::Tensor a = apply(qlinear_arg(o_arg), attn.contiguous());
  at::Tensor h1 = (sandwich ? rms_norm_f32(a, attn_out_norm, eps) : a).add_(h);
  const QLinear gate_up = qlinear_arg(gate_up_arg), down = qlinear_arg(down_arg);
  // The MLP a block of rows at a time: its activations are a prefill step's largest (64 MB
  // of gate/up at 1,024 rows of the 1B shape), and a row's bits do not depend on the rows
  // beside it; each block reads the weights once more (~1 % of a prefill).
  for (int64_t r0 = 0; r0 < h1.size(0); r0 += kMlpRows) {
    at::Tensor rows = h1.narrow(0, r0, std::min(kMlpRows, h1.size(0) - r0));
    const at::Tensor gu = apply(gate_up, rms_norm_f32(rows, mlp_norm, eps));
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor gate = gu.narrow(1, 0, inter);
    const at::Tensor act = (gelu ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(gu.narrow(1, inter, inter));
    const at::Tensor m = apply(down, act);
    rows.add_(sandwich ? rms_norm_f32(m, mlp_out_norm, eps) : m);
  }
  return h1;
}

// ------------------------------------------------------------------ mixture of experts
//
// A MoE layer's selected experts in one call (radixserve/models/moe.py, QuantExperts): the
// (token, slot) rows grouped by expert, in expert order (a counting sort: the stable argsort
// of the ids), every selected expert's gate/up over its rows in ONE parallel loop over all
// their weight rows (plus its bias row, gpt-oss), SwiGLU (or gpt-oss's clamped SwiGLU, the
// ATen ops of moe.clamped_swiglu), every down the same way, then each row weighted and
// summed over its token's slots by the ATen ops of moe.grouped_experts. An expert's rows get
// the kernel QuantLinear picks for that many rows, so the result is grouped_experts over
// per-expert QuantLinears, bit for bit, in two loops instead of two calls per expert.

namespace {

// One projection of every expert: per part its blocks (E, N, row bytes), format code and
// small_m (QuantExperts.native_arg).
using StackArg = std::tuple<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>>;
// A layer's experts (QuantExperts.native_arg): gate/up and down stacks, their float32 biases
// (E, 2I) and (E, hidden) or none, and the clamped SwiGLU's alpha and limit (alpha 0: SwiGLU).
using ExpertsArg = std::tuple<StackArg, StackArg, std::optional<at::Tensor>, std::optional<at::Tensor>, double, double>;

// The experts of a stack (the first part's E), checked against every part's; stacks of one
// call must agree on it.
int64_t stack_experts(const StackArg& s, const char* name) {
  const auto& [w, fmt, small_m] = s;
  TORCH_CHECK(!w.empty() && fmt.size() == w.size() && small_m.size() == w.size(), name,
              ": blocks, a format and small_m per part expected");
  for (const at::Tensor& part : w) {
    TORCH_CHECK(part.dim() == 3 && part.is_contiguous() && part.size(0) == w[0].size(0), name,
                ": contiguous (E, N, row bytes) parts of one E expected, got ", part.sizes());
  }
  return w[0].size(0);
}

// A stack's output rows N, summed over its parts (one expert's projection's out_features).
int64_t stack_rows(const StackArg& s) {
  int64_t n = 0;
  for (const at::Tensor& part : std::get<0>(s)) n += part.size(1);
  return n;
}

// Expert e's projection: a view of each stacked part.
QLinear expert_linear(const StackArg& s, int64_t e) {
  QLinear l{{}, std::get<1>(s), std::get<2>(s), std::nullopt};
  for (const at::Tensor& part : std::get<0>(s)) l.w.push_back(part.select(0, e));
  return l;
}

// y rows [start[e], start[e + 1]) = x's rows there @ projection e's parts.T for each e with
// rows: the experts whose rows fit the small kernels in one loop, the others one by one.
void per_expert(const StackArg& s, const std::vector<int64_t>& start, const at::Tensor& x, at::Tensor& y) {
  const int64_t experts = static_cast<int64_t>(start.size()) - 1;
  std::vector<QLinear> linears;
  linears.reserve(experts);  // the jobs point into it
  std::vector<SmallJob> jobs;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = start[e], n = start[e + 1] - r0;
    if (n == 0) continue;
    linears.push_back(expert_linear(s, e));
    const at::Tensor rows = x.narrow(0, r0, n);
    if (fits_small(linears.back(), n)) jobs.push_back({&linears.back(), rows, y.data_ptr<float>() + r0 * y.size(1), y.size(1)});
    else y.narrow(0, r0, n).copy_(apply(linears.back(), rows));
  }
  run_jobs(jobs);
}

// y rows [start[e], start[e + 1]) += bias row e, for each e with rows (Experts.forward's
// `h + bias[e]`: one float32 add a value).
void add_bias_rows(const std::optional<at::Tensor>& bias, const std::vector<int64_t>& start, at::Tensor& y,
                   const char* name) {
  if (!bias) return;
  const int64_t experts = static_cast<int64_t>(start.size()) - 1;
  check_f32(*bias, 2, name);
  TORCH_CHECK(bias->size(0) == experts && bias->size(1) == y.size(1), name, ": (E, ", y.size(1),
              ") expected, got ", bias->sizes());
  for (int64_t e = 0; e < experts; ++e) {
    if (start[e + 1] > start[e]) y.narrow(0, start[e], start[e + 1] - start[e]).add_(bias->select(0, e));
  }
}

// gate/up (n, 2I) -> (n, I): SiLU(gate) * up, or with alpha > 0 gpt-oss's clamped SwiGLU
// (up' + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up' = clamp(up, -limit, limit),
// in moe.clamped_swiglu's ops and order.
at::Tensor expert_act(const at::Tensor& gu, double alpha, double limit) {
  const int64_t inter = gu.size(1) / 2;
  const at::Tensor gate = gu.narrow(1, 0, inter), up = gu.narrow(1, inter, inter);
  if (alpha <= 0) return at::silu(gate).mul_(up);
  const at::Tensor g = gate.clamp_max(limit);
  return up.clamp(-limit, limit).add(1).mul(g.mul(at::sigmoid(g.mul(alpha))));
}

}  // namespace

// x (T, H) float32, ids (T, k) int64 expert ids, weights (T, k) float32 -> (T, H) float32:
// each token's sum over its k slots of weight * down[e](act(gate[e] x, up[e] x)) (with
// biases: each product plus expert e's bias row).
at::Tensor experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const ExpertsArg& arg) {
  const auto& [gate_up, down, gate_up_bias, down_bias, alpha, limit] = arg;
  check_f32(x, 2, "x");
  const int64_t t = x.size(0), hidden = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.size(0) == t,
              "ids: (T, k) int64 expected, got ", ids.sizes(), " ", ids.scalar_type());
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "weights: float32 of the ids' shape expected, got ", weights.sizes(), " ", weights.scalar_type());
  const int64_t k = ids.size(1), rows = t * k;
  const int64_t experts = stack_experts(gate_up, "gate_up");
  TORCH_CHECK(stack_experts(down, "down") == experts, "gate_up and down: stacks of one E expected");
  const at::Tensor flat = ids.contiguous().view({rows});
  const int64_t* id = flat.data_ptr<int64_t>();
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < experts, "expert id ", id[r], " out of range [0, ", experts, ")");
    ++start[id[r] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  at::Tensor order = at::empty({rows}, flat.options());  // sorted row i is (token, slot) row order[i]
  at::Tensor xs = at::empty({rows, hidden}, x.options());  // its token's x
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  int64_t* sorted = order.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = next[id[r]]++;
    sorted[i] = r;
    std::memcpy(xsp + i * hidden, xp + r / k * hidden, hidden * sizeof(float));
  }
  at::Tensor gu = at::empty({rows, stack_rows(gate_up)}, x.options());
  per_expert(gate_up, start, xs, gu);
  add_bias_rows(gate_up_bias, start, gu, "gate_up_bias");
  const at::Tensor act = expert_act(gu, alpha, limit);
  at::Tensor out = at::empty({rows, stack_rows(down)}, x.options());
  TORCH_CHECK(out.size(1) == hidden, "down's rows ", out.size(1), " != hidden ", hidden);
  per_expert(down, start, act, out);
  add_bias_rows(down_bias, start, out, "down_bias");
  const at::Tensor weighted = out.mul(weights.reshape({rows}).index_select(0, order).unsqueeze(-1));
  at::Tensor by_slot = at::empty_like(weighted);
  by_slot.index_copy_(0, order, weighted);  // back in (token, slot) order
  return by_slot.view({t, k, hidden}).sum(1);
}

// h (T, H) float32, attn (T, Hq * D) float32 -> h + a + moe(mlp_norm(h + a)), a =
// o_proj(attn): a mixture-of-experts layer's post_attention. The router is a float32 (E, H)
// linear (with its bias, if any); routing is moe.route's ops (softmax in float32 then top-k,
// renormalised or not; or, topk_softmax, top-k of the logits then their softmax), and the
// selected experts run in `experts`.
at::Tensor post_attention_moe(const at::Tensor& h, const at::Tensor& attn, const LinearArg& o_arg,
                              const at::Tensor& mlp_norm, double eps, const at::Tensor& router,
                              const std::optional<at::Tensor>& router_bias, int64_t top_k, bool renormalise,
                              bool topk_softmax, const ExpertsArg& experts_arg) {
  check_f32(h, 2, "h");
  TORCH_CHECK(attn.scalar_type() == at::kFloat && attn.dim() == 2, "attn: (T, Hq * D) float32 expected");
  check_f32(router, 2, "router");
  at::Tensor h1 = apply(qlinear_arg(o_arg), attn.contiguous()).add_(h);
  const at::Tensor x = rms_norm_f32(h1, mlp_norm, eps);
  const at::Tensor logits = at::linear(x, router, router_bias);  // (T, E)
  at::Tensor weights, ids;
  if (topk_softmax) {
    at::Tensor top;
    std::tie(top, ids) = at::topk(logits, top_k, -1);
    weights = at::softmax(top, -1, at::kFloat);
  } else {
    std::tie(weights, ids) = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
    if (renormalise) weights = weights.div(weights.sum(-1, true));
  }
  return h1.add_(experts(x, ids, weights, experts_arg));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul_small", &qmatmul_small, "x @ dequant(w).T, decode-sized M");
  m.def("qmatmul_tiled", &qmatmul_tiled, "x @ dequant(w).T, tiles dequantized into sgemm");
  m.def("qmatmul_gemm", &qmatmul_gemm, "x @ dequant(w).T, x rounded to int16, int16 GEMM");
#ifdef RS_AVX2
  m.attr("int_gemm") = true;
#else
  m.attr("int_gemm") = false;
#endif
#ifdef RS_VNNI
  m.attr("vnni") = true;
#else
  m.attr("vnni") = false;
#endif
#ifdef RS_AVX2
  m.attr("packs") = true;
#else
  m.attr("packs") = false;
#endif
  m.def("pack", &pack, "a Q4_K, Q6_K or MXFP4 weight as packed tiles (8 or 16 rows), into out");
  m.def("dequant", &dequant, "rows of a block-quantized weight as float32");
  m.def("qlinear", &qlinear, "x @ W.T + bias for a quantized linear of one or more parts");
  m.def("pre_attention", &pre_attention, "RMSNorm, quantized qkv projection and RoPE of a decoder layer");
  m.def("post_attention", &post_attention, "o_proj, residual, RMSNorm, quantized gated MLP, residual");
  m.def("experts", &experts, "a mixture of experts' selected quantized experts, weighted and summed");
  m.def("post_attention_moe", &post_attention_moe, "o_proj, residual, RMSNorm, router, selected experts, residual");
}
