// A decode step's decoder layers in one native call.
//
// A decode-only step at one token is ~8 operator calls a layer (qkv, RoPE + cache writes,
// attention, o, two residual norms, gate_up, silu * up, down): 240 for SmolLM2's 30 layers,
// each a Python call and a dispatch of a few microseconds around kernels that, at one token,
// run little longer. This loop makes those calls from C++ through the dispatcher (well under a
// microsecond each), to the same operators the Python path calls (quant.cpp, fused.cpp,
// attention.cpp), in the same order with the same arguments, so its output is the Python
// path's bit for bit.
//
//   Stack(tensors, ints, eps, scale, products)   built once per model and KV cache:
//     tensors: cos_table, sin_table, then per layer
//              input_norm, post_norm, k_cache, v_cache, and for each part of qkv, o, gate_up, down
//              weight (quant.cpp's tiles), bias (an empty tensor: no bias)
//     ints:    heads, kv_heads, head_dim, block_size, then per layer and matmul its number of
//              parts, then per part (n, qtype: its GGML type id): each matmul may be of its own
//              block type, and a fused one of several (a Q4_K_M file's Q6_K v beside Q4_K q and
//              k), each part writing its columns of one output as models/decoder.ConcatKernel does
//   decode(stack, x, positions, slot_mapping, block_tables, context_lens, prefix_leaders?, prefix_lens?,
//          h?, first_layer, wake_fd) -> (h, next_layer)
//     x (T, hidden) float32 embeddings of T decode tokens -> (T, hidden) float32 hidden states
//     before the final norm (x + residual of the last layer), as LlamaForCausalLM.forward, when
//     next_layer is the number of layers. With wake_fd >= 0 the loop stops early, between two
//     layers, once that file descriptor is readable (a request arrived for the engine, which may
//     run a step of its own before this one goes on): next_layer is then the first layer not
//     run, x holds the residual stream and h the last layer's output; pass both back, with
//     first_layer = next_layer, to go on. The layers run and their order are the same either
//     way, so the output is too.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <poll.h>

#include <cstdint>
#include <tuple>
#include <optional>
#include <string>
#include <vector>

#include "pool.h"

namespace {

constexpr int kMatmuls = 4;  // qkv, o, gate_up, down
constexpr int kPerLayer = 4;  // input_norm, post_norm, k_cache, v_cache; then the matmuls' parts
constexpr int kHeader = 4;    // heads, kv_heads, head_dim, block_size

struct Part {
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  int64_t n = 0, qtype = 0;
};

// One matmul's parts, side by side in its output's columns.
struct Matmul {
  std::vector<Part> parts;
  int64_t n = 0;  // all parts' columns
};

struct Layer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  Matmul qkv, o, gate_up, down;
};

struct Stack : torch::CustomClassHolder {
  at::Tensor cos_table, sin_table;
  std::vector<Layer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, block_size = 0;
  double eps = 0.0, scale = 0.0;
  std::string products;

  Stack(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, double eps, double scale, std::string products)
      : eps(eps), scale(scale), products(std::move(products)) {
    TORCH_CHECK(tensors.size() >= 2 && ints.size() >= kHeader,
                "tensors: cos_table, sin_table, then per layer; ints: heads, kv_heads, head_dim, block_size, then "
                "per layer");
    cos_table = tensors[0], sin_table = tensors[1];
    heads = ints[0], kv_heads = ints[1], head_dim = ints[2], block_size = ints[3];
    TORCH_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && block_size > 0, "positive shapes");
    size_t t = 2, i = kHeader;  // the next tensor and int
    while (t < tensors.size()) {
      TORCH_CHECK(t + kPerLayer <= tensors.size(), "tensors: ", kPerLayer, " per layer before its matmuls");
      Layer layer{tensors[t], tensors[t + 1], tensors[t + 2], tensors[t + 3], {}, {}, {}, {}};
      t += kPerLayer;
      for (Matmul* matmul : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
        TORCH_CHECK(i < ints.size() && ints[i] > 0, "ints: each matmul's number of parts (at least one)");
        const int64_t num_parts = ints[i++];
        TORCH_CHECK(i + 2 * num_parts <= ints.size() && t + 2 * num_parts <= tensors.size(),
                    "a (weight, bias) tensor pair and an (n, qtype) int pair per part");
        for (int64_t p = 0; p < num_parts; ++p, t += 2, i += 2) {
          const at::Tensor& bias = tensors[t + 1];
          matmul->parts.push_back(
              Part{tensors[t], bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt, ints[i], ints[i + 1]});
          matmul->n += ints[i];
        }
      }
      layers.push_back(std::move(layer));
    }
    TORCH_CHECK(!layers.empty() && i == ints.size(), "ints: ", ints.size() - i, " left over after the last layer");
  }
};

