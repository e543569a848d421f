// Matmuls on GGUF-quantized weights, read as they are stored (never kept as floats):
//
//   y (T, N) = x (T, K) @ W.T (+ bias),  W (N, K) in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks
//
// models/quant.py relays each GGUF weight once at load into rows in groups of 16, a vector lane
// each (quant_format.h has the layout and the exact weights), so 16 rows' products accumulate side
// by side and a block's scales apply to all 16 at once, with no horizontal sum per row.
// quant_tiles.h has the kernels for one group and a tile of tokens, for each kind of products:
// int8 (quant_int8.h: activations quantized per block of 32, or of 256 for the K-quants, as
// llama.cpp's Q8 dot products), bfloat16 and float32. They are written once over 16-lane vectors
// (quant_simd.h): one AVX512 register or two AVX2 ones. Elsewhere a scalar loop computes float32 products from the decoded rows.
//
// Work: groups of 16 rows in chunks (parallel, on the helper threads of pool.h, which this
// library owns; a chunk's weights stay in L2 across token tiles), tokens in tiles of up to 8 (4
// with AVX2's 16 registers).
//
// TOKENWAY_LIBRARY names the operator library: native.py builds variants of this file for other
// instruction sets (TOKENWAY_NATIVE_ISA) under their own names, so they load beside this one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "pool.h"

#ifndef TOKENWAY_LIBRARY
#define TOKENWAY_LIBRARY tokenway_quant
#endif

namespace {

using tokenway_native::ChunkPool;

// This process's pool (pool.h): a forked child has none of its parent's helper threads.
ChunkPool& pool() {
  static std::mutex made;
  static ChunkPool* instance = nullptr;  // never freed: its detached helpers outlive any owner
  const std::lock_guard<std::mutex> lock(made);
  if (instance == nullptr || instance->owner() != getpid()) instance = new ChunkPool(getpid());
  return *instance;
}

#include "vec.h"
#include "quant_format.h"
#include "quant_simd.h"

// The precision activations meet the weights in (the weights are always exact).
enum class Products { kFloat32, kBFloat16, kInt8 };

constexpr int64_t kChunkBytes = 96 * 1024;  // weight bytes per work item

#if defined(TOKENWAY_QUANT_VECTOR)
#include "quant_tiles.h"
#include "quant_int8.h"

constexpr bool kFast = true;

// x_is_float: a float32 x for bfloat16 products, rounded here (to nearest even, as torch's
// .to(torch.bfloat16)) rather than by a separate torch op per matmul.
Activations prepare(QType qtype, const void* x, bool x_is_float, Products products, int64_t tokens, int64_t k) {
  Activations a;
  a.x = x;
  if (products == Products::kInt8) {
    quantize_int8(qtype, x, x_is_float, tokens, k, a);
    return a;
  }
  const bool bf16 = products == Products::kBFloat16;
  if (bf16 && x_is_float) {
    a.xb.resize(tokens * k);
    const float* src = static_cast<const float*>(x);
    for (int64_t i = 0; i < tokens * k; ++i) a.xb[i] = c10::BFloat16(src[i]).x;
    a.x = x = a.xb.data();
  }
  a.sums.resize(tokens * k / 16);
  for (int64_t i = 0; i < tokens * k / 16; ++i) {
    float sum = 0.0f;
    for (int e = 0; e < 16; ++e)
      sum += bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i * 16 + e]) : static_cast<const float*>(x)[i * 16 + e];
    a.sums[i] = sum;
  }
  if (bf16 && qtype == QType::Q8_0) {
    a.x16.resize(tokens * k);
    const uint16_t* src = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < tokens * k; ++i) {
      const uint16_t bits = src[i];
      // 16 x: exponent + 4, exact. Zeros and subnormals (vdpbf16ps reads them as zero) stay, and so
      // do infinities, NaNs and values too large to scale (past 2^123: never an activation).
      const uint16_t exponent = bits & 0x7F80;
      a.x16[i] = exponent == 0 || exponent >= (0xFF - 4) << 7 ? bits : uint16_t(bits + (4 << 7));
    }
  }
  return a;
}

