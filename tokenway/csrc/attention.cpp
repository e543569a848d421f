// Decode attention over the paged KV cache: one query token per row, keys and values read in
// place from each row's blocks (no gather, no padding), float32 scores and softmax.
//
//   q              (B, heads, D)                float32 or bfloat16 (rows and heads may be strided)
//   k/v_cache      (num_slots, kv_heads, D)     same dtype; slot = block_id * block_size + offset
//   block_tables   (B, max_blocks) int32        each row's blocks in order; entries past its length unused
//   context_lens   (B,) int32                   keys each row attends to (its newest token included)
//   prefix_leaders (B,) int32, optional         rows sharing a cached prefix (cascade attention): each
//   prefix_lens    (B,) int32, optional         row's first prefix_lens[r] positions (whole blocks) are
//                                               the same blocks as row prefix_leaders[r]'s (0: none)
//   window         int                          > 0: each row attends to its last `window` positions only
//                                               (a sliding-window layer); a row past its window reads
//                                               no shared prefix
//   sinks          (heads,) float32, optional   a learned logit per head (gpt-oss's attention sinks): one
//                                               more softmax column whose value is zero, so it only takes
//                                               probability from the keys: out = sum_i p_i v_i with
//                                               p = softmax([scores..., sink])
//   -> out         (B, heads, D)                q's dtype
//
// The work is cut into segments: runs of context positions, each read through one block table and
// attended by a set of query rows. A row's own positions are one segment (or several, when there
// are too few rows to keep every thread busy: flash-decoding); a prefix shared by several rows is
// one segment attended by all their queries at once, so its keys and values are read and
// converted once per step for the whole group instead of once per row. Segments of one row merge
// their partial softmaxes at the end. A work item is (segment, kv head): the heads/kv_heads query
// heads of a GQA group run together. Items go to threads largest first, one at a time.
//
// bfloat16 caches on CPUs with AVX512-BF16 use vdpbf16ps (two products per lane per
// instruction, float32 sums): a 16-token key tile is transposed so that scores land one token
// per lane, and values are interleaved in token pairs against bfloat16 probabilities. Elsewhere
// keys and values are converted to float32 and go through FMAs.
//
// A sink needs no work of its own: it is a term exp(sink - max) in the denominator where a row's
// softmax is normalised (its only segment written out, or its segments merged).
//
// TOKENWAY_LIBRARY names the operator library: native.py builds variants of this file for other
// instruction sets under their own names, so they load beside this one.
//
// Vectors are 16 floats (AVX512), 8 (AVX2) or 1 (anything else): whatever -march=native allows.
// No state survives a call: unlike a torch matmul (oneDNN caches a primitive per shape), context
// lengths that change every step cost no memory.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "pool.h"

#ifndef TOKENWAY_LIBRARY
#define TOKENWAY_LIBRARY tokenway_attention
#endif

namespace {

#include "vec.h"

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

  const T* query(int row, int head) const { return q + row * q_row_stride + head * q_head_stride; }
  const int32_t* table(int row) const { return block_tables + row * max_blocks; }
  // Calls f(t, row) for the rows of one kv head at context positions pos, pos + 1, ... (count of
  // them) in a cache, walking the block table (no division per position).
  template <typename F>
  void walk(const T* cache, const int32_t* table, int kv_head, int pos, int count, F&& f) const {
    int block = pos / block_size, offset = pos % block_size;
    for (int t = 0; t < count; ++t) {
      f(t, cache + ((int64_t(table[block]) * block_size + offset) * kv_heads + kv_head) * head_dim);
      if (++offset == block_size) offset = 0, ++block;
    }
  }
  // Where `count` consecutive positions of one kv head's context, from `pos`, sit in a cache;
  // rows[count..tile) point at `zeros`.
  void locate(const T* cache, const int32_t* table, int kv_head, int pos, int count, int tile, const T* zeros,
              const T** rows) const {
    walk(cache, table, kv_head, pos, count, [&](int t, const T* row) { rows[t] = row; });
    for (int t = count; t < tile; ++t) rows[t] = zeros;
  }
  // Asks for the rows of positions [pos, end) of one kv head to be brought into the cache ahead of
  // use: the blocks of a context are scattered, so the hardware prefetcher cannot guess.
  template <int Hint>
  void prefetch(const T* cache, const int32_t* table, int kv_head, int pos, int end) const {
    walk(cache, table, kv_head, pos, end - pos, [&](int, const T* row) {
      const char* bytes = reinterpret_cast<const char*>(row);
      for (int b = 0; b < head_dim * int(sizeof(T)); b += 64) _mm_prefetch(bytes + b, static_cast<enum _mm_hint>(Hint));
    });
  }
};