// The operators, found once: their libraries are loaded (native.load) before a Stack is built.
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, c10::string_view,
                                      const std::optional<at::Tensor>&)>
      quant_linear;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, int64_t, int64_t, c10::string_view,
                                const std::optional<at::Tensor>&, at::Tensor)>
      quant_linear_out;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      at::Tensor, at::Tensor, const at::Tensor&, int64_t, int64_t)>
      rope_and_cache;
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, const at::Tensor&, double)> add_rms_norm_;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, int64_t, double, const std::optional<at::Tensor>&,
                                      const std::optional<at::Tensor>&, int64_t)>
      attention;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      return Ops{
          d.findSchemaOrThrow("tokenway_quant::quant_linear", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, c10::string_view,
                                const std::optional<at::Tensor>&)>(),
          d.findSchemaOrThrow("tokenway_quant::quant_linear_out", "")
              .typed<void(const at::Tensor&, const at::Tensor&, int64_t, int64_t, c10::string_view,
                          const std::optional<at::Tensor>&, at::Tensor)>(),
          d.findSchemaOrThrow("tokenway_fused::rope_and_cache", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                at::Tensor, at::Tensor, const at::Tensor&, int64_t, int64_t)>(),
          d.findSchemaOrThrow("tokenway_fused::add_rms_norm_", "")
              .typed<void(at::Tensor, at::Tensor, const at::Tensor&, double)>(),
          d.findSchemaOrThrow("tokenway_fused::silu_and_mul", "").typed<at::Tensor(const at::Tensor&)>(),
          d.findSchemaOrThrow("tokenway_fused::rms_norm", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
          d.findSchemaOrThrow("tokenway_attention::paged_decode_attention", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t, double, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, int64_t)>(),
      };
    }();
    return ops;
  }
};

// Whether fd has something to read (or was closed): poll(2) without waiting, ~1 us.
bool readable(int64_t fd) {
  struct pollfd p = {static_cast<int>(fd), POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

std::tuple<at::Tensor, int64_t> decode(const c10::intrusive_ptr<Stack>& s, const at::Tensor& x,
                                       const at::Tensor& positions, const at::Tensor& slot_mapping,
                                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                                       const std::optional<at::Tensor>& prefix_leaders,
                                       const std::optional<at::Tensor>& prefix_lens,
                                       const std::optional<at::Tensor>& h_in, int64_t first_layer, int64_t wake_fd) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x (T, hidden) float32");
  const int64_t num_layers = static_cast<int64_t>(s->layers.size());
  TORCH_CHECK(first_layer >= 0 && first_layer < num_layers, "first_layer out of range");
  TORCH_CHECK(first_layer == 0 || h_in.has_value(), "going on from a layer takes the h it stopped with");
  const Ops& ops = Ops::get();
  const int64_t tokens = x.size(0), q_size = s->heads * s->head_dim;
  const c10::string_view products(s->products);
  auto linear = [&](const at::Tensor& input, const Matmul& w) {
    if (w.parts.size() == 1) {
      const Part& part = w.parts[0];
      return ops.quant_linear.call(input, part.weight, part.n, part.qtype, products, part.bias);
    }
    at::Tensor out = at::empty({tokens, w.n}, input.options().dtype(at::kFloat));
    int64_t column = 0;
    for (const Part& part : w.parts) {
      ops.quant_linear_out.call(input, part.weight, part.n, part.qtype, products, part.bias,
                                out.narrow(1, column, part.n));
      column += part.n;
    }
    return out;
  };
  // The residual add of each layer is fused into the next layer's input norm (llama.py forward_fused).
  at::Tensor residual = x;
  at::Tensor h = first_layer == 0 ? at::Tensor() : *h_in;
  for (int64_t l = first_layer; l < num_layers; ++l) {
    if (l > first_layer && wake_fd >= 0 && readable(wake_fd)) return {h, l};
    const Layer& layer = s->layers[l];
    if (l == 0)
      h = ops.rms_norm.call(residual, layer.input_norm, s->eps);
    else
      ops.add_rms_norm_.call(h, residual, layer.input_norm, s->eps);
    const at::Tensor q = ops.rope_and_cache.call(linear(h, layer.qkv), s->cos_table, s->sin_table, positions,
                                                 layer.k_cache, layer.v_cache, slot_mapping, s->heads, s->kv_heads);
    const at::Tensor attended = ops.attention.call(q, layer.k_cache, layer.v_cache, block_tables, context_lens,
                                                   s->block_size, s->scale, prefix_leaders, prefix_lens,
                                                   /*window=*/0);
    h = linear(attended.reshape({tokens, q_size}), layer.o);
    ops.add_rms_norm_.call(h, residual, layer.post_norm, s->eps);
    h = linear(ops.silu_and_mul.call(linear(h, layer.gate_up)), layer.down);
  }
  // h += residual on the pool's helpers (pool.h): an ATen add would wake OpenMP's team, whose
  // threads then contend for the cores with the pool's (see attention.cpp's output).
  const at::Tensor rest = residual.contiguous();
  float* out = h.data_ptr<float>();
  const float* add = rest.data_ptr<float>();
  tokenway_native::parallel_for(0, h.numel(), int64_t(1) << 15, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) out[i] += add[i];
  });
  return {h, num_layers};
}

}  // namespace

TORCH_LIBRARY(tokenway_layers, m) {
  m.class_<Stack>("Stack").def(
      torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, double, std::string>());
  m.def("decode(__torch__.torch.classes.tokenway_layers.Stack stack, Tensor(a!) x, Tensor positions, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor? prefix_leaders=None, "
        "Tensor? prefix_lens=None, Tensor? h=None, int first_layer=0, int wake_fd=-1) -> (Tensor, int)",
        &decode);
}
