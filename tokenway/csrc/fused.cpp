// The small steps of a decoder layer, fused: each is one pass over its rows instead of several
// torch operators (a decode step at one token is ~25 operators per layer, each a few
// microseconds of dispatch for a few hundred floats of work).
//
//   rope_and_cache      RoPE (rotate-half, as HF Llama) on q and k of a fused qkv row, k and v
//                       written to their cache slots, q returned: all in the cache's dtype.
//   add_rms_norm_       residual += x; x = rms_norm(residual) * weight  (both in place, float32)
//   silu_and_mul        silu(gate) * up of a fused gate_up row
//   rms_norm            x * rsqrt(mean(x^2) + eps) * weight (the first layer's input, the final norm)
//   argmax_rows         each row's greedy token (a sampler's common path)
//
// Float32 arithmetic as torch's operators do it (products rounded before sums where torch rounds
// them; bfloat16 rounding to nearest even, c10::BFloat16's own), so outputs equal the torch
// path's up to the order of a norm's sum.
//
// Their loops over rows run on the pool the matmuls and attention use (pool.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"

namespace {

#include "vec.h"

template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return T(x);
  }
}

template <typename T>
void rope_rows(const float* qkv, int64_t row_stride, const float* cos_table, const float* sin_table,
               const int64_t* positions, const int64_t* slots, T* q_out, T* k_cache, T* v_cache, int64_t tokens,
               int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2, items_per_token = heads + 2 * kv_heads;
  // At least ~16K values a thread: a decode token's heads (96 of 64 for SmolLM2-1.7B) are a few
  // microseconds of work, less than a parallel region costs.
  const int64_t grain = std::max<int64_t>(64, (int64_t(1) << 14) / dim);
  tokenway_native::parallel_for(0, tokens * items_per_token, grain, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t t = item / items_per_token, h = item % items_per_token;
      const float* src = qkv + t * row_stride + h * dim;
      if (h >= heads + kv_heads) {  // v: copied as is
        T* dst = v_cache + (slots[t] * kv_heads + (h - heads - kv_heads)) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = from_float<T>(src[i]);
        continue;
      }
      const float* c = cos_table + positions[t] * dim;
      const float* s = sin_table + positions[t] * dim;
      T* dst = h < heads ? q_out + (t * heads + h) * dim : k_cache + (slots[t] * kv_heads + (h - heads)) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = src[i] * c[i], b = -src[i + half] * s[i];
        dst[i] = from_float<T>(a + b);
      }
      for (int64_t i = half; i < dim; ++i) {
        const float a = src[i] * c[i], b = src[i - half] * s[i];
        dst[i] = from_float<T>(a + b);
      }
    }
  });
}

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos_table, const at::Tensor& sin_table,
                          const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1, "qkv (T, width) float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache (num_slots, kv_heads, head_dim), contiguous, one dtype");
  const int64_t tokens = qkv.size(0), dim = k_cache.size(2);
  TORCH_CHECK(k_cache.size(1) == kv_heads && dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv width must be (heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) == dim,
              "cos/sin tables (max_positions, head_dim) float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == tokens && slot_mapping.numel() == tokens && positions.is_contiguous() &&
                  slot_mapping.is_contiguous(),
              "positions and slot_mapping (T,) int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_table.size(0), "position ", pos[t], " outside the RoPE table");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_cache.size(0), "slot ", slots[t], " outside the cache");
  }
  at::Tensor q = at::empty({tokens, heads, dim}, k_cache.options());
  if (k_cache.scalar_type() == at::kFloat) {
    rope_rows<float>(qkv.data_ptr<float>(), qkv.stride(0), cos_table.data_ptr<float>(), sin_table.data_ptr<float>(),
                     pos, slots, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tokens,
                     heads, kv_heads, dim);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "caches float32 or bfloat16");
    rope_rows<c10::BFloat16>(qkv.data_ptr<float>(), qkv.stride(0), cos_table.data_ptr<float>(),
                             sin_table.data_ptr<float>(), pos, slots, q.data_ptr<c10::BFloat16>(),
                             k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), tokens, heads,
                             kv_heads, dim);
  }
  return q;
}

// out = residual * rsqrt(mean(residual^2) + eps) * weight for one row.
inline void norm_row(const float* residual, const float* weight, float* out, int64_t hidden, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < hidden; ++i) sum += residual[i] * residual[i];
  const float inv = 1.0f / std::sqrt(sum / float(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) out[i] = residual[i] * inv * weight[i];
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "x (T, hidden) contiguous, weight (hidden,)");
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && x.sizes() == residual.sizes() && residual.is_contiguous(),
              "residual (T, hidden) float32, contiguous");
  const int64_t rows = x.size(0), hidden = x.size(1);
  float* xs = x.data_ptr<float>();
  float* rs = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  tokenway_native::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      float* xr = xs + row * hidden;
      float* rr = rs + row * hidden;
      for (int64_t i = 0; i < hidden; ++i) rr[i] += xr[i];
      norm_row(rr, w, xr, hidden, float(eps));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  tokenway_native::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) norm_row(xs + row * hidden, w, os + row * hidden, hidden, float(eps));
  });
  return out;
}

// The index of each row's largest value, the first where several tie and the first NaN where
// there is one (torch.argmax's answers), vectorised: torch's reduction reads ~1 value a
// nanosecond, 0.5 ms a step for 16 rows of a 49,152-token vocabulary.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = x[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 values = _mm512_loadu_ps(x);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i lanes = index;
    __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n && !nan; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(int(i)));
      const __mmask16 greater = _mm512_cmp_ps_mask(v, values, _CMP_GT_OQ);  // strict: a tie keeps the earlier
      values = _mm512_mask_blend_ps(greater, values, v);
      index = _mm512_mask_blend_epi32(greater, index, at);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan) {
      i = 0;  // a NaN: the scalar scan below finds the first
    } else {
      best_value = _mm512_reduce_max_ps(values);
      const __mmask16 top = _mm512_cmp_ps_mask(values, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
      best = _mm512_mask_reduce_min_epi32(top, index);
    }
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best_value) best_value = x[i], best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "logits (rows, vocab) float32, contiguous, vocab > 0");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  tokenway_native::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) o[row] = argmax_row(x + row * n, n);
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "gate_up (T, 2 * intermediate) float32, contiguous");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  tokenway_native::parallel_for(0, rows, 4, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const float* gate = src + row * 2 * width;
      const float* up = gate + width;
      float* o = dst + row * width;
      int64_t i = 0;
      for (; i + W <= width; i += W) {  // vectorised e^-g (vec.h, ~1 ulp, as torch's own vectorised silu)
        const Vec g = vload(gate + i);
        vstore(o + i, vmul(vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g)))), vload(up + i)));
      }
      for (; i < width; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenway_fused, m) {
  m.def("rope_and_cache(Tensor qkv, Tensor cos_table, Tensor sin_table, Tensor positions, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int heads, int kv_heads) -> Tensor",
        &rope_and_cache);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows);
}
