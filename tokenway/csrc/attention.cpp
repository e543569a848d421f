// Decode attention over the paged KV cache: one query token per row, keys and values read in
// place from each row's blocks (no gather, no padding), float32 scores and softmax.
//
//   q             (B, heads, D)                 float32 or bfloat16 (rows and heads may be strided)
//   k/v_cache     (num_slots, kv_heads, D)      same dtype; slot = block_id * block_size + offset
//   block_tables  (B, max_blocks) int32         each row's blocks in order; entries past its length unused
//   context_lens  (B,) int32                    keys each row attends to (its newest token included)
//   -> out        (B, heads, D)                 q's dtype
//
// Work items are (row, kv head, chunk of the context). The heads/kv_heads query heads of a GQA
// group run together, so each key and value is loaded (and converted) once for the group. A
// chunk is the whole context unless there are too few (row, kv head) pairs to keep every thread
// busy (one long request): then contexts are cut into equal chunks whose partial softmaxes are
// merged at the end (flash-decoding).
//
// Rows that share leading blocks (a common system prompt) simply read them from cache: a layer's
// K and V of a 1,000-token prefix is 0.75 MB in bfloat16, so the second row to read it finds it
// in L2. Processing a group's queries against each shared block together measured no faster.
//
// Vectors are 16 floats (AVX512), 8 (AVX2) or 1 (anything else): whatever -march=native allows.
// No state survives a call: unlike a torch matmul (oneDNN caches a primitive per shape), context
// lengths that change every step cost no memory.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#include "vec.h"

// ---- Rows of head_dim values, as floats. ----
//
// bfloat16 rows convert pairwise into (even elements, odd elements) vectors, which costs one
// instruction per W values instead of a widening shuffle. q, keys, values and the output all go
// through load_row/store_row, so that order is the same everywhere: dot products do not depend
// on it, and store_row puts the output back in order. float32 rows are copied as they are.

inline void load_row(const uint16_t* src, float* dst, int head_dim) {
  int i = 0;
  for (; i + 2 * W <= head_dim; i += 2 * W) {
    Vec even, odd;
    load_bf16_pair(src + i, even, odd);
    vstore(dst + i, even);
    vstore(dst + i + W, odd);
  }
  for (; i < head_dim; i += W) vstore(dst + i, load_bf16(src + i));
}

inline void load_row(const float* src, float* dst, int head_dim) { std::memcpy(dst, src, head_dim * sizeof(float)); }

inline void store_row(const float* src, float factor, uint16_t* dst, int head_dim) {
  Vec f = vset(factor);
  int i = 0;
  for (; i + 2 * W <= head_dim; i += 2 * W) store_bf16_pair(dst + i, vmul(vload(src + i), f), vmul(vload(src + i + W), f));
  for (; i < head_dim; i += W) store_bf16(dst + i, vmul(vload(src + i), f));
}

inline void store_row(const float* src, float factor, float* dst, int head_dim) {
  Vec f = vset(factor);
  for (int i = 0; i < head_dim; i += W) vstore(dst + i, vmul(vload(src + i), f));
}

// ---- The kernel. ----

template <typename T>
struct Problem {
  const T* q;
  int64_t q_row_stride, q_head_stride;
  const T* k_cache;
  const T* v_cache;
  const int32_t* block_tables;
  int64_t max_blocks;
  const int32_t* context_lens;
  T* out;
  int heads, kv_heads, group, head_dim, block_size;
};

// Per-thread scratch, allocated once per call and thread.
struct Scratch {
  std::vector<float> q;       // (group, head_dim): the group's queries, scaled, as floats
  std::vector<float> scores;  // (group, chunk_len rounded up to W), then the probabilities
  std::vector<float> tile;    // (W, head_dim): a bfloat16 tile's rows as floats
  std::vector<float> zeros;   // (head_dim,): what a tile's missing tokens read
  std::vector<float> acc;     // (group, head_dim): sum of probability x value
  Scratch(int group, int head_dim, int64_t chunk_len)
      : q(group * head_dim), scores(group * ((chunk_len + W - 1) / W * W)), tile(W * head_dim),
        zeros(head_dim, 0.0f), acc(group * head_dim) {}
};

