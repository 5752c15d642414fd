// Fused CPU ops for the decoder (radixserve/models/native.py): RMSNorm and RoPE on bf16 or
// float32 rows, each one call with the rounding of the torch formula it replaces, instead of
// a chain of small ops. (For float32 every cast below is the identity.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kGrainRows = 16;  // rows per parallel task: decode batches stay on one thread

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensor expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name,
              ": bfloat16 or float32 expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": (rows, cols) with unit column stride expected");
}

// weight * T(x * rsqrt(mean(x^2) + eps)), mean over the last dim in float32: HF's
// LlamaRMSNorm on rows of T.
template <typename T>
void rms_norm_rows(const T* xp, int64_t stride, const T* wp, int64_t rows, int64_t h, float eps,
                   T* op) {
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

}  // namespace

// x (T, H) any row stride, weight (H,) of x's dtype -> new (T, H) contiguous.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm weight: contiguous (", x.size(1), ",) of x's dtype expected");
  const int64_t rows = x.size(0), h = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, h}, x.options());
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), stride, weight.data_ptr<float>(), rows, h, e,
                  out.data_ptr<float>());
  } else {
    rms_norm_rows(x.data_ptr<bf16>(), stride, weight.data_ptr<bf16>(), rows, h, e,
                  out.data_ptr<bf16>());
  }
  return out;
}

namespace {

// Rotate-half RoPE, HF's rounding: T(T(x * cos) + T(swap(x) * sin)) with swap(x) = [x2 | x1]
// and the table rows [cos | cos], [-sin | sin].
template <typename T>
void rope_rows(const T* xp, int64_t stride, const T* tp, int64_t rows, int64_t q_heads,
               int64_t kv_heads, int64_t d, T* qp, T* kp) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* cos = tp + r * 2 * d;
      const T* sin = cos + d;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        const T* x = xp + r * stride + h * d;
        T* o = h < q_heads ? qp + (r * q_heads + h) * d : kp + (r * kv_heads + h - q_heads) * d;
        for (int64_t j = 0; j < d; ++j) {
          const float sw = static_cast<float>(x[j < half ? j + half : j - half]);
          const T a = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j]));
          const T b = static_cast<T>(sw * static_cast<float>(sin[j]));
          o[j] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
    }
  });
}

}  // namespace

// RoPE of the q and k heads of a fused qkv projection: qkv (T, >= (Hq + Hkv) * D) any row
// stride, table (T, 2, D) contiguous, same dtype -> q (T, Hq, D), k (T, Hkv, D), new, contiguous.
std::vector<torch::Tensor> rope_qk(const torch::Tensor& qkv, const torch::Tensor& table,
                                   int64_t q_heads, int64_t kv_heads) {
  check_rows(qkv, "rope_qk qkv");
  TORCH_CHECK(table.scalar_type() == qkv.scalar_type() && table.is_contiguous() &&
                  table.dim() == 3 && table.size(0) == qkv.size(0) && table.size(1) == 2,
              "rope_qk table: contiguous (T, 2, D) of qkv's dtype expected");
  const int64_t rows = qkv.size(0), d = table.size(2), stride = qkv.stride(0);
  TORCH_CHECK(d % 2 == 0 && (q_heads + kv_heads) * d <= qkv.size(1),
              "rope_qk: qkv has too few columns for the heads");
  auto q = torch::empty({rows, q_heads, d}, qkv.options());
  auto k = torch::empty({rows, kv_heads, d}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rope_rows(qkv.data_ptr<float>(), stride, table.data_ptr<float>(), rows, q_heads, kv_heads, d,
              q.data_ptr<float>(), k.data_ptr<float>());
  } else {
    rope_rows(qkv.data_ptr<bf16>(), stride, table.data_ptr<bf16>(), rows, q_heads, kv_heads, d,
              q.data_ptr<bf16>(), k.data_ptr<bf16>());
  }
  return {q, k};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "HF RMSNorm on bf16 / float32 rows (T, H)");
  m.def("rope_qk", &rope_qk, "rotate-half RoPE of the q and k heads of a fused qkv projection");
}
