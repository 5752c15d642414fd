// Temperature sampling fused into one pass per row (`native_ops` in sampler.py): the
// softmax's exponentials are drawn from by inverse CDF without the (B, V) probability and
// cumulative-sum tensors of the torch formula, whose passes over a 49152-token vocabulary
// cost more than the arithmetic; a decode batch's greedy and drawn rows together in one
// pass (`decode_rows`: each row's maximum, then its argmax or its draw). Vectors are ATen's
// (AVX2 in the vector builds, RS_ATEN_VEC in common.h; plain C++ in the portable one), exp
// is its Sleef exp (1 ulp). Also grammar masks applied in place.
#define RS_ATEN_VEC
#include "common.h"

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <tuple>
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

// The maximum of l[0..n), NaN when the row holds one (as torch's amax).
float row_max(const float* l, int64_t n) {
  Vec vmax(kNegInf);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) vmax = at::vec::maximum(vmax, Vec::loadu(l + j));  // NaN stays
  float mx = reduce_max(vmax);
  for (; j < n; ++j)
    if (l[j] > mx || std::isnan(l[j])) mx = l[j];
  return mx;
}

// The first index of l[0..n) holding mx (torch's max(dim).indices); 0 when none does (mx NaN).
int64_t first_index_of(const float* l, int64_t n, float mx) {
  const Vec vm(mx);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const int hits = (Vec::loadu(l + j) != vm).zero_mask();  // bit k: lane k equals mx
    if (hits != 0) return j + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; j < n; ++j)
    if (l[j] == mx) return j;
  return 0;
}

// Inverse-CDF draw from softmax(l / t) over one row l[0..n) whose maximum mx is finite (the
// caller checks): the first index whose cumulative weight exceeds u * (total weight), with
// weights w_j = exp((l_j - mx) / t) kept in `w` and their sums per block of kScanBlock in
// `sums`. The total is the sum of the block sums in order, and the scan adds the same block
// sums in the same order until the target falls inside a block, then that block's weights
// one by one; only an index with w_j > 0 can be returned (the cumulative sum only grows
// there).
int64_t draw_row(const float* l, int64_t n, float mx, float t, double u, std::vector<float>& w,
                 std::vector<float>& sums) {
  w.resize(n), sums.resize((n + kScanBlock - 1) / kScanBlock);
  int64_t j = 0;
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
at::Tensor sample_softmax(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u) {
  check_rows(logits, "logits", false);
  const int64_t s = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "logits: empty vocabulary");
  const at::Tensor t = temps.to(at::kFloat).contiguous(), uu = u.to(at::kDouble).contiguous();
  TORCH_CHECK(t.numel() == s && uu.numel() == s, "one temperature and one uniform per row expected");
  at::Tensor out = at::empty({s}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const double* up = uu.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, s, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, sums;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lp + r * logits.stride(0);
      op[r] = draw_row(row, n, row_max(row, n), tp[r], up[r], w, sums);
    }
  });
  return out;
}

// A decode batch's tokens in one pass per row: logits (B, V) float32 with unit column
// stride, temps (B,) float32 (0: greedy), u (B,) float64 in [0, 1) -> (ids (B,) int64,
// maxima (B,) float32). maxima[r] is row r's maximum as torch's amax gives it (NaN when the
// row holds one); ids[r] is its first maximal index where temps[r] == 0 (torch's
// max(dim).indices), else drawn from softmax(logits / t) as sample_softmax draws it. A row
// without a finite maximum gets id 0: the caller rejects it by its maximum.
std::tuple<at::Tensor, at::Tensor> decode_rows(const at::Tensor& logits, const at::Tensor& temps,
                                                     const at::Tensor& u) {
  check_rows(logits, "logits", false);
  const int64_t b = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "logits: empty vocabulary");
  const at::Tensor t = temps.to(at::kFloat).contiguous(), uu = u.to(at::kDouble).contiguous();
  TORCH_CHECK(t.numel() == b && uu.numel() == b, "one temperature and one uniform per row expected");
  at::Tensor ids = at::empty({b}, logits.options().dtype(at::kLong));
  at::Tensor maxima = at::empty({b}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const double* up = uu.data_ptr<double>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* mp = maxima.data_ptr<float>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, sums;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lp + r * logits.stride(0);
      const float mx = row_max(row, n);
      mp[r] = mx;
      if (tp[r] == 0.f)
        ip[r] = first_index_of(row, n, mx);
      else
        ip[r] = std::isfinite(mx) ? draw_row(row, n, mx, tp[r], up[r], w, sums) : 0;
    }
  });
  return {ids, maxima};
}

// logits (S, V) float32 with unit column stride; row rows[i] gets -inf on every token that
// packed[i] (R, ceil(V / 8)) uint8 does not allow (bit t % 8 of byte t // 8: constrained/
// mask.py), by adding 0 / -inf as mask.py's token_mask_bias does (allowed logits stay
// bit-exact), each mask byte's 8 addends read from a 256-entry table: one 8-float vector
// add per byte, without the (R, V) bias tensor.
void mask_logits_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& packed) {
  check_rows(logits, "logits", false);
  const int64_t n = logits.size(1), width = (n + 7) / 8;
  const at::Tensor r = rows.to(at::kLong).contiguous(), m = packed.contiguous();
  TORCH_CHECK(m.scalar_type() == at::kByte && m.dim() == 2 && m.size(0) == r.numel() && m.size(1) == width,
              "packed: uint8 (R, ceil(V / 8)) expected, one row per entry of rows");
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "row ", rp[i], " outside the logits");
  static const std::vector<float> table = [] {
    std::vector<float> t(256 * 8);
    for (int b = 0; b < 256; ++b)
      for (int k = 0; k < 8; ++k) t[b * 8 + k] = (b >> k & 1) ? 0.f : kNegInf;
    return t;
  }();
  float* lp = logits.data_ptr<float>();
  const uint8_t* mp = m.data_ptr<uint8_t>();
  at::parallel_for(0, r.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * logits.stride(0);
      const uint8_t* bits = mp + i * width;
      const int64_t whole = n / 8;
      for (int64_t w = 0; w < whole; ++w) (Vec::loadu(row + 8 * w) + Vec::loadu(&table[bits[w] * 8], 8)).store(row + 8 * w, 8);
      for (int64_t t = 8 * whole; t < n; ++t) row[t] += table[bits[whole] * 8 + t % 8];
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mask_logits_", &mask_logits_, NoGil(),
        "-inf in place on the tokens each row's packed grammar mask forbids");
  m.def("sample_softmax", &sample_softmax, NoGil(),
        "token ids drawn by inverse CDF from softmax(logits / t), one uniform per row");
  m.def("decode_rows", &decode_rows, NoGil(),
        "each row's maximum, and its token: argmax where t == 0, else drawn as sample_softmax");
}
