// A group's experts' products in one call per stacked weight: every held expert's rows of a call through its own
// matrix, the (expert, column tile) pairs shared out over the intra-op threads in one parallel region
// (grouped_experts.py says why and what it measured). Built for the host's vector unit (-march=native).
//
// Shapes: x [S, K] float32, its rows grouped by expert (starts [E + 1]: expert e's rows are starts[e] ..
// starts[e + 1]); packed [E, T, K, NR] (each expert's [N, K] matrix in tiles of NR output columns, each tile's
// K rows of NR contiguous); out [S, N], N <= T * NR. Each output is a plain dot product over K in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sleef.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// The register block fits the host's vector unit: the tile's 32 columns are VEC-wide vectors, and MR rows of
// them stay in registers (MR x NR / VEC accumulators, a few registers left for the weights and a row's value).
// AVX-512: 32 registers of 16 floats, 8 rows (16 accumulators). AVX/AVX2: 16 registers of 8, 3 rows (12): a
// 64-byte vector there is two halves the compiler spills, with memcpy loads 3-30x slower than this on an AVX2 host.
// Otherwise (SSE): 16 registers of 4, one row (8). The bits do not depend on the block: each output is its own
// dot product over K in order.
#if defined(__AVX512F__)
constexpr int VEC = 16;
constexpr int MR = 8;
#elif defined(__AVX__)
constexpr int VEC = 8;
constexpr int MR = 3;
#else
constexpr int VEC = 4;
constexpr int MR = 1;
#endif
// Loads and stores through this type are plain unaligned vector moves (may_alias: it reads float arrays). Not
// memcpy: a host tuned for 16-byte moves splits a 32-byte memcpy into two and reads it back through the stack,
// stalling every product on store forwarding (one row of a [3584, 512] expert on an AVX2 host: 2.1 ms so,
// 0.15 ms with these moves, torch's own product 0.55).
typedef float vec __attribute__((vector_size(VEC * sizeof(float)), aligned(4), may_alias));
constexpr int64_t NR = 32;     // output columns a tile (grouped_experts.py's TILE)
constexpr int CV = NR / VEC;  // vectors a tile's row
// Weight rows (of NR floats, 128 bytes) a block asks the memory for ahead of its products. From ~4 rows an expert the
// block's products no longer hide the memory's latency behind the hardware prefetcher alone: 8 layers x 8 experts of
// the 214M Mixtral, two groups of 4 on one thread each (the lanes), medians of interleaved rounds on this project's
// 2-core AVX-512 host: 14.9 / 15.0 / 17.6 ms at 4 / 8 / 16 rows an expert against 18.4 / 18.2 / 20.5 without, no
// change at 1 (memory-bound, ~47 GB/s either way); 128 or 256 rows ahead no better. Past a tile's end it reads the
// start of the expert's next tile, which its turn finds in the cache. Bits unchanged: a prefetch computes nothing.
constexpr int64_t PREFETCH = 64;

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }

inline void store(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }

// M rows of x (row stride K) times tile rows k0 .. k1 of a tile [K, NR], added to acc [M][NR / VEC]: every output's
// dot product over K runs in order of k, whether its k come in one run or in chunks (the same bits either way).
template <int M>
inline void accumulate(const float* x, int64_t K, const float* tile, vec (&acc)[M][CV], int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    // the tile's row PREFETCH ahead (two 64-byte lines), asked for now so it is on its way while these are used
    __builtin_prefetch(tile + (k + PREFETCH) * NR, 0, 3);
    __builtin_prefetch(tile + (k + PREFETCH) * NR + NR / 2, 0, 3);
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) {
      const vec w = load(tile + k * NR + c * VEC);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][c] += x[m * K + k] * w;
    }
  }
}

// acc's M rows, each times scale[m] where scale is given, into y[m, n0 .. n0 + cols) (row stride N), cols <= NR.
template <int M>
inline void write_rows(vec (&acc)[M][CV], float* y, int64_t N, int64_t n0, int64_t cols, const float* scale) {
  if (scale != nullptr)  // each output row times its routing weight: ATen's mul_ of the product, the same rounding
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < CV; ++c) acc[m][c] *= scale[m];
  for (int m = 0; m < M; ++m) {
    float* dst = y + m * N + n0;
    if (cols == NR) {
      for (int c = 0; c < CV; ++c) store(dst + c * VEC, acc[m][c]);
    } else {  // the last tile of an N that is not a multiple of NR: its padding columns are not written
      float full[NR];
      for (int c = 0; c < CV; ++c) store(full + c * VEC, acc[m][c]);
      std::memcpy(dst, full, cols * sizeof(float));
    }
  }
}

