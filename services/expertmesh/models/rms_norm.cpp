// A root-mean-square norm of float32 rows in one pass a row (rms_norm.py says why): w * (x * rsqrt(mean(x^2) + eps)),
// each step rounded as the stock module's ATen ops round it, the mean's sum added in the order of ATen's cascade
// sum (SumKernel.cpp's vectorized_inner_sum) over vectors of `lanes` floats, the width its sum kernel runs at.
//
// Shapes: x [..., H] float32 (rows of H), weight [H] float32; out as x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// ATen's CeilLog2 (the levels of its cascade)
int64_t ceil_log2(int64_t n) {
  if (n <= 1) return 0;
  int64_t bits = 0;
  for (int64_t v = n - 1; v > 0; v >>= 1) ++bits;
  return bits;
}

// ATen's row_sum over n vectors of V (multi_row_sum's four levels over rows of four vectors, the rest added to the
// first accumulator, the four accumulators added in order).
template <typename V>
V cascade_vectors(const float* x, int64_t n, int lanes) {
  auto at = [&](int64_t i) {
    V v;
    std::copy(x + i * lanes, x + (i + 1) * lanes, reinterpret_cast<float*>(&v));
    return v;
  };
  constexpr int64_t ilp = 4, levels = 4;
  const int64_t size = n / ilp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels), step = int64_t(1) << power, mask = step - 1;
  V acc[levels][ilp];
  for (auto& level : acc)
    for (auto& a : level) a = V{};
  int64_t i = 0;
  for (; i + step <= size;) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < ilp; ++k) acc[0][k] += at(i * ilp + k);
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = V{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] += at(i * ilp + k);
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] += acc[j][k];
  for (int64_t k = size * ilp; k < n; ++k) acc[0][0] += at(k);
  for (int64_t k = 1; k < ilp; ++k) acc[0][0] += acc[0][k];
  return acc[0][0];
}

// ATen's vectorized_inner_sum of one contiguous row: the vectors' cascade, then 0 plus the scalar tail in order,
// plus each lane of the vector sum in order (a row narrower than a vector: its scalar_inner_sum, the same cascade
// over single floats).
template <typename V>
float inner_sum(const float* x, int64_t n, int lanes) {
  if (n < lanes) return cascade_vectors<float>(x, n, 1);  // narrower than a vector: the scalar cascade
  const int64_t vectors = n / lanes;
  const V acc = vectors > 0 ? cascade_vectors<V>(x, vectors, lanes) : V{};
  float total = 0.0f;
  for (int64_t k = vectors * lanes; k < n; ++k) total += x[k];
  const float* part = reinterpret_cast<const float*>(&acc);
  for (int l = 0; l < lanes; ++l) total += part[l];
  return total;
}

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v16 __attribute__((vector_size(16 * sizeof(float))));

// The squares are written out before they are summed (and the sum is its own function): a multiply-add contracted
// into one rounding would not be the stock module's bits.
__attribute__((noinline)) float sum_of(const float* squares, int64_t n, int lanes) {
  return lanes == 16 ? inner_sum<v16>(squares, n, 16) : inner_sum<v8>(squares, n, 8);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps, int64_t lanes) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat, "rms_norm: float32 rows and weight");
  TORCH_CHECK(x_in.dim() >= 1 && weight_in.dim() == 1 && weight_in.size(0) == x_in.size(-1),
              "rms_norm: x [..., H] and weight [H]");
  TORCH_CHECK(lanes == 8 || lanes == 16, "rms_norm: lanes 8 or 16");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = weight_in.contiguous();
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);  // the scalar as ATen adds it to a float tensor
  const float count = static_cast<float>(H);
  // rows shared out as ATen shares out its elementwise ops' (a grain of 32768 elements)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> squares(H);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * H;
      for (int64_t h = 0; h < H; ++h) squares[h] = row[h] * row[h];
      const float variance = sum_of(squares.data(), H, static_cast<int>(lanes)) / count;
      const float scale = 1.0f / std::sqrt(variance + epsilon);
      float* dst = op + r * H;
      for (int64_t h = 0; h < H; ++h) {
        const float normed = row[h] * scale;
        dst[h] = wp[h] * normed;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(expertmesh_norm, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps, int lanes) -> Tensor"); }

TORCH_LIBRARY_IMPL(expertmesh_norm, CPU, m) { m.impl("rms_norm", &rms_norm); }
