// Matmuls on GGUF block-quantized weights, read in their file layout (no repacking).
//
// A weight (N, K) is stored as N rows of K/32 blocks; each block holds 32 consecutive
// weights of one row:
//   Q4_0 (18 B): fp16 d, uint8 qs[16]           w_j = d * (q_j - 8)
//   Q4_1 (20 B): fp16 d, fp16 m, uint8 qs[16]   w_j = d * q_j + m
//   Q8_0 (34 B): fp16 d, int8 qs[32]            w_j = d * q_j
// where, for the 4-bit formats, q_j = qs[j] & 15 for j < 16 and qs[j - 16] >> 4 otherwise.
//
// Two ways to multiply x (M, K) float32 by such a weight, picked by the caller per call:
// - `qmatmul_small`: dequantize each block into registers once and multiply it with up to
//   kRows rows of x (M small: decode). Reads each weight byte once per kRows rows: the
//   weight-bandwidth-bound case, where the 4-bit layout reads ~5x fewer bytes than fp32.
// - `qmatmul_tiled`: dequantize a tile of kTile weight rows into a per-thread float32
//   buffer (it stays in L2) and run the BLAS sgemm on it (M large: prefill, big batches),
//   so the arithmetic runs at the machine's fp32 matmul rate.
// Both compute in float32 with the exact dequantized weights (only the summation order
// differs from F.linear on the dequantized matrix). Built per ISA: with -mavx2 -mfma
// -mf16c the AVX2 paths below are used, without them plain C++ (portable, slower).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_AVX2 1
#endif

namespace {

enum Format : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 8;    // rows of x per pass over the weights in qmatmul_small
constexpr int64_t kTile = 64;   // weight rows dequantized per sgemm in qmatmul_tiled

int64_t block_bytes(int64_t fmt) {
  TORCH_CHECK(fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0, "unknown quant format ", fmt);
  return fmt == kQ4_0 ? 18 : fmt == kQ4_1 ? 20 : 34;
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

// 32 weights of one block -> out[0..31] float32 (the reference semantics of every path).
void dequant_block_scalar(const uint8_t* b, int64_t fmt, float* out) {
  const float d = half_to_float(b);
  if (fmt == kQ8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) out[j] = d * qs[j];
    return;
  }
  const float m = fmt == kQ4_1 ? half_to_float(b + 2) : -8.0f * d;
  const uint8_t* qs = b + (fmt == kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * (qs[j] & 15) + m;
    out[j + 16] = d * (qs[j] >> 4) + m;
  }
}

#ifdef RS_AVX2
// One block -> w[0..3], 8 weights each (elements 0-7, 8-15, 16-23, 24-31). `fmt` is a
// template constant in the hot loops, so the format branches compile away.
template <int64_t fmt>
inline void dequant_block_avx2(const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_to_float(b));
  if (fmt == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
    return;
  }
  const __m256 m = fmt == kQ4_1 ? _mm256_set1_ps(half_to_float(b + 2))
                                : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (fmt == kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(raw, mask);                     // q_0 .. q_15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // q_16 .. q_31
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), d, m);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Rows [n0, n1) of the weight, all of it dequantized into dst (n1 - n0, K) float32.
void dequant_rows(const uint8_t* w, int64_t fmt, int64_t K, int64_t n0, int64_t n1, float* dst) {
  const int64_t bb = block_bytes(fmt), nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * bb;
    float* out = dst + (n - n0) * K;
    for (int64_t b = 0; b < nb; ++b) {
#ifdef RS_AVX2
      __m256 v[4];
      switch (fmt) {
        case kQ4_0: dequant_block_avx2<kQ4_0>(row + b * bb, v); break;
        case kQ4_1: dequant_block_avx2<kQ4_1>(row + b * bb, v); break;
        default: dequant_block_avx2<kQ8_0>(row + b * bb, v);
      }
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kBlock + 8 * i, v[i]);
#else
      dequant_block_scalar(row + b * bb, fmt, out + b * kBlock);
#endif
    }
  }
}

