// A decode step's decoder layers in one native call.
//
// A decode-only step at one token is ~8 operator calls a layer (qkv, RoPE + cache writes,
// attention, o, two residual norms, gate_up, silu * up, down; a mixture's router, top-k and
// experts instead of the MLP, QK-norm where the family norms heads): 240 for SmolLM2's 30 layers,
// each a Python call and a dispatch of a few microseconds around kernels that, at one token,
// run little longer. This loop makes those calls from C++ through the dispatcher (well under a
// microsecond each), to the same operators the Python path calls (quant.cpp, fused.cpp,
// attention.cpp), in the same order with the same arguments, so its output is the Python
// path's bit for bit. A mixture's routing runs the ATen operators experts.py's route() runs.
//
//   Stack(tensors, ints, floats, products)   built once per model and KV cache:
//     tensors: cos_table, sin_table, then per layer
//              input_norm, post_norm, k_cache, v_cache, q_norm, k_norm (empty tensors: no QK-norm),
//              sinks (heads,) float32 (empty: none; gpt-oss's),
//              then for each part of qkv and of o its weight (quant.cpp's tiles), bias (empty: none);
//              a mixture layer then router_weight (E, hidden) float32, router_bias (empty: none),
//              the experts' gate, up, down blocks, gate_bias, up_bias, down_bias (empty: none),
//              shared_gate (1, hidden) float32 (empty: no shared expert), the gate's, up's and
//              down's scales (split-scale types, experts.cpp's MXFP4_HF; empty: in the blocks);
//              then, for a dense layer or a mixture's shared expert, each part of gate_up and down
//     ints:    heads, kv_heads, head_dim, block_size, then per layer whether it slides (reads the
//              sliding layout: its own slots, tables and window), qkv's and o's number of parts
//              and per part (n, qtype: its GGML type id), then the MLP's kind (0 dense, 1 mixture);
//              a mixture then routing (0 softmax then top-k, 1 top-k then softmax), normalize,
//              top_k, num_experts, intermediate, gate_qtype, up_qtype, down_qtype, activation
//              (experts.cpp's ids); then gate_up's and down's parts as qkv's (dense or shared).
//              Each matmul may be of its own block type, and a fused one of several (a Q4_K_M
//              file's Q6_K v beside Q4_K q and k), each part writing its columns of one output as
//              models/decoder.ConcatKernel does
//     floats:  eps, scale, then per mixture layer the experts' alpha and limit (swiglu_oai)
//   decode(stack, x, positions, slot_mapping, block_tables, context_lens, prefix_leaders?, prefix_lens?,
//          h?, first_layer, wake_fd, window, sliding layout (slot_mapping, block_tables, context_lens,
//          prefix_leaders?, prefix_lens?, window)?) -> (h, next_layer)
//     x (T, hidden) float32 embeddings of T decode tokens -> (T, hidden) float32 hidden states
//     before the final norm (x + residual of the last layer), as LlamaForCausalLM.forward, when
//     next_layer is the number of layers. With wake_fd >= 0 the loop stops early, between two
//     layers, once that file descriptor is readable (a request arrived for the engine, which may
//     run a step of its own before this one goes on): next_layer is then the first layer not
//     run, x holds the residual stream and h the last layer's output; pass both back, with
//     first_layer = next_layer, to go on. The layers run and their order are the same either
//     way, so the output is too. Layers that slide read the sliding layout (AttentionMetadata.sliding)
//     for their cache writes and attention, the others the first; each layout has its window (0: none).

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

constexpr int kPerLayer = 7;  // input_norm, post_norm, k_cache, v_cache, q_norm, k_norm, sinks; then matmuls
constexpr int kHeader = 4;    // heads, kv_heads, head_dim, block_size
constexpr int kExpertTensors = 12;  // router_weight, router_bias, gate, up, down, their biases, shared_gate, scales
constexpr int kExpertInts = 9;     // routing, normalize, top_k, num_experts, inter, 3 qtypes, activation
enum MlpKind : int64_t { kDense = 0, kMixture = 1 };
enum Routing : int64_t { kSoftmaxTopk = 0, kTopkSoftmax = 1 };

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