// M rows of x (row stride K) through one tile [K, NR]: y[m, n0 .. n0 + cols) (row stride N), cols <= NR; each
// row times scale[m] where scale is given.
template <int M>
inline void block(const float* x, int64_t K, const float* tile, float* y, int64_t N, int64_t n0, int64_t cols,
                  const float* scale = nullptr) {
  vec acc[M][CV];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < CV; ++c) acc[m][c] = vec{};
  accumulate<M>(x, K, tile, acc, 0, K);
  write_rows<M>(acc, y, N, n0, cols, scale);
}

// block's products over tile rows k0 .. k1 only, its M rows' running sums kept in sums [M, NR] between the chunks
// (k0 == 0: the first chunk, started from zero).
template <int M>
inline void block_chunk(const float* x, int64_t K, const float* tile, float* sums, int64_t k0, int64_t k1) {
  vec acc[M][CV];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < CV; ++c) acc[m][c] = k0 == 0 ? vec{} : load(sums + m * NR + c * VEC);
  accumulate<M>(x, K, tile, acc, k0, k1);
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < CV; ++c) store(sums + m * NR + c * VEC, acc[m][c]);
}

// f(std::integral_constant<int, rest>) for a rest of 1 .. M rows (0: nothing): a row count known at run time to
// a block's, known at compile time.
template <int M, class F>
inline void with_rows(int64_t rest, F&& f) {
  if constexpr (M > 0) {
    if (rest == M) return f(std::integral_constant<int, M>{});
    with_rows<M - 1>(rest, f);
  }
}

// SiLU's GLU of NR gate and up values: silu(g) * u, silu as ATen's vectorized CPU kernel computes it (x / (1 +
// exp(-x)), its exp Sleef's 1-ULP expf at the width ATen's kernel for this host runs: 16 floats with AVX-512, 8
// with AVX2), rounded, then times u: the bits of at::silu(gate) * up. grouped_experts.py's exact_silu checks that
// at load against at::silu on a spread of values, and the unfused path serves where it does not hold.
inline void silu_glu_tile(const float* g, const float* u, float* dst) {
#if defined(__AVX512F__) || defined(__AVX2__)
  for (int c = 0; c < NR; c += VEC) {
    const vec x = load(g + c);
#if defined(__AVX512F__)
    const vec e = reinterpret_cast<vec>(Sleef_expf16_u10(reinterpret_cast<__m512>(-x)));
#else
    const vec e = reinterpret_cast<vec>(Sleef_expf8_u10(reinterpret_cast<__m256>(-x)));
#endif
    const vec silu = x / (1.0f + e);
    store(dst + c, silu * load(u + c));
  }
#else  // ATen's default kernel: std::exp a value at a time
  for (int c = 0; c < NR; ++c) {
    const float silu = g[c] / (1.0f + std::exp(-g[c]));
    dst[c] = silu * u[c];
  }
#endif
}

// Each of a tile's row blocks from the memory once: past one block of rows, the tile is taken KC of its rows at a
// time (16 KB of a gate tile and its up tile, in the L1 cache) and every block of rows goes through those before the
// next, the blocks' running sums kept between (block_chunk); a tile read whole for each block would come from the
// memory for the first and from L2 for the others, and the first block's reads would not overlap the others'
// products (grouped_experts.py: what it measured; 32 or 128 rows a chunk were slower than 64).
constexpr int64_t KC = 64;

// The running sums of a call's row blocks between chunks: one buffer a thread, grown to the largest call it ran.
float* chunk_sums(int64_t floats) {
  thread_local std::vector<float> sums;
  if (static_cast<int64_t>(sums.size()) < floats) sums.resize(floats);
  return sums.data();
}

// f(rows of the block, its first row, k0, k1) for each chunk of KC of a tile's K rows, and in it for each block of
// rows (MR, the last maybe fewer): every block through a chunk before the next chunk.
template <class F>
inline void through_chunks(int64_t rows, int64_t K, F&& f) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    for (int64_t r = 0; r < rows; r += MR)
      with_rows<MR>(std::min<int64_t>(MR, rows - r), [&](auto m) { f(m, r, k0, k1); });
  }
}

