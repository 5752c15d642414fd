// Fused bf16 CPU op for the decoder's RMSNorm (radixserve/models/native.py): one call with
// the rounding of the torch formula it replaces, instead of a chain of small ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "HF RMSNorm on bf16 rows (T, H)");
}