// Positions per tile: keys and values are read 16 at a time (a multiple of W everywhere).
constexpr int kTile = 16;
inline int round_up(int n, int m) { return (n + m - 1) / m * m; }

// A run of context positions [begin, end) read through row `table_row`'s block table and
// attended, for every kv head, by the query heads of rows[rows_begin .. rows_begin + num_rows).
struct Segment {
  int table_row, begin, end, rows_begin, num_rows;
  int64_t partial;  // first partial slot (kv head 0, query 0); -1: its row's only segment, written out directly
};

// Per-thread scratch, sized for the largest item, allocated once per call and thread.
struct Scratch {
  std::vector<float> scores;   // (queries, positions rounded up to kTile): scores, then probabilities
  std::vector<float> q;        // (queries, head_dim): the queries as floats (float32 path)
  std::vector<float> tile;     // (kTile, head_dim): a bfloat16 tile's rows as floats (float32 path)
  std::vector<float> acc;      // (queries, head_dim): sum of probability x value, for direct output
  std::vector<float> max, sum;  // (queries,)
  std::vector<uint32_t> keys;   // (head_dim / 2, kTile): a key tile transposed (dot-product path)
  std::vector<uint16_t> probs;  // (queries, positions): probabilities in bfloat16 (dot-product path)
  std::vector<uint32_t> values; // (positions / 2, head_dim): values interleaved in token pairs (dot-product path)
  std::vector<const uint32_t*> query_pairs, prob_pairs;  // (queries,): rows as 32-bit pairs (dot-product path)
  Scratch(int queries, int head_dim, int positions)
      : scores(int64_t(queries) * positions), q(int64_t(queries) * head_dim), tile(kTile * head_dim),
        acc(int64_t(queries) * head_dim), max(queries), sum(queries), keys(head_dim / 2 * kTile + 16),
        probs(int64_t(queries) * positions + 32), values(int64_t(positions) / 2 * head_dim + 16),
        query_pairs(queries), prob_pairs(queries) {}
};

// Scores (scaled here) of `count` positions, padded to `padded`, become probabilities in place:
// the padding gets 0. Returns the max score and the probabilities' sum.
inline void softmax(float* s, int count, int padded, float scale, float* max_out, float* sum_out) {
  for (int j = 0; j < count; j += W) vstore(s + j, vmul(vload(s + j), vset(scale)));
  for (int j = count; j < padded; ++j) s[j] = -FLT_MAX;
  Vec m = vset(-FLT_MAX);
  for (int j = 0; j < padded; j += W) m = vmax(m, vload(s + j));
  const float max_score = vmaxval(m);
  Vec total = vzero(), shift = vset(max_score);
  for (int j = 0; j < padded; j += W) {
    Vec e = vexp(vsub(vload(s + j), shift));
    vstore(s + j, e);
    total = vadd(total, e);
  }
  float sum = vsum(total);
  for (int j = count; j < padded; ++j) sum -= s[j], s[j] = 0.0f;  // the padding's ~1e-38s
  *max_out = max_score;
  *sum_out = sum;
}

// ---- float32 arithmetic: keys and values converted to floats, FMAs. ----
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

// Points rows[0..kTile) at the float values of `count` positions from `pos`; rows past `count`
// read zeros. float32 caches are read in place, bfloat16 rows are converted into the tile.
template <typename T>
void read_tile(const Problem<T>& p, const T* cache, const int32_t* table, int kv_head, int pos, int count,
               const T* zeros, Scratch& scratch, const float** rows) {
  const T* src[kTile];
  p.locate(cache, table, kv_head, pos, count, kTile, zeros, src);
  for (int t = 0; t < kTile; ++t) {
    if constexpr (std::is_same_v<T, float>) {
      rows[t] = src[t];
    } else {
      float* dst = scratch.tile.data() + t * p.head_dim;
      load_row(src[t], dst, p.head_dim);
      rows[t] = dst;
    }
  }
}