// The rows of one block short of MR: M of them at most (tail: one tile; glu_tail: a gate tile and its up tile).
template <int M>
inline void tail(int64_t rest, const float* x, int64_t K, const float* tile, float* y, int64_t N, int64_t n0,
                 int64_t cols, const float* scale) {
  if constexpr (M > 0) {
    if (rest == M) return block<M>(x, K, tile, y, N, n0, cols, scale);
    tail<M - 1>(rest, x, K, tile, y, N, n0, cols, scale);
  }
}

void rows_through_tile(const float* x, int64_t rows, int64_t K, const float* tile, float* y, int64_t N, int64_t n0,
                       int64_t cols, const float* scale) {
  auto scaled = [&](int64_t r) { return scale == nullptr ? nullptr : scale + r; };
  if (rows <= MR) {  // one block: the tile read once either way
    if (rows == MR) return block<MR>(x, K, tile, y, N, n0, cols, scale);
    return tail<MR - 1>(rows, x, K, tile, y, N, n0, cols, scale);
  }
  float* sums = chunk_sums(rows * NR);  // [rows, NR]
  through_chunks(rows, K, [&](auto m, int64_t r, int64_t k0, int64_t k1) {
    block_chunk<decltype(m)::value>(x + r * K, K, tile, sums + r * NR, k0, k1);
  });
  for (int64_t r = 0; r < rows; r += MR)
    with_rows<MR>(std::min<int64_t>(MR, rows - r), [&](auto m) {
      constexpr int M = decltype(m)::value;
      vec acc[M][CV];
      for (int i = 0; i < M; ++i)
        for (int c = 0; c < CV; ++c) acc[i][c] = load(sums + (r + i) * NR + c * VEC);
      write_rows<M>(acc, y + r * N, N, n0, cols, scaled(r));
    });
}

// M rows of x through a gate tile and its up tile: y[m, n0 .. n0 + NR) = silu(x W_gate) * (x W_up) (row stride I),
// the two products' blocks kept on the stack between the products and the gate.
template <int M>
inline void glu_block(const float* x, int64_t K, const float* gate_tile, const float* up_tile, float* y, int64_t I,
                      int64_t n0) {
  float g[M * NR], u[M * NR];
  block<M>(x, K, gate_tile, g, NR, 0, NR);
  block<M>(x, K, up_tile, u, NR, 0, NR);
  for (int m = 0; m < M; ++m) silu_glu_tile(g + m * NR, u + m * NR, y + m * I + n0);
}

template <int M>
inline void glu_tail(int64_t rest, const float* x, int64_t K, const float* gate_tile, const float* up_tile, float* y,
                     int64_t I, int64_t n0) {
  if constexpr (M > 0) {
    if (rest == M) return glu_block<M>(x, K, gate_tile, up_tile, y, I, n0);
    glu_tail<M - 1>(rest, x, K, gate_tile, up_tile, y, I, n0);
  }
}

void rows_through_glu_tile(const float* x, int64_t rows, int64_t K, const float* gate_tile, const float* up_tile,
                           float* y, int64_t I, int64_t n0) {
  if (rows <= MR) {
    if (rows == MR) return glu_block<MR>(x, K, gate_tile, up_tile, y, I, n0);
    return glu_tail<MR - 1>(rows, x, K, gate_tile, up_tile, y, I, n0);
  }
  float* g = chunk_sums(2 * rows * NR);  // [rows, NR] the gate's, then [rows, NR] the up's
  float* u = g + rows * NR;
  through_chunks(rows, K, [&](auto m, int64_t r, int64_t k0, int64_t k1) {
    block_chunk<decltype(m)::value>(x + r * K, K, gate_tile, g + r * NR, k0, k1);
    block_chunk<decltype(m)::value>(x + r * K, K, up_tile, u + r * NR, k0, k1);
  });
  for (int64_t r = 0; r < rows; ++r) silu_glu_tile(g + r * NR, u + r * NR, y + r * I + n0);
}

