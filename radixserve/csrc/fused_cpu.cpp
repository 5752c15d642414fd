// Fused CPU ops for the decoder (radixserve/models/native.py): RMSNorm and RoPE on bf16 or
// float32 rows (rows.h, through common.h), each one call with the rounding of the torch
// formula it replaces, instead of a chain of small ops.
#include "common.h"

#include <vector>

namespace {

using bf16 = at::BFloat16;

}  // namespace

// x (T, H) any row stride, weight (H,) of x's dtype -> new (T, H) contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x", true);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm weight: contiguous (", x.size(1), ",) of x's dtype expected");
  const int64_t rows = x.size(0), h = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows, h}, x.options());
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rowops::rms_norm(x.data_ptr<float>(), stride, weight.data_ptr<float>(), rows, h, e, out.data_ptr<float>());
  } else {
    rowops::rms_norm(x.data_ptr<bf16>(), stride, weight.data_ptr<bf16>(), rows, h, e, out.data_ptr<bf16>());
  }
  return out;
}

// RoPE of the q and k heads of a fused qkv projection: qkv (T, >= (Hq + Hkv) * D) any row
// stride, table (T, 2, D) contiguous, same dtype -> q (T, Hq, D), k (T, Hkv, D), new, contiguous.
std::vector<at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& table,
                                   int64_t q_heads, int64_t kv_heads) {
  check_rows(qkv, "rope_qk qkv", true);
  TORCH_CHECK(table.scalar_type() == qkv.scalar_type() && table.is_contiguous() &&
                  table.dim() == 3 && table.size(0) == qkv.size(0) && table.size(1) == 2,
              "rope_qk table: contiguous (T, 2, D) of qkv's dtype expected");
  const int64_t rows = qkv.size(0), d = table.size(2), stride = qkv.stride(0);
  TORCH_CHECK(d % 2 == 0 && (q_heads + kv_heads) * d <= qkv.size(1),
              "rope_qk: qkv has too few columns for the heads");
  auto q = at::empty({rows, q_heads, d}, qkv.options());
  auto k = at::empty({rows, kv_heads, d}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rowops::rope(qkv.data_ptr<float>(), stride, table.data_ptr<float>(), rows, q_heads, kv_heads, d, d,
                 q.data_ptr<float>(), k.data_ptr<float>());
  } else {
    rowops::rope(qkv.data_ptr<bf16>(), stride, table.data_ptr<bf16>(), rows, q_heads, kv_heads, d, d,
                 q.data_ptr<bf16>(), k.data_ptr<bf16>());
  }
  return {q, k};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "HF RMSNorm on bf16 / float32 rows (T, H)");
  m.def("rope_qk", &rope_qk, "rotate-half RoPE of the q and k heads of a fused qkv projection");
}
