// One call's output rows summed into each expert's statistics (call_statistics.py says what and why): the plain
// loop over the rows in order, in double precision, as the Python reference and torch.bincount add them.
//
// Shapes: local [S] int64 (each row's local expert, < n), weights [S] float32 (its routing weight), norms [S]
// float32 (its output's L2 norm), finite [S] bool or None; returns [n, 5] float64 (rows, non-finite rows, normed
// rows, mean of norm / |weight|, sum of squared deviations), or [0] where finite is None and a norm is not finite.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

at::Tensor call_stats(const at::Tensor& local_in, const at::Tensor& weights_in, const at::Tensor& norms_in,
                      const c10::optional<at::Tensor>& finite_in, int64_t n) {
  TORCH_CHECK(local_in.dim() == 1 && local_in.scalar_type() == at::kLong, "call_stats: local [S] int64");
  const int64_t S = local_in.size(0);
  TORCH_CHECK(weights_in.sizes() == local_in.sizes() && weights_in.scalar_type() == at::kFloat,
              "call_stats: weights [S] float32");
  TORCH_CHECK(norms_in.sizes() == local_in.sizes() && norms_in.scalar_type() == at::kFloat,
              "call_stats: norms [S] float32");
  const at::Tensor local = local_in.contiguous(), weights = weights_in.contiguous(), norms = norms_in.contiguous();
  const int64_t* lp = local.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  const float* np_ = norms.data_ptr<float>();
  at::Tensor finite;
  const bool* fp = nullptr;
  if (finite_in.has_value()) {
    TORCH_CHECK(finite_in->sizes() == local_in.sizes() && finite_in->scalar_type() == at::kBool,
                "call_stats: finite [S] bool");
    finite = finite_in->contiguous();
    fp = finite.data_ptr<bool>();
  } else {
    // A NaN or an Inf in a row makes its norm one too, so finite norms clear every row; a row whose norm is not
    // finite (a bad row, or finite values whose squares overflow) needs its elements checked: the caller's.
    for (int64_t s = 0; s < S; ++s)
      if (!std::isfinite(np_[s])) return at::empty({0}, at::TensorOptions().dtype(at::kDouble));
  }
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(lp[s] >= 0 && lp[s] < n, "call_stats: local expert out of range");
  std::vector<double> count(n, 0.0), bad(n, 0.0), normed(n, 0.0), total(n, 0.0), m2(n, 0.0);
  std::vector<char> usable(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t e = lp[s];
    const bool ok = fp == nullptr || fp[s];
    const double scale = std::fabs(static_cast<double>(wp[s]));
    count[e] += 1.0;
    if (!ok) bad[e] += 1.0;
    usable[s] = ok && scale > 0.0;
    if (usable[s]) {
      normed[e] += 1.0;
      total[e] += static_cast<double>(np_[s]) / scale;
    }
  }
  std::vector<double> mean(n);
  for (int64_t e = 0; e < n; ++e) mean[e] = total[e] / std::max(normed[e], 1.0);
  for (int64_t s = 0; s < S; ++s) {
    if (!usable[s]) continue;
    const int64_t e = lp[s];
    const double deviation = static_cast<double>(np_[s]) / std::fabs(static_cast<double>(wp[s])) - mean[e];
    // rounded before it is added (volatile: no fused multiply-add), as the reference squares and then adds
    const volatile double square = deviation * deviation;
    m2[e] += square;
  }
  at::Tensor out = at::empty({n, 5}, at::TensorOptions().dtype(at::kDouble));
  double* op = out.data_ptr<double>();
  for (int64_t e = 0; e < n; ++e) {
    op[e * 5 + 0] = count[e];
    op[e * 5 + 1] = bad[e];
    op[e * 5 + 2] = normed[e];
    op[e * 5 + 3] = mean[e];
    op[e * 5 + 4] = m2[e];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(expertmesh_stats, m) {
  m.def("call_stats(Tensor local, Tensor weights, Tensor norms, Tensor? finite, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(expertmesh_stats, CPU, m) { m.impl("call_stats", &call_stats); }