// The products of rows grouped by expert (x [S, K], starts [E + 1]) through packed [E, T, K, NR] into y [S, n],
// each row times scale[row] where scale [S] is given.
void products(const float* xp, const std::vector<int64_t>& st, int64_t K, const float* wp, int64_t E, int64_t T,
              int64_t n, float* yp, const float* scale = nullptr) {
  // Tile-major, expert-minor: each thread's share spans every expert, so uneven rows per expert still balance.
  at::parallel_for(0, T * E, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / E, e = i % E, r0 = st[e], rows = st[e + 1] - st[e];
      if (rows == 0) continue;
      const int64_t n0 = t * NR, cols = std::min<int64_t>(NR, n - n0);
      rows_through_tile(xp + r0 * K, rows, K, wp + (e * T + t) * K * NR, yp + r0 * n, n, n0, cols,
                        scale == nullptr ? nullptr : scale + r0);
    }
  });
}

// The gated products of rows grouped by expert through a stacked gate and up weight packed [E, 2 * I / NR, K, NR]
// (the gate's I outputs, then the up's; I a multiple of NR) into y [S, I] = silu(x W_gate) * (x W_up): each item
// a gate tile and its up tile, so the [S, 2I] products are never written out, nor read back for the gate.
void glu_products(const float* xp, const std::vector<int64_t>& st, int64_t K, const float* wp, int64_t E, int64_t I,
                  float* yp) {
  const int64_t half = I / NR, T = 2 * half;
  at::parallel_for(0, half * E, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / E, e = i % E, r0 = st[e], rows = st[e + 1] - st[e];
      if (rows == 0) continue;
      rows_through_glu_tile(xp + r0 * K, rows, K, wp + (e * T + t) * K * NR, wp + (e * T + t + half) * K * NR,
                            yp + r0 * I, I, t * NR);
    }
  });
}

// The shapes a grouped product takes (grouped_linear's and the gated products'): x [S, K] float32, packed [E, T,
// K, NR] float32 contiguous, n outputs within its tiles, starts [E + 1] ascending from 0 to S.
void check_products(const at::Tensor& x, at::IntArrayRef starts, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "grouped_linear: float32 rows and weights");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(3) == NR && packed.is_contiguous(),
              "grouped_linear: x [S, K] and packed [E, T, K, 32], contiguous");
  const int64_t S = x.size(0), K = x.size(1), E = packed.size(0), T = packed.size(1);
  TORCH_CHECK(packed.size(2) == K, "grouped_linear: the weights' inputs as wide as the rows");
  TORCH_CHECK(n > (T - 1) * NR && n <= T * NR, "grouped_linear: n within the packed tiles");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == E + 1 && starts[0] == 0 && starts[E] == S,
              "grouped_linear: starts [E + 1] from 0 to the rows");
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(starts[e] <= starts[e + 1], "grouped_linear: starts ascending");
}

// scale [S] (row_weights [S, 1]): each output row times its weight.
at::Tensor grouped_linear_scaled(const at::Tensor& x_in, at::IntArrayRef starts, const at::Tensor& packed, int64_t n,
                                 const float* scale) {
  check_products(x_in, starts, packed, n);
  const at::Tensor x = x_in.contiguous();
  const int64_t S = x.size(0), K = x.size(1), E = packed.size(0), T = packed.size(1);
  auto y = at::empty({S, n}, x.options());
  if (S == 0) return y;
  const std::vector<int64_t> st(starts.begin(), starts.end());
  products(x.data_ptr<float>(), st, K, packed.data_ptr<float>(), E, T, n, y.data_ptr<float>(), scale);
  return y;
}

at::Tensor grouped_linear(const at::Tensor& x, at::IntArrayRef starts, const at::Tensor& packed, int64_t n) {
  return grouped_linear_scaled(x, starts, packed, n, nullptr);
}

// Whether a gate-and-up weight of n_gate_up outputs splits into gate and up at a tile's edge (glu_products).
bool glu_tiles(int64_t n_gate_up) { return n_gate_up % (2 * NR) == 0; }

// silu(h[:, :I]) * h[:, I:] of h [S, 2I] (I a multiple of NR) by the gated products' epilogue: what exact_silu
// compares with at::silu.
at::Tensor silu_glu_epilogue(const at::Tensor& h_in) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat && glu_tiles(h_in.size(1)),
              "silu_glu_epilogue: h [S, 2I] float32, I a multiple of 32");
  const at::Tensor h = h_in.contiguous();
  const int64_t S = h.size(0), I = h.size(1) / 2;
  auto y = at::empty({S, I}, h.options());
  const float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t c = 0; c < I; c += NR) silu_glu_tile(hp + s * 2 * I + c, hp + s * 2 * I + I + c, yp + s * I + c);
  return y;
}