// Groups g.. (of `left`) times a tile of TT tokens; returns how many groups it took.
template <QType Q, Products P, int TT>
inline int group_tile(const Weights& w, int64_t g, int64_t left, const Activations& a, int64_t t0, float* y,
                      int64_t ldy) {
  if constexpr (P == Products::kInt8 && format_of(Q).k_quant) {
    // Two groups in whole tiles only: a tile of fewer tokens, reading its weights from memory
    // (decode), goes faster as one stream than as two.
    if (kGroupsAtOnce == 2 && TT == kMaxTile && left >= 2) {
      tile_int8_k<Q, TT, kGroupsAtOnce>(w, g, a, t0, y, ldy);
      return kGroupsAtOnce;
    }
    tile_int8_k<Q, TT, 1>(w, g, a, t0, y, ldy);
    return 1;
  }
  if constexpr (P == Products::kInt8 && !format_of(Q).k_quant) tile_int8<Q, TT>(w, g, a, t0, y, ldy);
#if defined(TOKENWAY_QUANT_BF16)
  if constexpr (P == Products::kBFloat16) tile_bf16<Q, TT>(w, g, a, t0, y, ldy);
#endif
  if constexpr (P == Products::kFloat32) tile_fp32<Q, TT>(w, g, a, t0, y, ldy);
  return 1;
}

template <QType Q, Products P>
void groups_times_tokens(const Weights& w, int64_t group_begin, int64_t group_end, const Activations& a,
                         int64_t tokens, float* y, int64_t ldy) {
  // Whole tiles, then the rest in tiles of 4, 2 and 1 (a chunk's weights are in L2 by then).
  for (int64_t t0 = 0; t0 < tokens;) {
    const int tile = token_tile(tokens - t0);
    for (int64_t g = group_begin; g < group_end;) {
      const int64_t left = group_end - g;
      switch (tile) {
        case 8: if constexpr (kMaxTile >= 8) g += group_tile<Q, P, 8>(w, g, left, a, t0, y, ldy); break;
        case 4: g += group_tile<Q, P, 4>(w, g, left, a, t0, y, ldy); break;
        case 2: g += group_tile<Q, P, 2>(w, g, left, a, t0, y, ldy); break;
        default: g += group_tile<Q, P, 1>(w, g, left, a, t0, y, ldy); break;
      }
    }
    t0 += tile;
  }
}

// x: float32 or bfloat16 (T, K); bfloat16 only for bfloat16 or int8 products. y: rows ldy apart.
void matmul(const Weights& w, const void* x, bool x_is_float, Products products, int64_t tokens, float* y,
            int64_t ldy) {
  const Activations a = prepare(w.qtype, x, x_is_float, products, tokens, w.k);
  const int64_t threads = at::get_num_threads(), groups = w.groups();
  int64_t chunks = std::max<int64_t>(threads, (groups * w.group_bytes() + kChunkBytes - 1) / kChunkBytes);
  chunks = std::min(groups, (chunks + threads - 1) / threads * threads);
  const int64_t groups_per_chunk = (groups + chunks - 1) / chunks;
  // Chunks are handed out one at a time, so a thread the OS preempts (the HTTP server and the
  // clients share these cores) holds up at most the chunk it is in; and through the pool, whose
  // caller never waits for a helper that has not started (pool.h), rather than OpenMP's team.
  with_qtype(w.qtype, [&](auto q) {
    constexpr QType Q = decltype(q)::value;
    auto run_chunk = [&](int64_t chunk) {
      const int64_t begin = chunk * groups_per_chunk, end = std::min(groups, begin + groups_per_chunk);
      if (begin >= end) return;
      switch (products) {
        case Products::kInt8: groups_times_tokens<Q, Products::kInt8>(w, begin, end, a, tokens, y, ldy); break;
        case Products::kBFloat16: groups_times_tokens<Q, Products::kBFloat16>(w, begin, end, a, tokens, y, ldy); break;
        case Products::kFloat32: groups_times_tokens<Q, Products::kFloat32>(w, begin, end, a, tokens, y, ldy); break;
      }
    };
    pool().run(chunks, int(threads), run_chunk);
  });
}