// W scores of one query against W of a tile's keys.
inline Vec score_tile(const float* q, const float* const* rows, int head_dim) {
  Vec acc[W];
  for (int t = 0; t < W; ++t) acc[t] = vzero();
  for (int i = 0; i < head_dim; i += W) {
    Vec qi = vload(q + i);
    for (int t = 0; t < W; ++t) acc[t] = vfma(qi, vload(rows[t] + i), acc[t]);
  }
  return transpose_sum(acc);
}

// acc += sum over W of a tile's tokens of probs[t] * value[t] (probs of missing tokens are 0).
inline void accumulate_tile(float* acc, const float* probs, const float* const* rows, int head_dim) {
  for (int i = 0; i < head_dim; i += W) {
    Vec sums[4] = {vload(acc + i), vzero(), vzero(), vzero()};  // four chains hide the FMA latency
    for (int t = 0; t < W; ++t) sums[t % 4] = vfma(vset(probs[t]), vload(rows[t] + i), sums[t % 4]);
    vstore(acc + i, vadd(vadd(sums[0], sums[1]), vadd(sums[2], sums[3])));
  }
}

// Attention of `nq` queries over positions [begin, end) of one kv head: each query's max score,
// probability sum and unnormalised sum of probability x value (in load_row's order).
template <typename T>
void attend_float(const Problem<T>& p, const int32_t* table, int kv_head, int begin, int end,
                  const T* const* queries, int nq, float scale, const T* zeros, Scratch& scratch,
                  float* max_out, float* sum_out, float* acc) {
  const int head_dim = p.head_dim, count = end - begin, padded = round_up(count, kTile);
  float* q = scratch.q.data();
  for (int j = 0; j < nq; ++j) load_row(queries[j], q + j * head_dim, head_dim);
  const float* rows[kTile];
  float* scores = scratch.scores.data();
  for (int pos = begin; pos < end; pos += kTile) {
    read_tile(p, p.k_cache, table, kv_head, pos, std::min(kTile, end - pos), zeros, scratch, rows);
    for (int j = 0; j < nq; ++j)
      for (int t = 0; t < kTile; t += W)
        vstore(scores + j * padded + (pos - begin) + t, score_tile(q + j * head_dim, rows + t, head_dim));
  }
  for (int j = 0; j < nq; ++j) softmax(scores + j * padded, count, padded, scale, max_out + j, sum_out + j);
  std::fill(acc, acc + int64_t(nq) * head_dim, 0.0f);
  for (int pos = begin; pos < end; pos += kTile) {
    read_tile(p, p.v_cache, table, kv_head, pos, std::min(kTile, end - pos), zeros, scratch, rows);
    for (int j = 0; j < nq; ++j)
      for (int t = 0; t < kTile; t += W)
        accumulate_tile(acc + j * head_dim, scores + j * padded + (pos - begin) + t, rows + t, head_dim);
  }
}

// ---- bfloat16 dot products (AVX512-BF16). ----
#if defined(__AVX512BF16__)
constexpr bool kDotProducts = true;

// 16 x 16 32-bit elements: r[t] (row t) -> r[j] (column j).
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane k: (r2i, r2i+1) columns 4k, 4k+1 / 4k+2, 4k+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], lane k: rows 4i..4i+3 of column 4k + c
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4k + c: lane k of u[c], u[4 + c], u[8 + c], u[12 + c]
    __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Scores of NB queries (their bfloat16 pairs) against a transposed key tile: one token per lane.
template <int NB>
inline void score_block(const uint32_t* const* q, const uint32_t* keys, int pairs, float* scores, int stride) {
  __m512 acc[NB];
  for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
  for (int d = 0; d < pairs; ++d) {
    const __m512bh k = as_bh(_mm512_loadu_si512(keys + d * kTile));
    for (int j = 0; j < NB; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], k, as_bh(_mm512_set1_epi32(int(q[j][d]))));
  }
  for (int j = 0; j < NB; ++j) _mm512_storeu_ps(scores + j * stride, acc[j]);
}