// Rows already grouped by expert (starts) through their experts' gated (SiLU) MLP, each output row times its
// weight ([S, 1]): grouped_rows_forward's ops after its gather, the same ATen ops in the same order.
// fused: the gate computed in the gate-and-up products' epilogue and the weights in the down products' (the same
// bits where exact_silu holds; else the ATen ops).
at::Tensor glu_grouped(const at::Tensor& rows, at::IntArrayRef starts, const at::Tensor& gate_up, int64_t n_gate_up,
                       const at::Tensor& down, int64_t n_down, const at::Tensor& weights, bool fused) {
  TORCH_CHECK(n_gate_up % 2 == 0, "grouped_silu_glu: gate and up outputs as many");
  if (fused && glu_tiles(n_gate_up) && weights.scalar_type() == at::kFloat) {
    check_products(rows, starts, gate_up, n_gate_up);
    const at::Tensor x = rows.contiguous();
    const at::Tensor w = weights.contiguous();  // [S, 1]
    TORCH_CHECK(w.numel() == x.size(0), "grouped_silu_glu: a weight a row");
    const int64_t S = x.size(0), I = n_gate_up / 2;
    auto gated = at::empty({S, I}, x.options());  // [S, I]
    if (S > 0) {
      const std::vector<int64_t> st(starts.begin(), starts.end());
      glu_products(x.data_ptr<float>(), st, x.size(1), gate_up.data_ptr<float>(), gate_up.size(0), I,
                   gated.data_ptr<float>());
    }
    return grouped_linear_scaled(gated, starts, down, n_down, w.data_ptr<float>());  // [S, H]
  }
  const at::Tensor h = grouped_linear(rows, starts, gate_up, n_gate_up);  // [S, 2I]
  const auto halves = h.chunk(2, -1);
  const at::Tensor gated = at::silu(halves[0]) * halves[1];               // [S, I]
  return grouped_linear(gated, starts, down, n_down).mul_(weights);       // [S, H]
}

// A gated (SiLU) expert MLP of rows in one call: grouped_experts.py's grouped_rows_forward, its ops the same ATen
// ops in the same order (so the same bits), without a trip through Python between them. hidden [S, K] in the
// call's order; order [S] (None: already grouped) the row at each grouped position; weights [S, 1].
at::Tensor grouped_silu_glu(const at::Tensor& hidden, const c10::optional<at::Tensor>& order, at::IntArrayRef starts,
                            const at::Tensor& gate_up, int64_t n_gate_up, const at::Tensor& down, int64_t n_down,
                            const at::Tensor& weights, bool fused) {
  const bool permuted = order.has_value();
  const at::Tensor rows = permuted ? hidden.index_select(0, *order) : hidden;  // [S, K] grouped by expert
  const at::Tensor out = glu_grouped(rows, starts, gate_up, n_gate_up, down, n_down,
                                     permuted ? weights.index_select(0, *order) : weights, fused);  // [S, H]
  if (!permuted) return out;
  return at::empty_like(out).index_copy_(0, *order, out);
}