// A mixture-of-experts MLP (models/experts.py SparseMoe): the router, then experts.cpp's op.
struct Experts {
  at::Tensor router_weight;  // (E, hidden) float32
  std::optional<at::Tensor> router_bias;
  at::Tensor gate, up, down;  // uint8 blocks (E, rows, bytes a row), as NativeExpertKernel passes them
  std::optional<at::Tensor> gate_bias, up_bias, down_bias, shared_gate;
  std::optional<at::Tensor> gate_scales, up_scales, down_scales;  // MXFP4_HF's
  int64_t routing = 0, normalize = 0, top_k = 0, num_experts = 0, inter = 0;
  int64_t gate_qtype = 0, up_qtype = 0, down_qtype = 0, activation = 0;
  double alpha = 0.0, limit = 0.0;
};

struct Layer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  std::optional<at::Tensor> q_norm, k_norm;  // (head_dim,) each, QK-norm's
  std::optional<at::Tensor> sinks;           // (heads,) float32 logits, one more softmax column each
  bool sliding = false;                      // reads the sliding layout
  Matmul qkv, o;
  Matmul gate_up, down;  // the dense MLP, or a mixture's shared expert (no parts: none)
  std::optional<Experts> experts;
};

std::optional<at::Tensor> unless_empty(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct Stack : torch::CustomClassHolder {
  at::Tensor cos_table, sin_table;
  std::vector<Layer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, block_size = 0;
  double eps = 0.0, scale = 0.0;
  std::string products;

  Stack(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats, std::string products)
      : products(std::move(products)) {
    TORCH_CHECK(tensors.size() >= 2 && ints.size() >= kHeader && floats.size() >= 2,
                "tensors: cos_table, sin_table, then per layer; ints: heads, kv_heads, head_dim, block_size, then "
                "per layer; floats: eps, scale, then per mixture layer");
    cos_table = tensors[0], sin_table = tensors[1];
    heads = ints[0], kv_heads = ints[1], head_dim = ints[2], block_size = ints[3];
    eps = floats[0], scale = floats[1];
    TORCH_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && block_size > 0, "positive shapes");
    size_t t = 2, i = kHeader, f = 2;  // the next tensor, int and float
    auto read_matmul = [&](Matmul& matmul) {
      TORCH_CHECK(i < ints.size() && ints[i] > 0, "ints: each matmul's number of parts (at least one)");
      const int64_t num_parts = ints[i++];
      TORCH_CHECK(i + 2 * num_parts <= ints.size() && t + 2 * num_parts <= tensors.size(),
                  "a (weight, bias) tensor pair and an (n, qtype) int pair per part");
      for (int64_t p = 0; p < num_parts; ++p, t += 2, i += 2) {
        matmul.parts.push_back(Part{tensors[t], unless_empty(tensors[t + 1]), ints[i], ints[i + 1]});
        matmul.n += ints[i];
      }
    };
    while (t < tensors.size()) {
      TORCH_CHECK(t + kPerLayer <= tensors.size(), "tensors: ", kPerLayer, " per layer before its matmuls");
      Layer layer;
      layer.input_norm = tensors[t], layer.post_norm = tensors[t + 1];
      layer.k_cache = tensors[t + 2], layer.v_cache = tensors[t + 3];
      layer.q_norm = unless_empty(tensors[t + 4]), layer.k_norm = unless_empty(tensors[t + 5]);
      layer.sinks = unless_empty(tensors[t + 6]);
      TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "QK-norm: both q_norm and k_norm, or neither");
      t += kPerLayer;
      TORCH_CHECK(i < ints.size() && (ints[i] == 0 || ints[i] == 1), "ints: whether each layer slides (0 or 1)");
      layer.sliding = ints[i++] == 1;
      read_matmul(layer.qkv);
      read_matmul(layer.o);
      TORCH_CHECK(i < ints.size() && (ints[i] == kDense || ints[i] == kMixture), "ints: each layer's MLP kind");
      bool shared = true;  // a dense layer's MLP, or a mixture's shared expert
      if (ints[i++] == kMixture) {
        TORCH_CHECK(t + kExpertTensors <= tensors.size() && i + kExpertInts <= ints.size() && f + 2 <= floats.size(),
                    "a mixture layer's ", kExpertTensors, " tensors, ", kExpertInts, " ints and 2 floats");
        Experts e;
        e.router_weight = tensors[t], e.router_bias = unless_empty(tensors[t + 1]);
        e.gate = tensors[t + 2], e.up = tensors[t + 3], e.down = tensors[t + 4];
        e.gate_bias = unless_empty(tensors[t + 5]), e.up_bias = unless_empty(tensors[t + 6]);
        e.down_bias = unless_empty(tensors[t + 7]), e.shared_gate = unless_empty(tensors[t + 8]);
        e.gate_scales = unless_empty(tensors[t + 9]), e.up_scales = unless_empty(tensors[t + 10]);
        e.down_scales = unless_empty(tensors[t + 11]);
        e.routing = ints[i], e.normalize = ints[i + 1], e.top_k = ints[i + 2], e.num_experts = ints[i + 3];
        e.inter = ints[i + 4], e.gate_qtype = ints[i + 5], e.up_qtype = ints[i + 6], e.down_qtype = ints[i + 7];
        e.activation = ints[i + 8];
        e.alpha = floats[f], e.limit = floats[f + 1];
        TORCH_CHECK(e.routing == kSoftmaxTopk || e.routing == kTopkSoftmax, "routing: 0 or 1");
        TORCH_CHECK(e.top_k > 0 && e.top_k <= e.num_experts, "0 < top_k <= num_experts");
        TORCH_CHECK(e.router_weight.scalar_type() == at::kFloat && e.router_weight.dim() == 2 &&
                        e.router_weight.size(0) == e.num_experts,
                    "router_weight (E, hidden) float32");
        t += kExpertTensors, i += kExpertInts, f += 2;
        shared = e.shared_gate.has_value();
        layer.experts = std::move(e);
      }
      if (shared) {
        read_matmul(layer.gate_up);
        read_matmul(layer.down);
      }
      layers.push_back(std::move(layer));
    }
    TORCH_CHECK(!layers.empty() && i == ints.size() && f == floats.size(), "ints: ", ints.size() - i,
                " and floats: ", floats.size() - f, " left over after the last layer");
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
                                      const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&)>
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
                                const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&)>(),
      };
    }();
    return ops;
  }
};

