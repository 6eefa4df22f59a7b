// out[index[i]] += rows[i] for every i, in order, in one serial pass (row_sums.py says why): each row one add of
// its elements, so the plain loop's bits on any number of threads, repeated indices included.
//
// Shapes: out [T, W] float32 contiguous, index [S] int64, rows [S, W] float32.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

at::Tensor& add_rows(at::Tensor& out, const at::Tensor& index, const at::Tensor& rows_in) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && rows_in.scalar_type() == at::kFloat, "add_rows: float32 rows");
  TORCH_CHECK(out.dim() >= 1 && out.is_contiguous(), "add_rows: out [T, ...] contiguous");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "add_rows: index [S] int64");
  const at::Tensor rows = rows_in.contiguous();
  const at::Tensor idx = index.contiguous();
  const int64_t S = idx.size(0), T = out.size(0);
  TORCH_CHECK(rows.dim() == out.dim() && rows.size(0) == S, "add_rows: rows [S, ...] for an index [S]");
  for (int64_t d = 1; d < out.dim(); ++d) TORCH_CHECK(rows.size(d) == out.size(d), "add_rows: rows as wide as out");
  const int64_t W = T ? out.numel() / T : 0;
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK_INDEX(id[s] >= 0 && id[s] < T, "add_rows: index ", id[s], " out of range for ", T, " rows");
  float* o = out.data_ptr<float>();
  const float* r = rows.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) {
    float* dst = o + id[s] * W;
    const float* src = r + s * W;
    for (int64_t w = 0; w < W; ++w) dst[w] += src[w];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(expertmesh_rows, m) { m.def("add_rows(Tensor(a!) out, Tensor index, Tensor rows) -> Tensor(a!)"); }

TORCH_LIBRARY_IMPL(expertmesh_rows, CPU, m) { m.impl("add_rows", &add_rows); }