// acc (NB queries x 32 values, two vectors each: token pairs interleaved as unpacklo/hi leave
// them) += probability pairs x value pairs, over `pairs` token pairs.
template <int NB>
inline void value_block(const uint32_t* const* probs, const uint32_t* values, int pairs, int row_dwords,
                        __m512* out) {
  __m512 acc[2 * NB];  // locals, so they stay in registers
  for (int j = 0; j < 2 * NB; ++j) acc[j] = _mm512_setzero_ps();
  for (int u = 0; u < pairs; ++u) {
    const __m512bh lo = as_bh(_mm512_loadu_si512(values + u * row_dwords));
    const __m512bh hi = as_bh(_mm512_loadu_si512(values + u * row_dwords + 16));
    for (int j = 0; j < NB; ++j) {
      const __m512bh pr = as_bh(_mm512_set1_epi32(int(probs[j][u])));
      acc[2 * j] = _mm512_dpbf16_ps(acc[2 * j], lo, pr);
      acc[2 * j + 1] = _mm512_dpbf16_ps(acc[2 * j + 1], hi, pr);
    }
  }
  for (int j = 0; j < 2 * NB; ++j) out[j] = acc[j];
}

// Calls block(std::integral_constant<int, n>(), j) over queries [0, nq) in blocks of n = NB,
// then one block of the rest: block sizes are compile-time, so accumulators stay in registers.
template <int NB, typename Block>
void in_blocks(int nq, Block&& block) {
  static_assert(NB == 8, "the tail below covers 1..7");
  int j = 0;
  for (; j + NB <= nq; j += NB) block(std::integral_constant<int, NB>(), j);
  switch (nq - j) {
#define TW_CASE(n) case n: block(std::integral_constant<int, n>(), j); break;
    TW_CASE(1) TW_CASE(2) TW_CASE(3) TW_CASE(4) TW_CASE(5) TW_CASE(6) TW_CASE(7)
#undef TW_CASE
    default: break;
  }
}

void score_queries(const uint32_t* const* q, const uint32_t* keys, int pairs, float* scores, int stride, int nq) {
  in_blocks<8>(nq, [&](auto block, int j) {
    score_block<decltype(block)::value>(q + j, keys, pairs, scores + int64_t(j) * stride, stride);
  });
}

// Where the 32 values of one unpacklo/unpackhi accumulator pair go in load_row's order (16 even
// elements, then 16 odd): value d sits in lane 4k + i of lo (d = 8k + i, i < 4) or of hi (d = 8k + 4 + i).
struct ValueOrder {
  alignas(64) int32_t lanes[2][16];  // [parity][m]: where value 2m + parity sits (lo lanes 0-15, hi 16-31)
  ValueOrder() {
    for (int d = 0; d < 32; ++d) lanes[d % 2][d / 2] = d % 8 < 4 ? 4 * (d / 8) + d % 8 : 16 + 4 * (d / 8) + d % 8 - 4;
  }
};
inline void store_values(const __m512* acc, float* dst) {
  static const ValueOrder order;
  _mm512_storeu_ps(dst, _mm512_permutex2var_ps(acc[0], _mm512_load_si512(order.lanes[0]), acc[1]));
  _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(acc[0], _mm512_load_si512(order.lanes[1]), acc[1]));
}

void value_queries(const uint32_t* const* probs, const uint32_t* values, int pairs, int head_dim, float* acc, int nq) {
  in_blocks<8>(nq, [&](auto block, int j) {
    constexpr int n = decltype(block)::value;
    __m512 sums[2 * n];
    for (int half = 0; half < head_dim / 32; ++half) {
      value_block<n>(probs + j, values + half * 32, pairs, head_dim, sums);
      for (int b = 0; b < n; ++b) store_values(sums + 2 * b, acc + int64_t(j + b) * head_dim + half * 32);
    }
  });
}