#else
constexpr bool kFast = false;
constexpr const char* kVectorIsa = "scalar";

void matmul(const Weights& w, const void* input, bool /*x_is_float: always*/, Products /*always float32*/,
            int64_t tokens, float* y, int64_t ldy);
#endif

// One decoded row at a time: the reference the tests hold the vector paths to, and the
// embedding lookup.
void decode_rows(const Weights& w, const int64_t* rows, int64_t count, float* out) {
  with_qtype(w.qtype, [&](auto q) {
    constexpr QType Q = decltype(q)::value;
    tokenway_native::parallel_for(0, count, 16, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const int64_t r = rows == nullptr ? i : rows[i];
        decode_row<Q>(w.group(r / kRows), int(r % kRows), w.k, out + i * w.k);
      }
    });
  });
}

#if !defined(TOKENWAY_QUANT_VECTOR)
void matmul(const Weights& w, const void* input, bool, Products, int64_t tokens, float* y, int64_t ldy) {
  const float* x = static_cast<const float*>(input);
  const int64_t k = w.k;
  tokenway_native::parallel_for(0, w.n, 16, [&](int64_t first, int64_t last) {
    std::vector<float> weight(k);
    for (int64_t r = first; r < last; ++r) {
      decode_rows(w, &r, 1, weight.data());
      for (int64_t t = 0; t < tokens; ++t) {
        float total = 0.0f;
        for (int64_t i = 0; i < k; ++i) total += x[t * k + i] * weight[i];
        y[t * ldy + r] = total;
      }
    }
  });
}
#endif

bool fast() { return kFast; }
std::string isa() { return kVectorIsa; }

// Which products this build computes (the vector path's; the scalar one has float32 only).
bool computes(Products products) {
  switch (products) {
    case Products::kFloat32: return true;
#if defined(TOKENWAY_QUANT_BF16)
    case Products::kBFloat16: return true;
#endif
#if defined(TOKENWAY_QUANT_VECTOR)
    case Products::kInt8: return true;
#endif
    default: return false;
  }
}

Products products_named(const std::string& name) {
  if (name == "float32") return Products::kFloat32;
  if (name == "bfloat16") return Products::kBFloat16;
  TORCH_CHECK(name == "int8", "products: float32, bfloat16 or int8, got ", name);
  return Products::kInt8;
}

bool has_products(const std::string& name) { return computes(products_named(name)); }

Weights checked_weights(const at::Tensor& weight, int64_t n, int64_t k, int64_t qtype) {
  TORCH_CHECK(weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(known_qtype(qtype), "qtype: a GGML type id of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K, got ",
              qtype);
  const Weights w{nullptr, n, k, QType(qtype)};
  const int super = format_of(w.qtype).super;
  TORCH_CHECK(n >= 0 && k > 0 && k % super == 0, "in_features must be a multiple of ", super, ", got ", k);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.numel() == w.groups() * w.group_bytes(),
              "weight: ", w.groups() * w.group_bytes(), " bytes expected for ", n, " rows of ", k,
              " in_features, got ", weight.numel());
  return Weights{weight.data_ptr<uint8_t>(), n, k, w.qtype};
}

void linear_into(const at::Tensor& x, const Weights& w, Products products, const c10::optional<at::Tensor>& bias,
                 at::Tensor& y) {
  const int64_t tokens = x.size(0);
  // bfloat16 and int8 products take a bfloat16 x as it is and a float32 one too (rounded as they read it).
  const bool as_is = products != Products::kFloat32 &&
                     (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  const at::Tensor input = (as_is ? x : x.to(at::kFloat)).contiguous();
  if (tokens == 0 || w.n == 0) return;
  matmul(w, input.data_ptr(), input.scalar_type() == at::kFloat, products, tokens, y.data_ptr<float>(), y.stride(0));
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == w.n, "bias has ", bias->numel(), " values, expected ", w.n);
    y.add_(bias->to(at::kFloat));
  }
}