// Points rows[0..W) at the float values of `count` consecutive positions of one kv head's
// context, starting at `pos`; rows past `count` read zeros. float32 caches are read in place,
// bfloat16 rows are converted into the tile.
template <typename T>
void read_tile(const Problem<T>& p, const T* cache, const int32_t* table, int kv_head, int pos, int count,
               Scratch& scratch, const float** rows) {
  int64_t slot_stride = int64_t(p.kv_heads) * p.head_dim;
  int block = pos / p.block_size, offset = pos % p.block_size;
  for (int t = 0; t < count; ++t) {
    const T* src = cache + (int64_t(table[block]) * p.block_size + offset) * slot_stride + int64_t(kv_head) * p.head_dim;
    if constexpr (std::is_same_v<T, float>) {
      rows[t] = src;
    } else {
      float* dst = scratch.tile.data() + t * p.head_dim;
      load_row(src, dst, p.head_dim);
      rows[t] = dst;
    }
    if (++offset == p.block_size) offset = 0, ++block;
  }
  for (int t = count; t < W; ++t) rows[t] = scratch.zeros.data();
}

// W scores of one query against a tile's keys.
inline Vec score_tile(const float* q, const float* const* rows, int head_dim) {
  Vec acc[W];
  for (int t = 0; t < W; ++t) acc[t] = vzero();
  for (int i = 0; i < head_dim; i += W) {
    Vec qi = vload(q + i);
    for (int t = 0; t < W; ++t) acc[t] = vfma(qi, vload(rows[t] + i), acc[t]);
  }
  return transpose_sum(acc);
}

// acc += sum over the tile's tokens of probs[t] * value[t] (probs of missing tokens are 0).
inline void accumulate_tile(float* acc, const float* probs, const float* const* rows, int head_dim) {
  for (int i = 0; i < head_dim; i += W) {
    Vec sums[4] = {vload(acc + i), vzero(), vzero(), vzero()};  // four chains hide the FMA latency
    for (int t = 0; t < W; ++t) sums[t % 4] = vfma(vset(probs[t]), vload(rows[t] + i), sums[t % 4]);
    vstore(acc + i, vadd(vadd(sums[0], sums[1]), vadd(sums[2], sums[3])));
  }
}

// Attention of row's query group `kv_head` over context positions [begin, end): leaves the
// unnormalised sum of probability x value in scratch.acc and returns each query's max score
// and probability sum in max_out/sum_out (group,).
template <typename T>
void attend(const Problem<T>& p, int row, int kv_head, int begin, int end, float scale, Scratch& scratch,
            float* max_out, float* sum_out) {
  const int head_dim = p.head_dim, group = p.group;
  const int32_t* table = p.block_tables + row * p.max_blocks;
  const int padded = (end - begin + W - 1) / W * W;
  float* q = scratch.q.data();
  for (int g = 0; g < group; ++g) {
    const T* src = p.q + row * p.q_row_stride + (kv_head * group + g) * p.q_head_stride;
    float* dst = q + g * head_dim;
    load_row(src, dst, head_dim);
    for (int i = 0; i < head_dim; i += W) vstore(dst + i, vmul(vload(dst + i), vset(scale)));
  }
  const float* rows[W];
  float* scores = scratch.scores.data();
  for (int pos = begin; pos < end; pos += W) {
    read_tile(p, p.k_cache, table, kv_head, pos, std::min(W, end - pos), scratch, rows);
    for (int g = 0; g < group; ++g) vstore(scores + g * padded + (pos - begin), score_tile(q + g * head_dim, rows, head_dim));
  }
  for (int g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    for (int j = end - begin; j < padded; ++j) s[j] = -FLT_MAX;
    Vec m = vset(-FLT_MAX);
    for (int j = 0; j < padded; j += W) m = vmax(m, vload(s + j));
    float max_score = vmaxval(m);
    Vec total = vzero(), shift = vset(max_score);
    for (int j = 0; j < padded; j += W) {
      Vec e = vexp(vsub(vload(s + j), shift));
      vstore(s + j, e);
      total = vadd(total, e);
    }
    float sum = vsum(total);
    for (int j = end - begin; j < padded; ++j) sum -= s[j], s[j] = 0.0f;  // the padding's ~1e-38s
    max_out[g] = max_score;
    sum_out[g] = sum;
  }
  float* acc = scratch.acc.data();
  std::fill(scratch.acc.begin(), scratch.acc.end(), 0.0f);
  for (int pos = begin; pos < end; pos += W) {
    read_tile(p, p.v_cache, table, kv_head, pos, std::min(W, end - pos), scratch, rows);
    for (int g = 0; g < group; ++g) accumulate_tile(acc + g * head_dim, scores + g * padded + (pos - begin), rows, head_dim);
  }
}