// out[r * ldo] = dot(x[r], weight row) for r < R: the block is dequantized once for R rows.
// R is a template constant so the accumulators live in registers.
template <int64_t fmt, int R>
void dot_rows(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, float* out,
              int64_t ldo) {
  const int64_t bb = block_bytes(fmt);
#ifdef RS_AVX2
  // A independent accumulators per row: one FMA chain would wait on its 4-cycle latency.
  // (R * A + 4 weight registers must fit the 16 ymm registers.)
  constexpr int A = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    dequant_block_avx2<fmt>(wrow + b * bb, w);
    const float* xb = x + b * kBlock;
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) {
        __m256 xv = _mm256_loadu_ps(xb + r * ldx + 8 * i);
        acc[r][i % A] = _mm256_fmadd_ps(w[i], xv, acc[r][i % A]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 sum = acc[r][0];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[r][a]);
    out[r * ldo] = hsum(sum);
  }
#else
  float acc[R] = {};  // (scalar build)
  float w[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block_scalar(wrow + b * bb, fmt, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * kBlock;
      for (int j = 0; j < kBlock; ++j) acc[r] += w[j] * xr[j];
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
#endif
}

template <int64_t fmt>
void dot_rows(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, int64_t rows,
              float* out, int64_t ldo) {
  switch (rows) {
    case 1: return dot_rows<fmt, 1>(wrow, nb, x, ldx, out, ldo);
    case 2: return dot_rows<fmt, 2>(wrow, nb, x, ldx, out, ldo);
    case 3: return dot_rows<fmt, 3>(wrow, nb, x, ldx, out, ldo);
    case 4: return dot_rows<fmt, 4>(wrow, nb, x, ldx, out, ldo);
    case 5: return dot_rows<fmt, 5>(wrow, nb, x, ldx, out, ldo);
    case 6: return dot_rows<fmt, 6>(wrow, nb, x, ldx, out, ldo);
    case 7: return dot_rows<fmt, 7>(wrow, nb, x, ldx, out, ldo);
    default: return dot_rows<fmt, kRows>(wrow, nb, x, ldx, out, ldo);
  }
}

void dot_rows(const uint8_t* wrow, int64_t fmt, int64_t nb, const float* x, int64_t ldx,
              int64_t rows, float* out, int64_t ldo) {
  switch (fmt) {
    case kQ4_0: return dot_rows<kQ4_0>(wrow, nb, x, ldx, rows, out, ldo);
    case kQ4_1: return dot_rows<kQ4_1>(wrow, nb, x, ldx, rows, out, ldo);
    default: return dot_rows<kQ8_0>(wrow, nb, x, ldx, rows, out, ldo);
  }
}

void check_args(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous (M, K) float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "w must be a contiguous (N, bytes) uint8 tensor, got ", w.sizes());
  TORCH_CHECK(K % kBlock == 0 && x.size(1) == K, "K must be a multiple of 32 and equal x.size(1): K=", K,
              " x ", x.sizes());
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(fmt), "w row bytes ", w.size(1),
              " do not match K=", K, " in format ", fmt);
}

}  // namespace

// x (M, K) float32 @ w(N, K).T -> (M, N) float32; decode-sized M.
at::Tensor qmatmul_small(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K) {
  check_args(x, w, fmt, K);
  const int64_t M = x.size(0), N = w.size(0), nb = K / kBlock, row_bytes = w.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int64_t rows = std::min(kRows, M - r0);
        dot_rows(wp + n * row_bytes, fmt, nb, xp + r0 * K, K, rows, op + r0 * N + n, N);
      }
    }
  });
  return out;
}

// x (M, K) float32 @ w(N, K).T -> (M, N) float32; prefill-sized M.
at::Tensor qmatmul_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K) {
  check_args(x, w, fmt, K);
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tiles = (N + kTile - 1) / kTile;
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);  // thread-local: the caller's mode, on every thread
    at::Tensor buf = at::empty({kTile, K}, x.options());  // this thread's tile, ~L2-sized
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, n1 = std::min(N, n0 + kTile);
      dequant_rows(wp, fmt, K, n0, n1, buf.data_ptr<float>());
      at::Tensor dst = out.narrow(1, n0, n1 - n0);  // (M, tile) strided view: BLAS ldc = N
      at::mm_out(dst, x, buf.narrow(0, 0, n1 - n0).t());
    }
  });
  return out;
}

// Rows `ids` of the weight (e.g. token embeddings) -> (len(ids), K) float32.
at::Tensor dequant(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be 1-D int64");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(fmt), "w row bytes do not match K=", K);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul_small", &qmatmul_small, "x @ dequant(w).T, decode-sized M");
  m.def("qmatmul_tiled", &qmatmul_tiled, "x @ dequant(w).T, tiles dequantized into sgemm");
  m.def("dequant", &dequant, "rows of a block-quantized weight as float32");
}