void attend_dot(const Problem<uint16_t>& p, const int32_t* table, int kv_head, int begin, int end,
                const uint16_t* const* queries, int nq, float scale, const uint16_t* zeros, Scratch& scratch,
                float* max_out, float* sum_out, float* acc) {
  const int head_dim = p.head_dim, pairs = head_dim / 2, count = end - begin, padded = round_up(count, kTile);
  const uint32_t** qd = scratch.query_pairs.data();
  const uint32_t** pd = scratch.prob_pairs.data();
  for (int j = 0; j < nq; ++j) qd[j] = reinterpret_cast<const uint32_t*>(queries[j]);
  uint32_t* keys = scratch.keys.data();
  float* scores = scratch.scores.data();
  const uint16_t* src[kTile];
  p.template prefetch<2>(p.k_cache, table, kv_head, begin, end);  // the whole item, into L2
  p.template prefetch<2>(p.v_cache, table, kv_head, begin, end);
  for (int pos = begin; pos < end; pos += kTile) {
    p.locate(p.k_cache, table, kv_head, pos, std::min(kTile, end - pos), kTile, zeros, src);
    for (int h = 0; h < pairs / 16; ++h) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(src[t] + 32 * h);
      transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_si512(keys + (16 * h + d) * kTile, r[d]);
    }
    score_queries(qd, keys, pairs, scores + (pos - begin), padded, nq);
  }
  // Softmax in one pass over each query's scores, probabilities stored in bfloat16; their sum is
  // taken after rounding, so the weights used sum to 1. (scale > 0: the max of the scaled scores
  // is scale times the max.)
  uint16_t* probs = scratch.probs.data();
  for (int j = 0; j < nq; ++j) {
    float* s = scores + int64_t(j) * padded;
    uint16_t* b = probs + int64_t(j) * padded;
    __m512 m = _mm512_set1_ps(-FLT_MAX);
    int i = 0;
    for (; i + 16 <= count; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
    if (i < count) m = _mm512_mask_max_ps(m, __mmask16((1u << (count - i)) - 1), m, _mm512_loadu_ps(s + i));
    const float max_score = _mm512_reduce_max_ps(m) * scale;
    const __m512 shift = _mm512_set1_ps(max_score), factor = _mm512_set1_ps(scale);
    __m512 total = _mm512_setzero_ps();
    for (i = 0; i < padded; i += 16) {
      const __mmask16 valid = i + 16 <= count ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, vexp(_mm512_fmsub_ps(_mm512_loadu_ps(s + i), factor, shift)));
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b + i), rounded);
      total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
    max_out[j] = max_score;
    sum_out[j] = _mm512_reduce_add_ps(total);
    pd[j] = reinterpret_cast<const uint32_t*>(b);
  }
  // Values in token pairs: (v[t][d], v[t + 1][d]) per 32-bit lane, in unpacklo/hi's lane order.
  uint32_t* values = scratch.values.data();
  for (int pos = begin; pos < begin + padded; pos += kTile) {
    p.locate(p.v_cache, table, kv_head, pos, std::max(0, std::min(kTile, end - pos)), kTile, zeros, src);
    for (int t = 0; t < kTile; t += 2) {
      uint32_t* dst = values + int64_t(pos - begin + t) / 2 * head_dim;
      for (int h = 0; h < head_dim / 32; ++h) {
        const __m512i a = _mm512_loadu_si512(src[t] + 32 * h), b = _mm512_loadu_si512(src[t + 1] + 32 * h);
        _mm512_storeu_si512(dst + 32 * h, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(dst + 32 * h + 16, _mm512_unpackhi_epi16(a, b));
      }
    }
  }
  value_queries(pd, values, padded / 2, head_dim, acc, nq);
}
#else
constexpr bool kDotProducts = false;
void attend_dot(const Problem<uint16_t>&, const int32_t*, int, int, int, const uint16_t* const*, int, float,
                const uint16_t*, Scratch&, float*, float*, float*) {}
#endif

// Below this many units of work (positions x (queries + kPositionCost), summed over kv heads)
// per thread, waking the pool costs more than it saves: a short single request runs on the
// calling thread.
constexpr int64_t kPositionCost = 4;  // reading and converting a position, in queries' worth of work
constexpr int64_t kMinWorkPerThread = 4096;
// Segments are cut (flash-decoding) only when there are too few to give every thread this many,
// and never below kMinChunk positions.
constexpr int64_t kItemsPerThread = 8;
constexpr int kMinChunk = 64;
// A segment's scores (queries x positions) stay within this many floats.
constexpr int64_t kMaxScores = 1 << 16;