// Contexts are cut into chunks of this many tokens or more (a multiple of W) only when there are
// too few (row, kv head) pairs to give every thread several.
constexpr int kMinChunk = 128;
constexpr int kItemsPerThread = 8;
// A thread gets at least this many (token, kv head) pairs: below it, waking the pool costs more
// than it saves (a short single request runs on the calling thread).
constexpr int64_t kMinWorkPerThread = 4096;

template <typename T>
void run(const Problem<T>& p, int batch, float scale) {
  int max_len = 0;
  int64_t total_len = 0;
  for (int row = 0; row < batch; ++row) max_len = std::max(max_len, p.context_lens[row]), total_len += p.context_lens[row];
  if (max_len == 0) return;
  const int threads = at::get_num_threads();
  int64_t chunk_len = max_len;
  const int64_t pairs = int64_t(batch) * p.kv_heads;
  if (threads > 1 && pairs < int64_t(kItemsPerThread) * threads) {
    int64_t splits = (int64_t(kItemsPerThread) * threads + pairs - 1) / pairs;
    chunk_len = std::max<int64_t>(kMinChunk, ((max_len + splits - 1) / splits + W - 1) / W * W);
  }
  // Items in order (row, chunk, kv head); chunk_start[row] is the row's first chunk.
  std::vector<int64_t> chunk_start(batch + 1, 0);
  for (int row = 0; row < batch; ++row)
    chunk_start[row + 1] = chunk_start[row] + (p.context_lens[row] + chunk_len - 1) / chunk_len;
  const int64_t num_chunks = chunk_start[batch];
  const int64_t num_items = num_chunks * p.kv_heads;
  const bool split = num_chunks > batch;
  // Partial results of split contexts: (item, group) max and sum, (item, group, head_dim) acc.
  std::vector<float> part_max, part_sum, part_acc;
  if (split) {
    part_max.resize(num_items * p.group);
    part_sum.resize(num_items * p.group);
    part_acc.resize(num_items * p.group * p.head_dim);
  }
  std::vector<int> item_row(num_chunks);
  for (int row = 0; row < batch; ++row)
    std::fill(item_row.begin() + chunk_start[row], item_row.begin() + chunk_start[row + 1], row);

  const int64_t work_per_item = std::max<int64_t>(1, total_len * p.kv_heads / num_items);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / work_per_item);
  at::parallel_for(0, num_items, grain, [&](int64_t first, int64_t last) {
    Scratch scratch(p.group, p.head_dim, chunk_len);
    std::vector<float> max_score(p.group), sum(p.group);
    float* acc = scratch.acc.data();
    for (int64_t item = first; item < last; ++item) {
      const int64_t chunk = item / p.kv_heads;
      const int kv_head = int(item % p.kv_heads);
      const int row = item_row[chunk];
      const int begin = int((chunk - chunk_start[row]) * chunk_len);
      const int end = int(std::min<int64_t>(begin + chunk_len, p.context_lens[row]));
      if (split) {
        attend(p, row, kv_head, begin, end, scale, scratch, part_max.data() + item * p.group,
               part_sum.data() + item * p.group);
        std::memcpy(part_acc.data() + item * p.group * p.head_dim, acc, p.group * p.head_dim * sizeof(float));
        continue;
      }
      attend(p, row, kv_head, begin, end, scale, scratch, max_score.data(), sum.data());
      for (int g = 0; g < p.group; ++g) {
        T* dst = p.out + (int64_t(row) * p.heads + kv_head * p.group + g) * p.head_dim;
        store_row(acc + g * p.head_dim, 1.0f / sum[g], dst, p.head_dim);
      }
    }
  });
  if (!split) return;
  // Merge the chunks' softmaxes: rescale each to the largest max, then normalise.
  at::parallel_for(0, pairs, std::max<int64_t>(1, pairs / threads), [&](int64_t first, int64_t last) {
    std::vector<float> merged(p.head_dim);
    for (int64_t pair = first; pair < last; ++pair) {
      const int row = int(pair / p.kv_heads), kv_head = int(pair % p.kv_heads);
      for (int g = 0; g < p.group; ++g) {
        auto index = [&](int64_t chunk) { return (chunk * p.kv_heads + kv_head) * p.group + g; };
        float max_score = -FLT_MAX;
        for (int64_t c = chunk_start[row]; c < chunk_start[row + 1]; ++c) max_score = std::max(max_score, part_max[index(c)]);
        float total = 0.0f;
        std::fill(merged.begin(), merged.end(), 0.0f);
        for (int64_t c = chunk_start[row]; c < chunk_start[row + 1]; ++c) {
          const float weight = std::exp(part_max[index(c)] - max_score);
          total += weight * part_sum[index(c)];
          const float* src = part_acc.data() + index(c) * p.head_dim;
          for (int i = 0; i < p.head_dim; i += W) vstore(&merged[i], vfma(vset(weight), vload(src + i), vload(&merged[i])));
        }
        T* dst = p.out + (int64_t(row) * p.heads + kv_head * p.group + g) * p.head_dim;
        store_row(merged.data(), 1.0f / total, dst, p.head_dim);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q (B, heads, head_dim), k_cache and v_cache (num_slots, kv_heads, head_dim)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1, "caches contiguous, q rows dense");
  const int batch = int(q.size(0)), heads = int(q.size(1)), head_dim = int(q.size(2));
  const int kv_heads = int(k_cache.size(1));
  TORCH_CHECK(k_cache.size(2) == head_dim && head_dim % 16 == 0 && head_dim <= 512, "head_dim a multiple of 16");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == batch && context_lens.dim() == 1 &&
                  context_lens.size(0) == batch && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables (B, max_blocks) and context_lens (B,) int32");
  TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0, "num_slots must be whole blocks");
  const int64_t num_blocks = k_cache.size(0) / block_size, max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int row = 0; row < batch; ++row) {  // every block a row reads is in the cache
    TORCH_CHECK(lens[row] >= 0 && lens[row] <= max_blocks * block_size, "context_lens[", row, "] out of range");
    for (int64_t b = 0; b < (lens[row] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[row * max_blocks + b] >= 0 && tables[row * max_blocks + b] < num_blocks,
                  "block_tables[", row, ", ", b, "] out of range");
  }
  at::Tensor out = at::zeros({batch, heads, head_dim}, q.options());  // zeros: an empty context reads nothing
  auto problem = [&](auto* elem) {
    using T = std::remove_pointer_t<decltype(elem)>;
    return Problem<T>{reinterpret_cast<const T*>(q.data_ptr()), q.stride(0), q.stride(1),
                      reinterpret_cast<const T*>(k_cache.data_ptr()), reinterpret_cast<const T*>(v_cache.data_ptr()),
                      tables, max_blocks, lens, reinterpret_cast<T*>(out.data_ptr()),
                      heads, kv_heads, heads / kv_heads, head_dim, int(block_size)};
  };
  if (q.scalar_type() == at::kFloat)
    run(problem(static_cast<float*>(nullptr)), batch, float(scale));
  else
    run(problem(static_cast<uint16_t*>(nullptr)), batch, float(scale));
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenway_attention, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale) -> Tensor",
        &paged_decode_attention);
}
