// Decode attention over the KV pool in place, on the CPU: one query row per sequence, its keys and values read
// where they lie in the pool, found through the sequence's block table (no list of its slots, no gather into a
// padded copy first; vLLM's CPU paged attention reads its block tables the same way). Built once per machine by
// cpu_paged_decode.py (torch's C++ extension loader, compiled for the host's vector unit) and called as
// torch.ops.expertmesh_cpu.paged_decode.
//
// Shapes: B sequences, H query heads, h key/value heads (H a multiple of h: G = H / h query heads share a key head),
// d the key width, dv the value width, S the pool's slots (a whole number of blocks of `block_size`), M the widest
// block table.
//   query        [B, H, d]   float32, any strides but the last
//   keys         [S, h, d]   float32, the layer's pool (slot-major)
//   values       [S, h, dv]  float32
//   block_tables [B, M]      int64: each sequence's blocks in position order (-1 where it holds none)
//   firsts       [B]         int64: the first position each sequence attends to
//   lengths      [B]         int64: how many positions from there (>= 1); position p lies in slot
//                            block_tables[b, p / block_size] * block_size + p % block_size
//   out          [B, H, dv]  float32: softmax(scale * q . k) . v over each sequence's own positions
//
// Work: the rows' slots walked from their tables first, on the calling thread (one pass, ~1 % of the kernel; walked
// inside each thread's share instead it measured ~5 % slower); then parallel over sequences (torch's intra-op
// threads); a sequence reads each of its slot rows once (every key head of a slot is one contiguous row of the
// slot-major pool), scores in float32, a max-subtracted softmax with Sleef's exp (1 ULP, as ATen's own kernels
// use), the values summed in float32.

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
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kAhead = 4;  // slot rows fetched ahead: a sequence's blocks lie anywhere in the pool

inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(row + i);
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float tail = 0.f;
  if (n >= Vec::size()) {
    Vec acc = Vec::loadu(a) * Vec::loadu(b);
    for (i = Vec::size(); i + Vec::size() <= n; i += Vec::size()) {
      acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
    }
    tail = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  }
  for (; i < n; ++i) tail += a[i] * b[i];
  return tail;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  const Vec pv(p);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    at::vec::fmadd(pv, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  }
  for (; i < n; ++i) y[i] += p * x[i];
}

// scores[0..n) -> exp(scores - max), returning their sum
inline float softmax_numerators(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < n; ++l) m = std::max(m, s[l]);
  const Vec mv(m);
  Vec sums(0.f);
  int64_t l = 0;
  for (; l + Vec::size() <= n; l += Vec::size()) {
    Vec e = (Vec::loadu(s + l) - mv).exp();
    e.store(s + l);
    sums = sums + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sums);
  for (; l < n; ++l) {
    s[l] = std::exp(s[l] - m);
    sum += s[l];
  }
  return sum;
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& tables_in, const at::Tensor& firsts_in, const at::Tensor& lengths_in,
                        int64_t block_size, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3,
              "paged_decode: query [B, H, d], keys [S, h, d], values [S, h, dv]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "paged_decode: float32 only");
  TORCH_CHECK(query.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1,
              "paged_decode: each row's last dimension contiguous");
  TORCH_CHECK(keys.size(2) == query.size(2) && keys.size(0) == values.size(0) && keys.size(1) == values.size(1),
              "paged_decode: keys and values of one pool, keys as wide as the queries");
  TORCH_CHECK(query.size(1) % keys.size(1) == 0, "paged_decode: query heads a multiple of key heads");
  const at::Tensor tables = tables_in.contiguous(), firsts = firsts_in.contiguous(), lengths = lengths_in.contiguous();
  TORCH_CHECK(tables.scalar_type() == at::kLong && firsts.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == query.size(0) &&
                  firsts.numel() == query.size(0) && lengths.numel() == query.size(0),
              "paged_decode: block_tables [B, M], firsts [B] and lengths [B], int64");
  TORCH_CHECK(block_size >= 1 && keys.size(0) % block_size == 0, "paged_decode: a pool of whole blocks");
  const int64_t B = query.size(0), H = query.size(1), d = query.size(2);
  const int64_t h = keys.size(1), dv = values.size(2), G = H / h, M = tables.size(1);
  const int64_t blocks = keys.size(0) / block_size, bs = block_size;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* fp = firsts.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  int64_t widest = 1;
  for (int64_t b = 0; b < B; ++b) {  // every block a sequence reads is in its table and in the pool
    TORCH_CHECK(fp[b] >= 0 && lp[b] >= 1 && (fp[b] + lp[b] - 1) / bs < M,
                "paged_decode: a key range outside its block table");
    for (int64_t j = fp[b] / bs; j <= (fp[b] + lp[b] - 1) / bs; ++j) {
      TORCH_CHECK(tp[b * M + j] >= 0 && tp[b * M + j] < blocks, "paged_decode: a block outside the pool");
    }
    widest = std::max(widest, lp[b]);
  }
  auto out = at::empty({B, H, dv}, query.options());
  const float* qp = query.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t L = widest;
  // every row's attended positions as pool slots, walked block by block from its table (no division per
  // position), read by both passes below
  std::vector<int64_t> all_slots(B * L);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* table = tp + b * M;
    int64_t* row = all_slots.data() + b * L;
    for (int64_t l = 0, j = fp[b] / bs, o = fp[b] % bs; l < lp[b]; ++l) {
      row[l] = table[j] * bs + o;
      if (++o == bs) o = 0, ++j;
    }
  }
  const int64_t* sp = all_slots.data();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(H * d), scores(H * L), acc(H * dv);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lp[b];
      const int64_t* row_slots = sp + b * L;
      auto slot = [row_slots](int64_t l) { return row_slots[l]; };
      for (int64_t hq = 0; hq < H; ++hq) {
        const float* src = qp + b * qs0 + hq * qs1;
        for (int64_t i = 0; i < d; ++i) q[hq * d + i] = src[i] * fscale;
      }
      for (int64_t l = 0; l < n; ++l) {
        if (l + kAhead < n) prefetch_row(kp + slot(l + kAhead) * ks0, h * ks1);
        const float* row = kp + slot(l) * ks0;
        for (int64_t hq = 0; hq < H; ++hq) scores[hq * L + l] = dot(q.data() + hq * d, row + (hq / G) * ks1, d);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> inv(H);
      for (int64_t hq = 0; hq < H; ++hq) inv[hq] = 1.f / softmax_numerators(scores.data() + hq * L, n);
      for (int64_t l = 0; l < n; ++l) {
        if (l + kAhead < n) prefetch_row(vp + slot(l + kAhead) * vs0, h * vs1);
        const float* row = vp + slot(l) * vs0;
        for (int64_t hq = 0; hq < H; ++hq) axpy(scores[hq * L + l], row + (hq / G) * vs1, acc.data() + hq * dv, dv);
      }
      float* dst = op + b * H * dv;
      for (int64_t hq = 0; hq < H; ++hq) {
        for (int64_t i = 0; i < dv; ++i) dst[hq * dv + i] = acc[hq * dv + i] * inv[hq];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(expertmesh_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor keys, Tensor values, Tensor block_tables, Tensor firsts, Tensor lengths, "
      "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(expertmesh_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
