// Row loops of the decoder used by the fused ops (fused_cpu.cpp, bf16 or float32) and the
// quantized decoder-layer halves (quant_cpu.cpp, float32): HF's LlamaRMSNorm and rotate-half
// RoPE with the rounding of the torch formulas they replace (for float32 every cast is the
// identity). Every source gets them through common.h; a change here rebuilds every module
// (native_build hashes the headers).
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace rowops {

constexpr int64_t kGrainRows = 16;  // rows per parallel task: decode batches stay on one thread

// weight * T(x * rsqrt(mean(x^2) + eps)), mean over the last dim in float32: LlamaRMSNorm on
// `rows` rows of T (row stride `stride`) into out (rows, h).
template <typename T>
void rms_norm(const T* xp, int64_t stride, const T* wp, int64_t rows, int64_t h, float eps, T* op) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * stride;
      T* orow = op + r * h;
      float sum = 0.f;
      for (int64_t i = 0; i < h; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
      for (int64_t i = 0; i < h; ++i) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);
        orow[i] = static_cast<T>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
}

// Rotate-half RoPE of the first q_heads + kv_heads heads (head dim d) of each row of x (row
// stride `stride`) on the first r <= d dims of each head (the rest copied: partial rotary),
// table rows (2, r) per row: [cos | cos], [-sin | sin]; HF's rounding
// T(T(x * cos) + T(swap(x) * sin)), swap(x) = [x2 | x1] within the r dims. Into q (rows,
// q_heads, d) and k (rows, kv_heads, d).
template <typename T>
void rope(const T* xp, int64_t stride, const T* tp, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t d,
          int64_t r, T* qp, T* kp) {
  const int64_t half = r / 2;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* cos = tp + row * 2 * r;
      const T* sin = cos + r;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        const T* x = xp + row * stride + h * d;
        T* o = h < q_heads ? qp + (row * q_heads + h) * d : kp + (row * kv_heads + h - q_heads) * d;
        for (int64_t j = 0; j < r; ++j) {
          const float sw = static_cast<float>(x[j < half ? j + half : j - half]);
          const T a = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j]));
          const T b = static_cast<T>(sw * static_cast<float>(sin[j]));
          o[j] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
        for (int64_t j = r; j < d; ++j) o[j] = x[j];
      }
    }
  });
}

}  // namespace rowops