Weights checked_call(const at::Tensor& x, const at::Tensor& weight, int64_t n, int64_t qtype,
                     c10::string_view products_name, Products& products) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x: (T, K) on the CPU");
  const Weights w = checked_weights(weight, n, x.size(1), qtype);
  products = products_named(std::string(products_name));
  TORCH_CHECK(computes(products), "this build has no ", std::string(products_name), " products (has_products)");
  return w;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t n, int64_t qtype,
                        c10::string_view products_name, const c10::optional<at::Tensor>& bias) {
  Products products;
  const Weights w = checked_call(x, weight, n, qtype, products_name, products);
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  linear_into(x, w, products, bias, y);
  return y;
}

// The same into out (T, N), a float32 view whose rows may be further apart (a column slice of a
// wider output: q, k and v of different block types into one qkv).
void quant_linear_out(const at::Tensor& x, const at::Tensor& weight, int64_t n, int64_t qtype,
                      c10::string_view products_name, const c10::optional<at::Tensor>& bias, at::Tensor out) {
  Products products;
  const Weights w = checked_call(x, weight, n, qtype, products_name, products);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n &&
                  (n <= 1 || out.stride(1) == 1) && (x.size(0) <= 1 || out.stride(0) >= n),
              "out: float32 (", x.size(0), ", ", n, ") with unit column stride");
  linear_into(x, w, products, bias, out);
}

// The float weight (N, K) in `dtype` (float32 or bfloat16): for long prompt chunks, where a
// GEMM library's blocked kernels beat reading each block once per token tile.
at::Tensor dequantize(const at::Tensor& weight, int64_t n, int64_t k, int64_t qtype, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  const Weights w = checked_weights(weight, n, k, qtype);
  at::Tensor out = at::empty({n, k}, weight.options().dtype(at::kFloat));
  decode_rows(w, nullptr, n, out.data_ptr<float>());
  return dtype == at::kFloat ? out : out.to(dtype);
}

// Rows `ids` of the weight as float32 (len(ids), K): a token embedding looked up in its blocks.
at::Tensor embedding(const at::Tensor& weight, int64_t n, int64_t k, int64_t qtype, const at::Tensor& ids) {
  const Weights w = checked_weights(weight, n, k, qtype);
  TORCH_CHECK(ids.dim() == 1 && !at::isFloatingType(ids.scalar_type()), "ids: 1-D integer tensor");
  const at::Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < n, "ids: ", row[i], " out of range for ", n, " rows");
  at::Tensor out = at::empty({rows.numel(), k}, weight.options().dtype(at::kFloat));
  decode_rows(w, row, rows.numel(), out.data_ptr<float>());
  return out;
}

}  // namespace

// TORCH_LIBRARY stringizes its argument: one more expansion makes it the macro's value.
#define TOKENWAY_DEFINE_LIBRARY(name, m) TORCH_LIBRARY(name, m)
TOKENWAY_DEFINE_LIBRARY(TOKENWAY_LIBRARY, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int n, int qtype, str products, Tensor? bias) -> Tensor", &quant_linear);
  m.def("quant_linear_out(Tensor x, Tensor weight, int n, int qtype, str products, Tensor? bias, Tensor(a!) out) -> ()",
        &quant_linear_out);
  m.def("fast() -> bool", &fast);
  m.def("isa() -> str", &isa);
  m.def("has_products(str products) -> bool", &has_products);
  m.def("dequantize(Tensor weight, int n, int k, int qtype, ScalarType dtype) -> Tensor", &dequantize);
  m.def("embedding(Tensor weight, int n, int k, int qtype, Tensor ids) -> Tensor", &embedding);
  // The pool's address, for the other libraries' kernels (attention.cpp) to share its helpers.
  m.def("parallel_pool() -> int", [] { return reinterpret_cast<int64_t>(&pool()); });
}