template <typename T>
void run(const Problem<T>& p, int batch, float scale, const int32_t* leaders, const int32_t* prefix_lens, int window,
         const float* sinks) {
  const int group = p.group, head_dim = p.head_dim;
  auto cost = [](int64_t positions, int64_t queries) { return positions * (queries + kPositionCost); };
  // Rows sharing a prefix, by leader.
  std::vector<std::vector<int>> members(batch);
  std::vector<int> shared(batch, 0), first(batch, 0);  // first: the row's first position in its window
  int64_t total = 0;
  for (int row = 0; row < batch; ++row) {
    if (window > 0) first[row] = std::max(0, p.context_lens[row] - window);
    if (prefix_lens != nullptr && prefix_lens[row] > 0 && first[row] == 0)
      shared[row] = prefix_lens[row], members[leaders[row]].push_back(row);
    total += cost(p.context_lens[row] - std::max(shared[row], first[row]), group);
  }
  for (int row = 0; row < batch; ++row)
    if (!members[row].empty()) total += cost(shared[row], int64_t(members[row].size()) * group);
  total *= p.kv_heads;
  if (total == 0) return;
  const int threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / kMinWorkPerThread));
  const int64_t target = threads > 1 ? std::max(total / (threads * kItemsPerThread), cost(kMinChunk, group))
                                     : std::numeric_limits<int64_t>::max();

  std::vector<int> rows;
  std::vector<Segment> segments;
  std::vector<std::vector<std::pair<int, int>>> parts(batch);  // per row: (segment, the row's place among its rows)
  int64_t partials = 0;
  auto add = [&](int table_row, int begin, int end, const int* seg_rows, int num_rows) {
    const int64_t queries = int64_t(num_rows) * group, length = end - begin;
    const int64_t pieces = std::max<int64_t>(1, cost(length, queries) / target);
    int chunk = round_up(int((length + pieces - 1) / pieces), kTile);
    chunk = std::max(chunk, std::min(round_up(int(length), kTile), kMinChunk));
    chunk = std::min<int64_t>(chunk, std::max<int64_t>(kMinChunk, kMaxScores / queries / kTile * kTile));
    const int rows_begin = int(rows.size());
    rows.insert(rows.end(), seg_rows, seg_rows + num_rows);
    for (int b = begin; b < end; b += chunk) {
      segments.push_back({table_row, b, std::min(end, b + chunk), rows_begin, num_rows, partials});
      partials += queries * p.kv_heads;
      for (int i = 0; i < num_rows; ++i) parts[seg_rows[i]].push_back({int(segments.size()) - 1, i});
    }
  };
  for (int row = 0; row < batch; ++row)
    if (!members[row].empty()) add(row, 0, shared[row], members[row].data(), int(members[row].size()));
  for (int row = 0; row < batch; ++row) {
    const int begin = std::max(shared[row], first[row]);
    if (p.context_lens[row] == begin) continue;
    add(row, begin, p.context_lens[row], &row, 1);
    if (parts[row].size() == 1) segments[parts[row][0].first].partial = -1, partials -= int64_t(group) * p.kv_heads;
  }
  // A direct segment was the last added, so dropping its slots leaves the others' in place.

  std::vector<float> part_max(partials), part_sum(partials), part_acc(partials * head_dim);
  int max_queries = 0, max_positions = 0;
  std::vector<std::pair<int64_t, int64_t>> items;  // (cost, segment x kv_heads + kv head), largest first
  for (size_t s = 0; s < segments.size(); ++s) {
    const Segment& seg = segments[s];
    max_queries = std::max(max_queries, seg.num_rows * group);
    max_positions = std::max(max_positions, round_up(seg.end - seg.begin, kTile));
    for (int h = 0; h < p.kv_heads; ++h)
      items.push_back({cost(seg.end - seg.begin, int64_t(seg.num_rows) * group), int64_t(s) * p.kv_heads + h});
  }
  std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.first > b.first; });
  using Attend = void (*)(const Problem<T>&, const int32_t*, int, int, int, const T* const*, int, float, const T*,
                          Scratch&, float*, float*, float*);
  Attend attend = attend_float<T>;
  if constexpr (std::is_same_v<T, uint16_t>)
    if (kDotProducts && head_dim % 32 == 0) attend = attend_dot;
  // The sink's share of a softmax whose largest score is max_score (0 without sinks): with the
  // probabilities' sum it normalises the row. exp may overflow to inf (a sink far above every
  // score), which rightly leaves the row ~0.
  auto sink_term = [&](int head, float max_score) {
    return sinks == nullptr ? 0.0f : std::exp(sinks[head] - max_score);
  };
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t) {
    Scratch scratch(max_queries, head_dim, max_positions);
    std::vector<T> zeros(head_dim, T(0));
    std::vector<const T*> queries(max_queries);
    for (int64_t i; (i = next.fetch_add(1)) < int64_t(items.size());) {
      const Segment& seg = segments[items[i].second / p.kv_heads];
      const int kv_head = int(items[i].second % p.kv_heads), nq = seg.num_rows * group;
      for (int j = 0; j < nq; ++j) queries[j] = p.query(rows[seg.rows_begin + j / group], kv_head * group + j % group);
      const int64_t slot = seg.partial + int64_t(kv_head) * nq;
      float* max_out = seg.partial < 0 ? scratch.max.data() : part_max.data() + slot;
      float* sum_out = seg.partial < 0 ? scratch.sum.data() : part_sum.data() + slot;
      float* acc = seg.partial < 0 ? scratch.acc.data() : part_acc.data() + slot * head_dim;
      attend(p, p.table(seg.table_row), kv_head, seg.begin, seg.end, queries.data(), nq, scale, zeros.data(),
             scratch, max_out, sum_out, acc);
      if (seg.partial >= 0) continue;
      for (int g = 0; g < group; ++g) {
        T* dst = p.out + (int64_t(seg.table_row) * p.heads + kv_head * group + g) * head_dim;
        const float total_sum = sum_out[g] + sink_term(kv_head * group + g, max_out[g]);
        store_row(acc + g * head_dim, 1.0f / total_sum, dst, head_dim);
      }
    }
  };
  // One piece a thread, each taking items until none is left; on the pool the step's matmuls use (pool.h).
  tokenway_native::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t piece = first; piece < last; ++piece) work(piece);
  });

  // Merge each split row's partial softmaxes: rescale each to the largest max, then normalise.
  std::vector<int> split;
  for (int row = 0; row < batch; ++row)
    if (parts[row].size() > 1 || (parts[row].size() == 1 && segments[parts[row][0].first].partial >= 0)) split.push_back(row);
  if (split.empty()) return;
  const int64_t pairs = int64_t(split.size()) * p.kv_heads;
  tokenway_native::parallel_for(0, pairs, std::max<int64_t>(1, pairs / threads), [&](int64_t first, int64_t last) {
    std::vector<float> merged(head_dim);
    std::vector<int64_t> slots;
    for (int64_t pair = first; pair < last; ++pair) {
      const int row = split[pair / p.kv_heads], kv_head = int(pair % p.kv_heads);
      for (int g = 0; g < group; ++g) {
        slots.clear();
        for (auto [s, position] : parts[row]) {
          const Segment& seg = segments[s];
          slots.push_back(seg.partial + int64_t(kv_head) * seg.num_rows * group + position * group + g);
        }
        float max_score = -FLT_MAX;
        for (int64_t slot : slots) max_score = std::max(max_score, part_max[slot]);
        float total_sum = 0.0f;
        std::fill(merged.begin(), merged.end(), 0.0f);
        for (int64_t slot : slots) {
          const float weight = std::exp(part_max[slot] - max_score);
          total_sum += weight * part_sum[slot];
          const float* src = part_acc.data() + slot * head_dim;
          for (int i = 0; i < head_dim; i += W) vstore(&merged[i], vfma(vset(weight), vload(src + i), vload(&merged[i])));
        }
        total_sum += sink_term(kv_head * group + g, max_score);
        T* dst = p.out + (int64_t(row) * p.heads + kv_head * group + g) * head_dim;
        store_row(merged.data(), 1.0f / total_sum, dst, head_dim);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale, const std::optional<at::Tensor>& prefix_leaders,
                                  const std::optional<at::Tensor>& prefix_lens, int64_t window,
                                  const std::optional<at::Tensor>& sinks) {
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
  TORCH_CHECK(scale > 0, "scale must be positive");
  TORCH_CHECK(window >= 0 && window <= std::numeric_limits<int>::max(), "window must be >= 0 (0: none)");
  TORCH_CHECK(prefix_leaders.has_value() == prefix_lens.has_value(), "prefix_leaders and prefix_lens go together");
  const int32_t* leaders = nullptr;
  const int32_t* shared = nullptr;
  if (prefix_lens.has_value()) {
    TORCH_CHECK(prefix_leaders->scalar_type() == at::kInt && prefix_lens->scalar_type() == at::kInt &&
                    prefix_leaders->dim() == 1 && prefix_lens->dim() == 1 && prefix_leaders->size(0) == batch &&
                    prefix_lens->size(0) == batch && prefix_leaders->is_contiguous() && prefix_lens->is_contiguous(),
                "prefix_leaders and prefix_lens (B,) int32");
    leaders = prefix_leaders->data_ptr<int32_t>();
    shared = prefix_lens->data_ptr<int32_t>();
    for (int row = 0; row < batch; ++row) {  // a shared prefix is whole blocks its leader holds too
      if (shared[row] == 0) continue;
      const int leader = leaders[row];
      TORCH_CHECK(shared[row] > 0 && shared[row] % block_size == 0 && shared[row] <= lens[row],
                  "prefix_lens[", row, "] must be whole blocks within the context");
      TORCH_CHECK(leader >= 0 && leader <= row && leaders[leader] == leader && shared[leader] == shared[row],
                  "prefix_leaders[", row, "] must be an earlier row leading the same prefix");
      for (int64_t b = 0; b < shared[row] / block_size; ++b)
        TORCH_CHECK(tables[row * max_blocks + b] == tables[leader * max_blocks + b],
                    "row ", row, " does not hold its leader's prefix block ", b);
    }
  }
  const float* sink_logits = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == heads && sinks->is_contiguous(),
                "sinks (heads,) float32");
    sink_logits = sinks->data_ptr<float>();
  }
  // Every row with a context is written whole by run(); an empty context reads nothing, so its row
  // is zeros. at::zeros would fill the whole output on OpenMP's team, whose threads then contend
  // for the cores with the pool's helpers: with (16, 32, 128) outputs (an 8B at 16 streams) that
  // one fill per layer cost more than the layer's attention.
  at::Tensor out = at::empty({batch, heads, head_dim}, q.options());
  const int64_t row_bytes = int64_t(heads) * head_dim * int64_t(q.element_size());
  for (int row = 0; row < batch; ++row)
    if (lens[row] == 0) std::memset(static_cast<char*>(out.data_ptr()) + row * row_bytes, 0, size_t(row_bytes));
  auto problem = [&](auto* elem) {
    using T = std::remove_pointer_t<decltype(elem)>;
    return Problem<T>{reinterpret_cast<const T*>(q.data_ptr()), q.stride(0), q.stride(1),
                      reinterpret_cast<const T*>(k_cache.data_ptr()), reinterpret_cast<const T*>(v_cache.data_ptr()),
                      tables, max_blocks, lens, reinterpret_cast<T*>(out.data_ptr()),
                      heads, kv_heads, heads / kv_heads, head_dim, int(block_size)};
  };
  if (q.scalar_type() == at::kFloat)
    run(problem(static_cast<float*>(nullptr)), batch, float(scale), leaders, shared, int(window), sink_logits);
  else
    run(problem(static_cast<uint16_t*>(nullptr)), batch, float(scale), leaders, shared, int(window), sink_logits);
  return out;
}

}  // namespace

// TORCH_LIBRARY stringizes its argument: one more expansion makes it the macro's value.
#define TOKENWAY_DEFINE_LIBRARY(name, m) TORCH_LIBRARY(name, m)
TOKENWAY_DEFINE_LIBRARY(TOKENWAY_LIBRARY, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, Tensor? prefix_leaders=None, "
        "Tensor? prefix_lens=None, int window=0, Tensor? sinks=None) -> Tensor",
        &paged_decode_attention);
}