// A group's whole call (grouped_experts.py's grouped_call): the (token, slot) pairs of expert_ids [T, K] (global
// ids, -1 an empty slot) that this group holds (local_of [G]: global id -> local expert, -1 not held), in row
// order; their rows through grouped_silu_glu, weighted; and their sum per token, added in pair order (as
// row_sums.add_rows adds: the same bits). Returns (partial [T, H], rows [S, H] and local [S] int64 and row_weights
// [S] grouped by expert, each expert's in pair order, missing [M] int64): a call naming ids the group does not
// hold (or past G) computes nothing and returns them, sorted, for the caller's NotHosted.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> grouped_silu_glu_call(
    const at::Tensor& hidden, const at::Tensor& expert_ids, const at::Tensor& weights, const at::Tensor& local_of,
    const at::Tensor& gate_up, int64_t n_gate_up, const at::Tensor& down, int64_t n_down, bool fused) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "grouped_silu_glu_call: hidden [T, H] float32");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == hidden.size(0), "grouped_silu_glu_call: ids [T, K]");
  TORCH_CHECK(weights.sizes() == expert_ids.sizes() && weights.scalar_type() == at::kFloat,
              "grouped_silu_glu_call: weights [T, K] float32");
  TORCH_CHECK(local_of.dim() == 1 && local_of.scalar_type() == at::kLong, "grouped_silu_glu_call: local_of [G] int64");
  const at::Tensor ids = expert_ids.to(at::kLong).contiguous();
  const at::Tensor w = weights.contiguous();
  const at::Tensor map = local_of.contiguous();
  const int64_t T = ids.size(0), K = ids.size(1), G = map.size(0), E = down.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wp = w.data_ptr<float>();
  const int64_t* lp = map.data_ptr<int64_t>();
  std::vector<int64_t> token, local, missing;
  std::vector<float> scale;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = id[t * K + k];
      if (e < 0) continue;
      const int64_t l = e < G ? lp[e] : -1;
      if (l < 0 || l >= E) {
        missing.push_back(e);
        continue;
      }
      token.push_back(t);
      local.push_back(l);
      scale.push_back(wp[t * K + k]);
    }
  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor partial = at::zeros_like(hidden, at::MemoryFormat::Contiguous);  // [T, H]
  if (!missing.empty()) {
    std::sort(missing.begin(), missing.end());
    missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
    return {partial, hidden.new_empty({0, hidden.size(1)}), at::empty({0}, longs), weights.new_empty({0}),
            at::tensor(missing, longs)};
  }
  const int64_t S = static_cast<int64_t>(token.size()), H = hidden.size(1);
  if (S == 0)
    return {partial, hidden.new_empty({0, H}), at::empty({0}, longs), weights.new_empty({0}), at::empty({0}, longs)};
  // grouped_rows_forward's plan: a stable order of the pairs by expert, and where each expert's rows start
  std::vector<int64_t> order(S), starts(E + 1, 0);
  for (int64_t s = 0; s < S; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return local[a] < local[b]; });
  for (int64_t s = 0; s < S; ++s) ++starts[local[s] + 1];
  for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
  // Each pair's row gathered straight into its grouped place, with its weight and expert (a gather copies: the
  // same rows as gathering in pair order and then by expert); the outputs stay grouped (position[s]: pair s's).
  std::vector<int64_t> grouped_token(S), grouped_local(S), position(S);
  std::vector<float> grouped_scale(S);
  for (int64_t g = 0; g < S; ++g) {
    grouped_token[g] = token[order[g]];
    grouped_local[g] = local[order[g]];
    grouped_scale[g] = scale[order[g]];
    position[order[g]] = g;
  }
  const at::Tensor rows_in = hidden.index_select(0, at::tensor(grouped_token, longs));        // [S, H] grouped
  const at::Tensor row_weights = at::tensor(grouped_scale, weights.options()).unsqueeze(1);  // [S, 1] grouped
  const at::Tensor rows = glu_grouped(rows_in, starts, gate_up, n_gate_up, down, n_down, row_weights, fused).contiguous();
  // each token's sum in pair order (row_sums.add_rows' order, so its bits with any top-k)
  float* out = partial.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) {
    float* dst = out + token[s] * H;
    const float* src = rp + position[s] * H;
    for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
  }
  // the rows for the statistics in grouped order: each expert's rows in their pair order, so the same sums
  return {partial, rows, at::tensor(grouped_local, longs), row_weights.squeeze(1), at::empty({0}, longs)};
}

}  // namespace

TORCH_LIBRARY(expertmesh_experts, m) {
  m.def("grouped_linear(Tensor x, int[] starts, Tensor packed, int n) -> Tensor");
  m.def(
      "grouped_silu_glu(Tensor hidden, Tensor? order, int[] starts, Tensor gate_up, int n_gate_up, Tensor down, "
      "int n_down, Tensor weights, bool fused) -> Tensor");
  m.def(
      "grouped_silu_glu_call(Tensor hidden, Tensor expert_ids, Tensor weights, Tensor local_of, Tensor gate_up, "
      "int n_gate_up, Tensor down, int n_down, bool fused) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("silu_glu_epilogue(Tensor h) -> Tensor");
}

TORCH_LIBRARY_IMPL(expertmesh_experts, CPU, m) {
  m.impl("grouped_linear", &grouped_linear);
  m.impl("grouped_silu_glu", &grouped_silu_glu);
  m.impl("grouped_silu_glu_call", &grouped_silu_glu_call);
  m.impl("silu_glu_epilogue", &silu_glu_epilogue);
}