using ExpertsForward = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  int64_t, const at::Tensor&, int64_t, const at::Tensor&, int64_t, int64_t, int64_t,
                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                  const std::optional<at::Tensor>&, int64_t, double, double,
                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                  const std::optional<at::Tensor>&);

// experts.cpp's op, found on a mixture's first step (its library is loaded only for mixtures).
const c10::TypedOperatorHandle<ExpertsForward>& experts_forward() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tokenway_experts::experts_forward", "").typed<ExpertsForward>();
  return op;
}

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
                                       const std::optional<at::Tensor>& h_in, int64_t first_layer, int64_t wake_fd,
                                       int64_t window, const std::optional<at::Tensor>& sliding_slot_mapping,
                                       const std::optional<at::Tensor>& sliding_block_tables,
                                       const std::optional<at::Tensor>& sliding_context_lens,
                                       const std::optional<at::Tensor>& sliding_prefix_leaders,
                                       const std::optional<at::Tensor>& sliding_prefix_lens, int64_t sliding_window) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x (T, hidden) float32");
  const int64_t num_layers = static_cast<int64_t>(s->layers.size());
  TORCH_CHECK(first_layer >= 0 && first_layer < num_layers, "first_layer out of range");
  TORCH_CHECK(first_layer == 0 || h_in.has_value(), "going on from a layer takes the h it stopped with");
  const bool has_sliding = sliding_slot_mapping && sliding_block_tables && sliding_context_lens;
  for (const Layer& layer : s->layers)
    TORCH_CHECK(!layer.sliding || has_sliding, "a sliding layer takes the sliding layout's slots, tables and lengths");
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
    at::Tensor qkv = linear(h, layer.qkv);
    if (layer.q_norm) {  // each head of q and k RMS-normed, as Attention.project writes them back
      const int64_t kv_size = s->kv_heads * s->head_dim;
      for (auto [first, size, weight] : {std::tuple{int64_t(0), q_size, &*layer.q_norm},
                                         std::tuple{q_size, kv_size, &*layer.k_norm}}) {
        at::Tensor heads = qkv.narrow(1, first, size);
        heads.copy_(at::rms_norm(heads.reshape({tokens, -1, s->head_dim}), {s->head_dim}, *weight, s->eps)
                        .view({tokens, size}));
      }
    }
    // This layer's layout (Attention.layout): a sliding layer's slots and tables are its group's.
    const bool slides = layer.sliding;
    const at::Tensor q =
        ops.rope_and_cache.call(qkv, s->cos_table, s->sin_table, positions, layer.k_cache, layer.v_cache,
                                slides ? *sliding_slot_mapping : slot_mapping, s->heads, s->kv_heads);
    const at::Tensor attended = ops.attention.call(
        q, layer.k_cache, layer.v_cache, slides ? *sliding_block_tables : block_tables,
        slides ? *sliding_context_lens : context_lens, s->block_size, s->scale,
        slides ? sliding_prefix_leaders : prefix_leaders, slides ? sliding_prefix_lens : prefix_lens,
        slides ? sliding_window : window, layer.sinks);
    h = linear(attended.reshape({tokens, q_size}), layer.o);
    ops.add_rms_norm_.call(h, residual, layer.post_norm, s->eps);
    if (!layer.experts) {
      h = linear(ops.silu_and_mul.call(linear(h, layer.gate_up)), layer.down);
      continue;
    }
    // SparseMoe.forward: route(), the experts, then the shared expert gated by sigmoid(shared_gate(x)).
    const Experts& e = *layer.experts;
    const at::Tensor logits = at::linear(h, e.router_weight, e.router_bias);  // (T, E)
    at::Tensor ids, weights;
    if (e.routing == kTopkSoftmax) {
      auto [values, chosen] = at::topk(logits, e.top_k, -1);
      ids = chosen, weights = at::softmax(values, -1);
    } else {
      std::tie(weights, ids) = at::topk(at::softmax(logits, -1), e.top_k, -1);
      if (e.normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
    }
    at::Tensor out = experts_forward().call(h, ids, weights, e.gate, e.gate_qtype, e.up, e.up_qtype, e.down,
                                            e.down_qtype, e.num_experts, e.inter, e.gate_bias, e.up_bias,
                                            e.down_bias, e.activation, e.alpha, e.limit, e.gate_scales,
                                            e.up_scales, e.down_scales);
    if (e.shared_gate) {
      const at::Tensor gate = at::sigmoid(at::linear(h, *e.shared_gate));  // (T, 1)
      out += gate * linear(ops.silu_and_mul.call(linear(h, layer.gate_up)), layer.down);
    }
    h = out;
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
      torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>, std::string>());
  m.def("decode(__torch__.torch.classes.tokenway_layers.Stack stack, Tensor(a!) x, Tensor positions, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor? prefix_leaders=None, "
        "Tensor? prefix_lens=None, Tensor? h=None, int first_layer=0, int wake_fd=-1, int window=0, "
        "Tensor? sliding_slot_mapping=None, Tensor? sliding_block_tables=None, Tensor? sliding_context_lens=None, "
        "Tensor? sliding_prefix_leaders=None, Tensor? sliding_prefix_lens=None, int sliding_window=0) -> (Tensor, int)",
        &decode);
}
