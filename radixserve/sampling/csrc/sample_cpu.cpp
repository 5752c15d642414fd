// Temperature sampling fused into one pass per row (`_native` in sampler.py): the
// softmax's exponentials are drawn from by inverse CDF without the (B, V) probability and
// cumulative-sum tensors of the torch formula, whose passes over a 49152-token vocabulary
// cost more than the arithmetic. Vectors are ATen's (AVX2 in the AVX2 build, plain C++ in
// the portable one), exp is its Sleef exp (1 ulp).
#if defined(RS_AVX2)
#define CPU_CAPABILITY_AVX2
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kScanBlock = 64;  // weights summed per block: the scan skips whole blocks

float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}
float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Inverse-CDF draw from softmax(l / t) over one row l[0..n): the first index whose
// cumulative weight exceeds u * (total weight), with weights w_j = exp((l_j - max l) / t)
// kept in `w` and their sums per block of kScanBlock in `sums`. The row must have a finite
// maximum (the caller checks). The total is the sum of the block sums in order, and the
// scan adds the same block sums in the same order until the target falls inside a block,
// then that block's weights one by one; only an index with w_j > 0 can be returned (the
// cumulative sum only grows there).
int64_t draw_row(const float* l, int64_t n, float t, double u, std::vector<float>& w, std::vector<float>& sums) {
  w.resize(n), sums.resize((n + kScanBlock - 1) / kScanBlock);
  Vec vmax(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kW <= n; j += kW) vmax = at::vec::maximum(vmax, Vec::loadu(l + j));
  float mx = reduce_max(vmax);
  for (; j < n; ++j) mx = std::max(mx, l[j]);
  const float inv = 1.f / t;
  const Vec vm(mx), vinv(inv);
  float total = 0.f;
  for (int64_t b = 0; b < n; b += kScanBlock) {
    const int64_t e = std::min(n, b + kScanBlock);
    Vec acc(0.f);
    for (j = b; j + kW <= e; j += kW) {
      const Vec x = ((Vec::loadu(l + j) - vm) * vinv).exp();
      x.store(w.data() + j);
      acc = acc + x;
    }
    float sum = reduce_sum(acc);
    for (; j < e; ++j) sum += (w[j] = std::exp((l[j] - mx) * inv));
    total += (sums[b / kScanBlock] = sum);
  }
  const float target = static_cast<float>(u * static_cast<double>(total));
  float run = 0.f;
  for (int64_t b = 0; b < n; b += kScanBlock) {
    if (run + sums[b / kScanBlock] <= target) {
      run += sums[b / kScanBlock];
      continue;
    }
    for (j = b; j < std::min(n, b + kScanBlock); ++j) {
      run += w[j];
      if (run > target) return j;
    }  // rounding left the target just past this block's weights: on to the next block
  }
  // The target rounded up to the scan's total (probability ~1e-7): the last kept token.
  for (j = n - 1; j > 0 && w[j] == 0.f;) --j;
  return j;
}

}  // namespace

// logits (S, V) float32 with unit column stride, temperatures (S,) float32 > 0, uniforms
// (S,) float64 in [0, 1) -> token ids (S,) int64 drawn from softmax(logits / t).
torch::Tensor sample_softmax(const torch::Tensor& logits, const torch::Tensor& temps, const torch::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "logits: float32 (S, V) on CPU with unit column stride expected");
  const int64_t s = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "logits: empty vocabulary");
  const torch::Tensor t = temps.to(at::kFloat).contiguous(), uu = u.to(at::kDouble).contiguous();
  TORCH_CHECK(t.numel() == s && uu.numel() == s, "one temperature and one uniform per row expected");
  torch::Tensor out = torch::empty({s}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const double* up = uu.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, s, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, sums;
    for (int64_t r = begin; r < end; ++r) op[r] = draw_row(lp + r * logits.stride(0), n, tp[r], up[r], w, sums);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_softmax", &sample_softmax, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "token ids drawn by inverse CDF from softmax(logits / t), one uniform per row");
}
