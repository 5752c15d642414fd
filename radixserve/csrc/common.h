// What the native CPU sources share (attention_cpu.cpp, fused_cpu.cpp, quant_cpu.cpp,
// sample_cpu.cpp, each built per ISA as one module by native_build.py): the ISA macros,
// the ATen and pybind headers, the row loops of the decoder (rows.h) and the small helpers
// that more than one source uses. A change here rebuilds every module (native_build hashes
// the headers).
#pragma once

// The ISA macros, from the target the compiler was given (native_build.VECTOR_FLAGS):
//   RS_AVX2    AVX2, FMA and F16C: the 8-lane vector paths
//   RS_AVX512  RS_AVX2 and AVX-512F/BW/VL/DQ
//   RS_VNNI    RS_AVX512 and AVX512-VNNI
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RS_AVX2 1
#endif
#if defined(RS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define RS_AVX512 1
#endif
#if defined(RS_AVX512) && defined(__AVX512VNNI__)
#define RS_VNNI 1
#endif
// A source that uses ATen's vectors (at::vec) defines RS_ATEN_VEC before it includes this
// header: they then take their AVX2 form in every vector build (8 float lanes in the AVX-512
// build too). CPU_CAPABILITY_AVX2 has to precede the first ATen header, and it also moves
// c10::Half's conversions to F16C, so the other sources leave it undefined.
#if defined(RS_AVX2) && defined(RS_ATEN_VEC)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(RS_AVX2)
#include <immintrin.h>
#endif

#include "rows.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// m.def(name, f, NoGil(), ...): f runs without holding the GIL.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

// x: (rows, cols) on the CPU with unit column stride, float32 (or, where bf16_ok, bfloat16).
inline void check_rows(const at::Tensor& x, const char* name, bool bf16_ok) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensor expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || (bf16_ok && x.scalar_type() == at::kBFloat16), name, ": ",
              bf16_ok ? "bfloat16 or float32" : "float32", " expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": (rows, cols) with unit column stride expected");
}

#if defined(RS_AVX2)
// 8 stored values <-> 8 float lanes: bf16 -> float is a 16-bit shift, fp16 -> float F16C's
// conversion; float -> bf16 rounds to nearest even, as torch converts any value but NaN.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
inline void store8(at::BFloat16* dst, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

// The sum and the maximum of the 8 lanes: the two halves, then lanes 0-1 with 2-3, then 0 with 1.
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
#endif

}  // namespace
