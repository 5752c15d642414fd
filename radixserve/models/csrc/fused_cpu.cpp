// Fused bf16 CPU ops for the decoder (radixserve/models/native.py): RMSNorm and RoPE, each
// one call with the rounding of the torch formula it replaces, instead of a chain of small ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kGrainRows = 16;  // rows per parallel task: decode batches stay on one thread

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensor expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": bfloat16 expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": (rows, cols) with unit column stride expected");
}

}  // namespace

// weight * bf16(x * rsqrt(mean(x^2) + eps)), mean over the last dim in float32: HF's
// LlamaRMSNorm on bf16 rows. x (T, H) any row stride, weight (H,) -> new (T, H) contiguous.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm weight: contiguous bfloat16 (", x.size(1), ",) expected");
  const int64_t rows = x.size(0), h = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, h}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* xr = xp + r * stride;
      bf16* orow = op + r * h;
      float sum = 0.f;
      for (int64_t i = 0; i < h; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + epsf);
      for (int64_t i = 0; i < h; ++i) {
        const bf16 normed = static_cast<bf16>(static_cast<float>(xr[i]) * inv);
        orow[i] = static_cast<bf16>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
  return out;
}

// Rotate-half RoPE of the q and k heads of a fused qkv projection, HF's rounding:
// bf16(bf16(x * cos) + bf16(swap(x) * sin)) with swap(x) = [x2 | x1] and the table rows
// [cos | cos], [-sin | sin]. qkv (T, >= (Hq + Hkv) * D) any row stride, table (T, 2, D)
// contiguous -> q (T, Hq, D) and k (T, Hkv, D), new and contiguous.
std::vector<torch::Tensor> rope_qk(const torch::Tensor& qkv, const torch::Tensor& table,
                                   int64_t q_heads, int64_t kv_heads) {
  check_rows(qkv, "rope_qk qkv");
  TORCH_CHECK(table.scalar_type() == at::kBFloat16 && table.is_contiguous() && table.dim() == 3 &&
                  table.size(0) == qkv.size(0) && table.size(1) == 2,
              "rope_qk table: contiguous bfloat16 (T, 2, D) expected");
  const int64_t rows = qkv.size(0), d = table.size(2), half = d / 2, stride = qkv.stride(0);
  TORCH_CHECK(d % 2 == 0 && (q_heads + kv_heads) * d <= qkv.size(1),
              "rope_qk: qkv has too few columns for the heads");
  auto q = torch::empty({rows, q_heads, d}, qkv.options());
  auto k = torch::empty({rows, kv_heads, d}, qkv.options());
  const bf16* xp = qkv.data_ptr<bf16>();
  const bf16* tp = table.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  bf16* kp = k.data_ptr<bf16>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* cos = tp + r * 2 * d;
      const bf16* sin = cos + d;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        const bf16* x = xp + r * stride + h * d;
        bf16* o = h < q_heads ? qp + (r * q_heads + h) * d : kp + (r * kv_heads + h - q_heads) * d;
        for (int64_t j = 0; j < d; ++j) {
          const float sw = static_cast<float>(x[j < half ? j + half : j - half]);
          const bf16 a = static_cast<bf16>(static_cast<float>(x[j]) * static_cast<float>(cos[j]));
          const bf16 b = static_cast<bf16>(sw * static_cast<float>(sin[j]));
          o[j] = static_cast<bf16>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
    }
  });
  return {q, k};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "HF RMSNorm on bf16 rows (T, H)");
  m.def("rope_qk", &rope_qk, "rotate-half RoPE of the q and k heads of a bf16 qkv projection");
}
