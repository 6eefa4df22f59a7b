// Causal attention of one sequence's new queries over its keys, on the CPU, float32 (cpu_prefill_attention.py
// says why): flash-style, a block of query rows at a time over blocks of 32 keys, each block's scores and its values
// products computed in registers, an online softmax between them, and no block past a row block's last position
// computed at all. Built once per machine for the host's vector unit and called as
// torch.ops.expertmesh_prefill.causal_attention.
//
// Shapes: H query heads, h key/value heads (G = H / h query heads share one), n queries at positions L - n ..
// L - 1, L keys at positions 0 .. L - 1, d the key width, dv the value width (a multiple of 32).
//   query  [1, H, n, d]   float32, its last dimension contiguous
//   keys   [1, h, L, d]   float32, its last dimension contiguous
//   values [1, h, L, dv]  float32, its last dimension contiguous
//   out    [1, n, H, dv]  softmax(scale * q . k) . v over the keys at or before each query's position
//
// Work: items of (key head, block of 16 query positions), each with its G heads' rows together (they read the same
// keys), shared out over torch's intra-op threads in an order that pairs long items with short ones. A row's result
// depends on its query, the keys it sees and the fixed blocks of 32 keys from position 0 only: the same bits alone,
// batched, or as the later chunk of a longer prompt.

#if defined(__AVX512F__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
constexpr int64_t BK = 32;      // keys a block: the width of a block's scores and of a values tile
constexpr int64_t CV = BK / VS;  // vectors a block row
constexpr int64_t BQ = 32;      // query positions an item
// rows a register block (MR x CV accumulators): 8 x 2 of 32 registers with AVX-512, 3 x 4 of 16 with AVX2
#if defined(__AVX512F__)
constexpr int MR = 8;
#elif defined(__AVX2__)
constexpr int MR = 3;
#else
constexpr int MR = 1;
#endif

// y[m, 0 .. BK) (+)= sum over k < K of x[m * ldx + k] * t[k * BK + 0 .. BK), for m < M
template <int M, bool ACC>
inline void tile_block(const float* x, int64_t ldx, int64_t K, const float* t, float* y, int64_t ldy) {
  Vec acc[M][CV];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < CV; ++c) acc[m][c] = ACC ? Vec::loadu(y + m * ldy + c * VS) : Vec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    for (int c = 0; c < CV; ++c) {
      const Vec w = Vec::loadu(t + k * BK + c * VS);
      for (int m = 0; m < M; ++m) acc[m][c] = at::vec::fmadd(Vec(x[m * ldx + k]), w, acc[m][c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < CV; ++c) acc[m][c].store(y + m * ldy + c * VS);
}

template <int M, bool ACC>
inline void tile_tail(int64_t rest, const float* x, int64_t ldx, int64_t K, const float* t, float* y, int64_t ldy) {
  if constexpr (M > 0) {
    if (rest == M) return tile_block<M, ACC>(x, ldx, K, t, y, ldy);
    tile_tail<M - 1, ACC>(rest, x, ldx, K, t, y, ldy);
  }
}

// rows of x [rows, K] (row stride ldx) through a tile t [K, BK] into y [rows, BK] (row stride ldy)
template <bool ACC>
void tile_rows(const float* x, int64_t ldx, int64_t rows, int64_t K, const float* t, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) tile_block<MR, ACC>(x + r * ldx, ldx, K, t, y + r * ldy, ldy);
  tile_tail<MR - 1, ACC>(rows - r, x + r * ldx, ldx, K, t, y + r * ldy, ldy);
}

struct Layout {
  const float* q;
  const float* k;
  const float* v;
  int64_t q_head, q_row, k_head, k_row, v_head, v_row;  // strides, in floats
  int64_t H, G, n, L, d, dv;
  float scale;
  float* out;  // [n, H, dv]
};

