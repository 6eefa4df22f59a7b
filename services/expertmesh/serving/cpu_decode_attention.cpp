// A decode step's attention half of one decoder layer in one op (cpu_decode_attention.py says why and when): the
// query, key and value products, the rotary embedding, the new keys and values stored in the pool, the paged
// attention over each row's past and the output product. The products and the attention are the kernels the
// module's own forward reaches through Python (expertmesh_experts::grouped_linear, or at::linear for a product left
// on torch's; expertmesh_cpu::paged_decode), called here through torch's dispatcher: the same arithmetic.
//
// No multiply-add is contracted in this file: the rotary embedding must round as transformers' ops do, each
// product and the sum on its own (q * cos, rotate_half(q) * sin, their sum).
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <cstring>

namespace {

// x [B, in] -> [B, n]: by the grouped kernel where the product is packed for it, else as the module's nn.Linear
// computes it (at::linear over [1, B, in], the shape the module's forward hands it).
at::Tensor product(const at::Tensor& x, const c10::optional<at::Tensor>& packed, int64_t n,
                   const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias) {
  if (packed.has_value() && packed->defined()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("expertmesh_experts::grouped_linear", "")
                         .typed<at::Tensor(const at::Tensor&, at::IntArrayRef, const at::Tensor&, int64_t)>();
    const std::array<int64_t, 2> starts{0, x.size(0)};
    at::Tensor out = op.call(x, starts, *packed, n);
    if (bias.has_value() && bias->defined()) out = out + *bias;  // as GroupedWeight.linear adds it
    return out;
  }
  TORCH_CHECK(weight.has_value() && weight->defined() && weight->size(0) == n,
              "decode_attention: each product packed for the grouped kernel or given as its weight [n, in]");
  return at::linear(x.unsqueeze(0), *weight, bias).squeeze(0);
}

// rows [B, heads * d] in place: each head's d values rotated as transformers' apply_rotary_pos_emb does,
// x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x[d/2:], x[:d/2]); cos, sin [B, d].
void rotate(float* rows, const float* cos, const float* sin, int64_t B, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  std::vector<float> own(d);
  for (int64_t b = 0; b < B; ++b) {
    const float* c = cos + b * d;
    const float* s = sin + b * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = rows + (b * heads + h) * d;
      std::memcpy(own.data(), x, d * sizeof(float));
      for (int64_t i = 0; i < half; ++i) {
        const float straight = own[i] * c[i];
        const float turned = -own[i + half] * s[i];
        x[i] = straight + turned;
      }
      for (int64_t i = half; i < d; ++i) {
        const float straight = own[i] * c[i];
        const float turned = own[i - half] * s[i];
        x[i] = straight + turned;
      }
    }
  }
}

// rows [B, width] into pool rows [S, width] at slots [B].
void store(const at::Tensor& rows, const at::Tensor& pool, const int64_t* slots, int64_t B) {
  const int64_t width = rows.size(1), S = pool.size(0);
  const float* src = rows.data_ptr<float>();
  float* dst = pool.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slots[b] >= 0 && slots[b] < S, "decode_attention: a write slot outside the pool");
    std::memcpy(dst + slots[b] * width, src + b * width, width * sizeof(float));
  }
}

at::Tensor decode_attention(const at::Tensor& x_in, const c10::optional<at::Tensor>& q_packed, int64_t q_out,
                            const c10::optional<at::Tensor>& q_weight, const c10::optional<at::Tensor>& q_bias,
                            const c10::optional<at::Tensor>& k_packed, int64_t k_out,
                            const c10::optional<at::Tensor>& k_weight, const c10::optional<at::Tensor>& k_bias,
                            const c10::optional<at::Tensor>& v_packed, int64_t v_out,
                            const c10::optional<at::Tensor>& v_weight, const c10::optional<at::Tensor>& v_bias,
                            const c10::optional<at::Tensor>& o_packed, int64_t o_out,
                            const c10::optional<at::Tensor>& o_weight, const c10::optional<at::Tensor>& o_bias,
                            const at::Tensor& cos_in, const at::Tensor& sin_in, const at::Tensor& key_pool,
                            const at::Tensor& value_pool, const at::Tensor& slots_in, const at::Tensor& tables,
                            const at::Tensor& firsts, const at::Tensor& lengths, int64_t heads, int64_t block_size,
                            double scale) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decode_attention: rows [B, hidden] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0);
  TORCH_CHECK(key_pool.dim() == 3 && value_pool.dim() == 3 && key_pool.is_contiguous() &&
                  value_pool.is_contiguous() && key_pool.scalar_type() == at::kFloat &&
                  value_pool.scalar_type() == at::kFloat && key_pool.size(0) == value_pool.size(0) &&
                  key_pool.size(1) == value_pool.size(1),
              "decode_attention: contiguous float32 pools [S, h, d] and [S, h, dv]");
  const int64_t kv_heads = key_pool.size(1), d = key_pool.size(2), dv = value_pool.size(2);
  TORCH_CHECK(heads >= 1 && q_out == heads * d && k_out == kv_heads * d && v_out == kv_heads * dv && d % 2 == 0,
              "decode_attention: the products' widths are the pools' heads times their widths");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) == d && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "decode_attention: cos and sin [B, d] float32");
  const at::Tensor slots = slots_in.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B, "decode_attention: slots [B] int64");

  at::Tensor q = product(x, q_packed, q_out, q_weight, q_bias).contiguous();  // [B, H * d]
  at::Tensor k = product(x, k_packed, k_out, k_weight, k_bias).contiguous();  // [B, h * d]
  at::Tensor v = product(x, v_packed, v_out, v_weight, v_bias).contiguous();  // [B, h * dv]
  rotate(q.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), B, heads, d);
  rotate(k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), B, kv_heads, d);
  const int64_t* sp = slots.data_ptr<int64_t>();
  store(k, key_pool.view({key_pool.size(0), kv_heads * d}), sp, B);
  store(v, value_pool.view({value_pool.size(0), kv_heads * dv}), sp, B);

  static auto attend = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("expertmesh_cpu::paged_decode", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&, int64_t, double)>();
  at::Tensor attended =
      attend.call(q.view({B, heads, d}), key_pool, value_pool, tables, firsts, lengths, block_size, scale);
  return product(attended.reshape({B, heads * dv}), o_packed, o_out, o_weight, o_bias);  // [B, hidden]
}

}  // namespace

TORCH_LIBRARY(expertmesh_decode, m) {
  m.def(
      "decode_attention(Tensor x, Tensor? q_packed, int q_out, Tensor? q_weight, Tensor? q_bias, Tensor? k_packed, "
      "int k_out, Tensor? k_weight, Tensor? k_bias, Tensor? v_packed, int v_out, Tensor? v_weight, Tensor? v_bias, "
      "Tensor? o_packed, int o_out, Tensor? o_weight, Tensor? o_bias, Tensor cos, Tensor sin, Tensor key_pool, "
      "Tensor value_pool, Tensor slots, Tensor block_tables, Tensor firsts, Tensor lengths, int heads, "
      "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(expertmesh_decode, CPU, m) { m.impl("decode_attention", &decode_attention); }