// One item: key head g, query positions i0 .. i0 + nq - 1 (of n), the G heads' rows together.
void item(const Layout& a, int64_t g, int64_t i0, int64_t nq) {
  const int64_t R = a.G * nq, d = a.d, dv = a.dv, offset = a.L - a.n;
  std::vector<float> qb(R * d), kt(d * BK), vt(BK * dv), s(R * BK), o(R * dv, 0.f), m(R), l(R, 0.f);
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  for (int64_t hh = 0; hh < a.G; ++hh)  // row r = hh * nq + i: head g * G + hh, position offset + i0 + i
    for (int64_t i = 0; i < nq; ++i) {
      const float* src = a.q + (g * a.G + hh) * a.q_head + (i0 + i) * a.q_row;
      float* dst = qb.data() + (hh * nq + i) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = src[c] * a.scale;
    }
  const int64_t last = offset + i0 + nq - 1;  // the item's last position: no key past it is read
  for (int64_t j0 = 0; j0 <= last; j0 += BK) {
    const int64_t kb = std::min(BK, last + 1 - j0);
    // the block's keys transposed [d, BK] and its values in tiles of BK columns [dv / BK, BK, BK], zero past kb
    for (int64_t c = 0; c < d; ++c) {
      float* row = kt.data() + c * BK;
      for (int64_t j = 0; j < kb; ++j) row[j] = a.k[g * a.k_head + (j0 + j) * a.k_row + c];
      std::fill(row + kb, row + BK, 0.f);
    }
    for (int64_t j = 0; j < BK; ++j)
      for (int64_t t = 0; t < dv / BK; ++t) {
        float* dst = vt.data() + (t * BK + j) * BK;
        if (j < kb) {
          std::copy_n(a.v + g * a.v_head + (j0 + j) * a.v_row + t * BK, BK, dst);
        } else {
          std::fill(dst, dst + BK, 0.f);
        }
      }
    tile_rows<false>(qb.data(), d, R, d, kt.data(), s.data(), BK);  // scores [R, BK]
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s.data() + r * BK;
      const int64_t seen = std::min(kb, offset + i0 + r % nq - j0 + 1);  // keys of the block this row sees
      if (seen <= 0) {  // none: its probabilities are all zero, its sums unchanged
        std::fill(sr, sr + BK, 0.f);
        continue;
      }
      float top = m[r];
      for (int64_t j = 0; j < seen; ++j) top = std::max(top, sr[j]);
      const float corr = std::exp(m[r] - top);  // 0 at the first block (m = -inf)
      m[r] = top;
      const Vec topv(top);
      Vec sums(0.f);
      for (int64_t j = seen; j < BK; ++j) sr[j] = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < CV; ++c) {
        const Vec p = (Vec::loadu(sr + c * VS) - topv).exp();
        p.store(sr + c * VS);
        sums = sums + p;
      }
      l[r] = l[r] * corr + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sums);
      if (corr != 1.f) {
        float* orow = o.data() + r * dv;
        for (int64_t c = 0; c < dv; ++c) orow[c] *= corr;
      }
    }
    for (int64_t t = 0; t < dv / BK; ++t)  // o += p . v, a tile of BK value columns at a time
      tile_rows<true>(s.data(), BK, R, BK, vt.data() + t * BK * BK, o.data() + t * BK, dv);
  }
  for (int64_t hh = 0; hh < a.G; ++hh)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = hh * nq + i;
      const float inv = 1.f / l[r];
      const float* src = o.data() + r * dv;
      float* dst = a.out + ((i0 + i) * a.H + g * a.G + hh) * dv;
      for (int64_t c = 0; c < dv; ++c) dst[c] = src[c] * inv;
    }
}

at::Tensor causal_attention(const at::Tensor& query_in, const at::Tensor& keys_in, const at::Tensor& values_in,
                            double scale) {
  TORCH_CHECK(query_in.scalar_type() == at::kFloat && keys_in.scalar_type() == at::kFloat &&
                  values_in.scalar_type() == at::kFloat,
              "causal_attention: float32 queries, keys and values");
  TORCH_CHECK(query_in.dim() == 4 && keys_in.dim() == 4 && values_in.dim() == 4 && query_in.size(0) == 1 &&
                  keys_in.size(0) == 1 && values_in.size(0) == 1,
              "causal_attention: query [1, H, n, d], keys [1, h, L, d], values [1, h, L, dv]");
  const at::Tensor q = query_in.stride(3) == 1 ? query_in : query_in.contiguous();
  const at::Tensor k = keys_in.stride(3) == 1 ? keys_in : keys_in.contiguous();
  const at::Tensor v = values_in.stride(3) == 1 ? values_in : values_in.contiguous();
  const int64_t H = q.size(1), n = q.size(2), d = q.size(3), h = k.size(1), L = k.size(2), dv = v.size(3);
  TORCH_CHECK(h > 0 && H % h == 0, "causal_attention: query heads a multiple of key heads");
  TORCH_CHECK(k.size(3) == d && v.size(1) == h && v.size(2) == L, "causal_attention: keys and values agree");
  TORCH_CHECK(n <= L, "causal_attention: no more queries than keys");
  TORCH_CHECK(dv % BK == 0, "causal_attention: values a multiple of 32 wide");
  auto out = at::empty({1, n, H, dv}, q.options());
  if (n == 0) return out;
  const Layout a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(1), q.stride(2),
                 k.stride(1), k.stride(2), v.stride(1), v.stride(2), H, H / h, n, L, d, dv,
                 static_cast<float>(scale), out.data_ptr<float>()};
  // items: per key head, the query blocks paired longest with shortest (0, last, 1, last - 1, ...), so any
  // contiguous share of them holds about as much of the triangle as any other
  const int64_t blocks = (n + BQ - 1) / BQ;
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t g = 0; g < h; ++g)
    for (int64_t b = 0; b < blocks; ++b) items.emplace_back(g, b % 2 == 0 ? b / 2 : blocks - 1 - b / 2);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t i0 = items[x].second * BQ;
      item(a, items[x].first, i0, std::min(BQ, n - i0));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(expertmesh_prefill, m) {
  m.def("causal_attention(Tensor query, Tensor keys, Tensor values, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(expertmesh_prefill, CPU, m) { m.impl("causal_attention", &causal_attention); }
