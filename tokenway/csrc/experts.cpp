// A mixture-of-experts layer's expert MLPs, and dense matmuls, on GGUF blocks as the file stores
// them: rows of llama.cpp's block structs, mapped in place, never relaid or copied.
//
//   experts_forward: out (T, H) = sum_j w_tj * down_e(act(gate_e(x_t) + bg_e, up_e(x_t) + bu_e)) + bd_e
//     gate, up (E, I, bytes a row), down (E, H, bytes a row), e = topk_ids[t, j]
//   raw_linear: y (T, N) = x (T, K) @ W.T (+ bias), W (N, bytes a row)
//
// A step's (token, expert) pairs are grouped by expert (a counting sort), each token's
// activations quantized once to int8, then each active expert's gate and up rows run against all
// of its tokens (each row read once a step, its tokens in tiles against it), the activation and
// its requantization, down likewise, and the weighted sum into each token's row. Work items are
// (expert, chunk of rows) over all active experts at once, on the process's pool (pool.h): one
// decode token's 8 experts keep every core busy.
//
// Block types: Q4_0, Q8_0, MXFP4, IQ4_NL (blocks of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
// (super-blocks of 256) with int8 products; F32, F16, BF16 with float32 ones. MXFP4_HF is MXFP4 as
// gpt-oss's safetensors store it: a block's 16 bytes hold its elements in pairs (2j low nibble,
// 2j + 1 high), and the scales are a tensor of their own (E, rows, blocks a row), read beside.
// A matrix's rows may lie further apart than a row's bytes (gpt-oss's gate rows are every other
// row of its fused gate_up): rows and experts are read at their tensor's strides. Activations are
// quantized as llama.cpp pairs them: per block of 32 (Q8_0) for the 32-weight types, per 256 (Q8_K)
// for the others, x ~ dx qx, qx in [-127, 127].
//
// Every weight is decoded to an unsigned code u with a per-type offset, w = s (u - off) - m, s and
// m per 16 weights (a K-quant's sub-block scale and min, or a block's scale), so that one int8 dot
// (vpdpbusd: u unsigned, qx signed) serves all types:
//   x . w = sum_lanes s dx (u . qx)  -  sum_16 (off s + m) dx sum(qx)
// The second sum is per super-block and token, from the activations' sums (bx), or for the
// 32-weight types folded into the dot's int32 start (init = -off sum(qx) per 4). Without VNNI,
// maddubs's int16 pairs saturate past 32767: codes above 128 (Q8_0, IQ4's) stay signed there and
// meet x through the sign trick (|q| . sign(x, q)) with no offset.
//
// An expert (or dense matmul) of a 32-weight type with many tokens (kDecodedMinTokens) has its rows
// decoded to float32 once and met by a float kernel on the same int8-rounded activations instead
// (decoded_rows_times_tokens). On AVX2, one of Q4_K, Q5_K, MXFP4 or Q4_0 with 8 or more tokens
// has them in groups of 8 that a row's codes meet 8 tokens a maddubs (expert_groups.h).
//
// Paths (compile time, as native.py's isa builds choose): AVX512 with VNNI (64 weights a vector),
// AVX2 (32, VNNI where present), and plain C++ (float products of decoded rows: the reference
// the tests hold the others to).
//
// TOKENWAY_LIBRARY names the operator library (native.py builds variants under their own names).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "pool.h"

#ifndef TOKENWAY_LIBRARY
#define TOKENWAY_LIBRARY tokenway_experts
#endif

namespace {

#include "vec.h"

using tokenway_native::ChunkPool;

// The quant library's pool where it is loaded (one set of helpers a process), else this one's.
ChunkPool& pool() {
  if (ChunkPool* shared = tokenway_native::find_pool()) return *shared;
  static std::mutex made;
  static ChunkPool* instance = nullptr;  // never freed: its detached helpers outlive any owner
  const std::lock_guard<std::mutex> lock(made);
  if (instance == nullptr || instance->owner() != getpid()) instance = new ChunkPool(getpid());
  return *instance;
}

// ---------------------------------------------------------------------------------------------
// Block types (GGML type ids) and their layouts.

enum class QType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23, BF16 = 30, MXFP4 = 39,
  MXFP4_HF = 1039,  // not a GGML type: expert_kernels.NATIVE_QTYPE_IDS gives it this id
};

struct Layout {
  int block;        // weights a block (super-block)
  int bytes;        // bytes a block
  bool super;       // a 256-weight super-block with per-16 scales (else a 32-weight block, one scale)
  bool is_float;    // F32, F16, BF16: float products
};

constexpr Layout layout_of(QType q) {
  switch (q) {
    case QType::F32: return {1, 4, false, true};
    case QType::F16: return {1, 2, false, true};
    case QType::BF16: return {1, 2, false, true};
    case QType::Q4_0: return {32, 18, false, false};
    case QType::Q8_0: return {32, 34, false, false};
    case QType::IQ4_NL: return {32, 18, false, false};
    case QType::MXFP4: return {32, 17, false, false};
    case QType::MXFP4_HF: return {32, 16, false, false};  // a block's nibbles; its scale apart
    case QType::Q2_K: return {256, 84, true, false};
    case QType::Q3_K: return {256, 110, true, false};
    case QType::Q4_K: return {256, 144, true, false};
    case QType::Q5_K: return {256, 176, true, false};
    case QType::Q6_K: return {256, 210, true, false};
    case QType::IQ4_XS: return {256, 136, true, false};
  }
  return {0, 0, false, false};
}

bool known_qtype(int64_t id) {
  switch (QType(id)) {
    case QType::F32: case QType::F16: case QType::BF16: case QType::Q4_0: case QType::Q8_0:
    case QType::IQ4_NL: case QType::MXFP4: case QType::MXFP4_HF: case QType::Q2_K: case QType::Q3_K:
    case QType::Q4_K: case QType::Q5_K: case QType::Q6_K: case QType::IQ4_XS: return true;
  }
  return false;
}

template <typename Fn>
void with_qtype(QType q, Fn&& fn) {
  switch (q) {
#define TOKENWAY_CASE(T) case QType::T: fn(std::integral_constant<QType, QType::T>{}); break;
    TOKENWAY_CASE(F32) TOKENWAY_CASE(F16) TOKENWAY_CASE(BF16) TOKENWAY_CASE(Q4_0) TOKENWAY_CASE(Q8_0)
    TOKENWAY_CASE(IQ4_NL) TOKENWAY_CASE(MXFP4) TOKENWAY_CASE(MXFP4_HF) TOKENWAY_CASE(Q2_K) TOKENWAY_CASE(Q3_K)
    TOKENWAY_CASE(Q4_K) TOKENWAY_CASE(Q5_K) TOKENWAY_CASE(Q6_K) TOKENWAY_CASE(IQ4_XS)
#undef TOKENWAY_CASE
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

// MXFP4's E8M0 scale, halved (its codes are e2m1 values doubled): ggml_e8m0_to_fp32_half.
constexpr float e8m0_half_of(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23;
  return __builtin_bit_cast(float, bits);
}

// All 256 of them: a block's scale is one load (a broadcast straight from the table in the tiles),
// where the conversion took a compare, a shift and a move to the vector unit, per block and row.
struct E8m0Table {
  float v[256];
  constexpr E8m0Table() : v() {
    for (int e = 0; e < 256; ++e) v[e] = e8m0_half_of(uint8_t(e));
  }
};
inline constexpr E8m0Table kE8m0Half{};

inline float e8m0_half(uint8_t e) { return kE8m0Half.v[e]; }

constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q4_K, Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes (get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q3_K's 16 6-bit scales, less 32.
inline int q3k_scale(const uint8_t* s, int h) {
  const int low = h < 8 ? s[h] & 0xF : s[h - 8] >> 4;
  const int high = (s[8 + h % 4] >> (2 * (h / 4))) & 3;
  return (low | high << 4) - 32;
}

inline int iq4xs_scale(const uint8_t* b, int i) {  // sub-block i of 32, less 32
  uint16_t high;
  std::memcpy(&high, b + 2, 2);
  return (((b[4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((high >> (2 * i)) & 3) << 4)) - 32;
}

// One block (super-block) -> its weights as float32, as llama.cpp's dequantize_row_* (up to the
// compiler's contraction of a product and a sum): the plain path's weights.
template <QType Q>
void decode_block(const uint8_t* b, float* y) {
  if constexpr (Q == QType::Q4_0 || Q == QType::IQ4_NL || Q == QType::MXFP4) {
    const float d = Q == QType::MXFP4 ? e8m0_half(b[0]) : half_at(b);
    const uint8_t* qs = b + (Q == QType::MXFP4 ? 1 : 2);
    for (int l = 0; l < 16; ++l) {
      const int lo = qs[l] & 0xF, hi = qs[l] >> 4;
      if constexpr (Q == QType::Q4_0) {
        y[l] = d * float(lo - 8), y[l + 16] = d * float(hi - 8);
      } else if constexpr (Q == QType::IQ4_NL) {
        y[l] = d * float(kIQ4Values[lo]), y[l + 16] = d * float(kIQ4Values[hi]);
      } else {
        y[l] = d * float(kMXFP4Values[lo]), y[l + 16] = d * float(kMXFP4Values[hi]);
      }
    }
  } else if constexpr (Q == QType::Q8_0) {
    const float d = half_at(b);
    for (int l = 0; l < 32; ++l) y[l] = float(int8_t(b[2 + l])) * d;
  } else if constexpr (Q == QType::Q2_K) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int i = 0; i < 8; ++i)
      for (int l = 0; l < 32; ++l) {
        const int h = 2 * i + l / 16, q = (b[16 + 32 * (i / 4) + l] >> (2 * (i % 4))) & 3;
        y[32 * i + l] = d * float(b[h] & 0xF) * float(q) - dmin * float(b[h] >> 4);
      }
  } else if constexpr (Q == QType::Q3_K) {
    const float d = half_at(b + 108);
    for (int i = 0; i < 8; ++i)
      for (int l = 0; l < 32; ++l) {
        const int h = 2 * i + l / 16, low = (b[32 + 32 * (i / 4) + l] >> (2 * (i % 4))) & 3;
        const int q = low - ((b[l] >> i) & 1 ? 0 : 4);
        y[32 * i + l] = d * float(q3k_scale(b + 96, h)) * float(q);
      }
  } else if constexpr (Q == QType::Q4_K || Q == QType::Q5_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* qs = b + (Q == QType::Q5_K ? 48 : 16);
    for (int i = 0; i < 8; ++i) {
      int sc, m;
      scale_min_k4(i, b + 4, sc, m);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 0xF;
        if constexpr (Q == QType::Q5_K) q |= ((b[16 + l] >> i) & 1) << 4;
        y[32 * i + l] = d * float(sc) * float(q) - dmin * float(m);
      }
    }
  } else if constexpr (Q == QType::Q6_K) {
    const float d = half_at(b + 208);
    for (int i = 0; i < 8; ++i) {
      const int n = i / 4, j = i % 4;
      for (int l = 0; l < 32; ++l) {
        const int low = (b[64 * n + 32 * (j % 2) + l] >> (4 * (j / 2))) & 0xF;
        const int high = (b[128 + 32 * n + l] >> (2 * j)) & 3;
        y[32 * i + l] = d * float(int8_t(b[192 + 2 * i + l / 16])) * float((low | high << 4) - 32);
      }
    }
  } else if constexpr (Q == QType::IQ4_XS) {
    const float d = half_at(b);
    for (int i = 0; i < 8; ++i) {
      const float dl = d * float(iq4xs_scale(b, i));
      for (int l = 0; l < 16; ++l) {
        const uint8_t q = b[8 + 16 * i + l];
        y[32 * i + l] = dl * float(kIQ4Values[q & 0xF]);
        y[32 * i + l + 16] = dl * float(kIQ4Values[q >> 4]);
      }
    }
  } else if constexpr (Q == QType::F32) {
    std::memcpy(y, b, 4);
  } else if constexpr (Q == QType::F16) {
    y[0] = half_at(b);
  } else if constexpr (Q == QType::BF16) {
    uint16_t bits;
    std::memcpy(&bits, b, 2);
    y[0] = bf16_to_float(bits);
  }
}

// Whether a type's block scales lie in a tensor of their own (one byte a block, `scales`).
constexpr bool split_scales(QType q) { return q == QType::MXFP4_HF; }

// One row -> k floats; `scales` the row's scales where split_scales(Q), else unused.
template <QType Q>
void decode_row(const uint8_t* row, const uint8_t* scales, int64_t k, float* y) {
  constexpr Layout L = layout_of(Q);
  if constexpr (Q == QType::F32) {
    std::memcpy(y, row, k * 4);
  } else if constexpr (split_scales(Q)) {
    for (int64_t b = 0; b < k / 32; ++b) {
      const float d = e8m0_half(scales[b]);
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = row[16 * b + j];
        y[32 * b + 2 * j] = d * float(kMXFP4Values[q & 0xF]);
        y[32 * b + 2 * j + 1] = d * float(kMXFP4Values[q >> 4]);
      }
    }
  } else {
    for (int64_t b = 0; b < k / L.block; ++b) decode_block<Q>(row + b * L.bytes, y + b * L.block);
  }
}

// ---------------------------------------------------------------------------------------------
// Activations, quantized once for every matrix of their kind that reads them.

struct Acts {
  int64_t k = 0, kp = 0;        // features, and the row stride: k rounded up to 64 (zeros past k)
  std::vector<int8_t> xq;       // (n, kp) int8 codes
  std::vector<float> dxe;       // (n, kp / 4) the scale dx of each 4 codes' block
  std::vector<int32_t> init;    // (n, kp / 4) -offset x the sum of each 4 codes (32-weight types)
  std::vector<float> bx;        // (n, kp / 16) dx x the sum of each 16 codes (super-block types, float scales)
  std::vector<int16_t> bsum;    // (n, kp / 16) the sum of each 16 codes (super-block types, kIntScales)
  std::vector<float> xf;        // (n, kp) float: float weights' x, or the plain path's dx qx
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TOKENWAY_EXPERTS_VECTOR 1
#define TOKENWAY_EXPERTS_512 1
constexpr const char* kIsa = "avx512";
constexpr bool kVnni = true;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENWAY_EXPERTS_VECTOR 1
constexpr const char* kIsa = "avx2";
#if defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
#else
constexpr const char* kIsa = "scalar";
constexpr bool kVnni = false;
#endif

#if defined(TOKENWAY_EXPERTS_VECTOR)
constexpr bool kVector = true;
#else
constexpr bool kVector = false;
#endif

// Without VNNI a unit's products are int16 pairs (maddubs) first anyway: the second step, madd,
// can take the sub-blocks' integer scales instead of ones, so that a super-block's int32 sums
// carry its scales and meet d dx once (llama.cpp's AVX2 K-quant dots), not a convert and an FMA
// a unit. Codes below 64 or signed (the sign trick), scales a signed byte: a lane's sum over a
// super-block stays under 8 x 4 x 127 x 127 x 128 < 2^31.
constexpr bool kIntScales = kVector && !kVnni;

// Types whose codes meet x signed (no VNNI: maddubs would saturate on codes past 128).
constexpr bool signed_codes(QType q) {
  return !kVnni && (q == QType::Q8_0 || q == QType::IQ4_NL || q == QType::IQ4_XS);
}

// The offset of a type's unsigned codes: w = s (u - offset) - m.
constexpr int offset_of(QType q) {
  if (signed_codes(q)) return 0;
  switch (q) {
    case QType::Q4_0: return 8;
    case QType::Q8_0: case QType::IQ4_NL: case QType::IQ4_XS: return 128;
    case QType::MXFP4: case QType::MXFP4_HF: return 12;
    case QType::Q6_K: return 32;
    case QType::Q3_K: return 4;
    default: return 0;
  }
}

// What a type's activations look like: the block of their int8 scales, and the offset folded into
// init. Two types with the same kind read the same activations.
struct ActKind {
  int block;  // 0: float activations
  int offset;
  bool interleaved;  // pairs of blocks as interleaved_position lays them
  bool operator==(const ActKind& o) const {
    return block == o.block && offset == o.offset && interleaved == o.interleaved;
  }
};

// With AVX512 a vector holds two 32-weight blocks. The nibble types' 16 bytes a block decode
// cheapest as [low nibbles of block 0 | of block 1 | high nibbles of block 0 | of block 1] (one
// broadcast, one shift, one table lookup): their activations are laid out to match.
constexpr bool interleaved(QType q) {
#if defined(TOKENWAY_EXPERTS_512)
  return q == QType::Q4_0 || q == QType::IQ4_NL || q == QType::MXFP4;
#else
  return q != q;  // AVX2 and plain: one block a vector, in order
#endif
}

// Where element i (of 32) of the block starting at b0 goes in its pair of blocks.
inline int64_t interleaved_position(int64_t b0, int i) {
  return b0 / 64 * 64 + ((i / 16) * 2 + (b0 / 32) % 2) * 16 + i % 16;
}

ActKind act_kind(QType q) {
  const Layout L = layout_of(q);
  if (L.is_float) return {0, 0, false};
  if (L.super) return {256, 0, false};
  return {32, offset_of(q), interleaved(q)};
}

// x (n rows, ldx apart, of k floats) -> a, for matrices of kind `kind`. Rows in parallel.
void quantize_acts(const float* x, int64_t n, int64_t ldx, int64_t k, ActKind kind, Acts& a) {
  a.k = k;
  a.kp = (k + 63) / 64 * 64;
  const int64_t kp = a.kp;
  const bool float_weights = kind.block == 0;
  if (float_weights || !kVector) a.xf.assign(n * kp, 0.0f);
  if (!float_weights && kVector) {
    a.xq.assign(n * kp, 0);
    a.dxe.assign(n * kp / 4, 0.0f);
    if (kind.block == 32) a.init.assign(n * kp / 4, 0);
    else if (kIntScales) a.bsum.assign(n * kp / 16, 0);
    else a.bx.assign(n * kp / 16, 0.0f);
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(k, 1));
  tokenway_native::parallel_for(0, n, grain, [&](int64_t first, int64_t last) {
    int8_t q[256];
    for (int64_t t = first; t < last; ++t) {
      const float* xt = x + t * ldx;
      if (float_weights) {
        std::memcpy(a.xf.data() + t * kp, xt, k * sizeof(float));
        continue;
      }
      const int block = kind.block;
      for (int64_t b0 = 0; b0 < k; b0 += block) {
        float amax = 0.0f;
        for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xt[b0 + i]));
        const float dx = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < block; ++i) q[i] = int8_t(std::nearbyint(xt[b0 + i] * inverse));
        if (!kVector) {
          for (int i = 0; i < block; ++i) a.xf[t * kp + b0 + i] = dx * float(q[i]);
          continue;
        }
        for (int i = 0; i < block; i += 4) {  // 4 neighbours stay neighbours, interleaved or not
          const int64_t at = t * kp + (kind.interleaved ? interleaved_position(b0, i) : b0 + i);
          std::memcpy(a.xq.data() + at, q + i, 4);
          const int32_t sum4 = q[i] + q[i + 1] + q[i + 2] + q[i + 3];
          a.dxe[at / 4] = dx;
          if (block == 32) a.init[at / 4] = -kind.offset * sum4;
        }
        if (block == 256)
          for (int h = 0; h < 16; ++h) {
            int32_t sum = 0;
            for (int i = 0; i < 16; ++i) sum += q[16 * h + i];
            if (kIntScales) a.bsum[(t * kp + b0) / 16 + h] = int16_t(sum);  // |sum| <= 16 x 127
            else a.bx[(t * kp + b0) / 16 + h] = dx * float(sum);
          }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The vector paths: one unit of kUnit weights a vector (64 with AVX512, 32 with AVX2).

#if defined(TOKENWAY_EXPERTS_VECTOR)

// 16 bytes of nibbles -> 32 codes: the low nibbles (elements 0-15), then the high ones (16-31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// A 16-entry table of codes, in both 128-bit lanes (vpshufb looks up within a lane).
template <int Add>
inline __m256i table16(const int8_t (&values)[16]) {
  return _mm256_setr_epi8(
      char(values[0] + Add), char(values[1] + Add), char(values[2] + Add), char(values[3] + Add), char(values[4] + Add),
      char(values[5] + Add), char(values[6] + Add), char(values[7] + Add), char(values[8] + Add), char(values[9] + Add),
      char(values[10] + Add), char(values[11] + Add), char(values[12] + Add), char(values[13] + Add),
      char(values[14] + Add), char(values[15] + Add), char(values[0] + Add), char(values[1] + Add),
      char(values[2] + Add), char(values[3] + Add), char(values[4] + Add), char(values[5] + Add), char(values[6] + Add),
      char(values[7] + Add), char(values[8] + Add), char(values[9] + Add), char(values[10] + Add),
      char(values[11] + Add), char(values[12] + Add), char(values[13] + Add), char(values[14] + Add),
      char(values[15] + Add));
}

inline __m256i shr16(__m256i v, int s) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(s)); }

// The 32 codes of chunk i (of 32 weights) of a block: u = w / s + offset, unsigned; or, for
// signed_codes(Q), the signed codes w / s.
template <QType Q>
inline __m256i decode32(const uint8_t* b, int i) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (Q == QType::Q4_0) {
    return nibbles32(b + 2);
  } else if constexpr (Q == QType::Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    return signed_codes(Q) ? q : _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));
  } else if constexpr (Q == QType::IQ4_NL || Q == QType::IQ4_XS) {
    const __m256i table = table16<signed_codes(Q) ? 0 : 128>(kIQ4Values);
    const uint8_t* qs = Q == QType::IQ4_NL ? b + 2 : b + 8 + 16 * i;
    return _mm256_shuffle_epi8(table, nibbles32(qs));
  } else if constexpr (Q == QType::MXFP4) {
    const __m256i table = table16<12>(kMXFP4Values);
    return _mm256_shuffle_epi8(table, nibbles32(b + 1));
  } else if constexpr (Q == QType::MXFP4_HF) {  // pairs: byte j is elements 2j (low), 2j + 1 (high)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    const __m256i codes = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    return _mm256_shuffle_epi8(table16<12>(kMXFP4Values), codes);
  } else if constexpr (Q == QType::Q4_K || Q == QType::Q5_K) {
    const uint8_t* qs = b + (Q == QType::Q5_K ? 48 : 16) + 32 * (i / 2);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    __m256i u = _mm256_and_si256(i % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
    if constexpr (Q == QType::Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(shr16(qh, i), _mm256_set1_epi8(1)), 4));
    }
    return u;
  } else if constexpr (Q == QType::Q6_K) {
    const int n = i / 4, j = i % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32 * (j % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
    const __m256i low = _mm256_and_si256(j / 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
    // qh's bits 2j, 2j + 1 of each byte to bits 4, 5 in one 16-bit shift (what crosses a byte
    // lands outside bits 4, 5).
    const __m256i moved = j == 2 ? qh : j == 3 ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4 - 2 * j);
    return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
  } else if constexpr (Q == QType::Q2_K) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (i / 4)));
    return _mm256_and_si256(shr16(qs, 2 * (i % 4)), _mm256_set1_epi8(3));
  } else if constexpr (Q == QType::Q3_K) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * (i / 4)));
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i low = _mm256_and_si256(shr16(qs, 2 * (i % 4)), _mm256_set1_epi8(3));
    const __m256i high = _mm256_and_si256(shr16(hm, i), _mm256_set1_epi8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
  }
  return _mm256_setzero_si256();
}

// out[0..16) = d x the 16 bytes of v (unsigned, or signed with Signed).
template <bool Signed>
inline void scaled16(__m128i v, float d, float* out) {
#if defined(TOKENWAY_EXPERTS_512)
  const __m512i wide = Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(d)));
#else
  const __m128i high = _mm_srli_si128(v, 8);
  const __m256i lo = Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  const __m256i hi = Signed ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(d)));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(d)));
#endif
}

// A super-block's 16 scales and 16 corrections as signed bytes, one each per 16 weights, with their
// multipliers: s = d sb, c = dm mb, where c = offset s + m (w = s (u - offset) - m). Every
// K-quant scale and min fits a signed byte (Q4_K's 6 bits, Q6_K's int8, Q3_K's and IQ4_XS's
// signed 6 bits); the types with no mins carry c as their scales times d offset.
struct SuperBytes {
  __m128i s, m;
  float d, dm;
};

template <QType Q>
inline SuperBytes super_bytes(const uint8_t* b) {
  constexpr float off = float(offset_of(Q));
  if constexpr (Q == QType::Q4_K || Q == QType::Q5_K) {
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b));
    const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 2));
    // The 12 packed bytes q -> 8 scales, then 8 mins, a byte each, in vector registers (a scalar
    // unpack stored to memory and loaded back as a vector stalls on store forwarding):
    // scale j < 4: q[j] & 63; j >= 4: (q[j + 4] & 15) | (q[j - 4] >> 6) << 4;
    // min j < 4: q[j + 4] & 63; j >= 4: (q[j + 4] >> 4) | (q[j] >> 6) << 4.
    // The 16-byte load runs 4 bytes into the codes that follow the scales.
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i high = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i packed = _mm_or_si128(
        _mm_or_si128(_mm_and_si128(low, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
                     _mm_and_si128(_mm_srli_epi16(low, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15))),
        _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(0x30)));
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // a byte per 16 weights
    return {_mm_shuffle_epi8(packed, twice), _mm_shuffle_epi8(packed, _mm_add_epi8(twice, _mm_set1_epi8(8))), d, dmin};
  } else if constexpr (Q == QType::Q6_K) {
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    return {sc, sc, d, d * off};
  } else if constexpr (Q == QType::Q2_K) {
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 80));
    const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 82));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return {_mm_and_si128(v, _mm_set1_epi8(0x0F)), _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)), d, dmin};
  } else if constexpr (Q == QType::Q3_K) {
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 108));
    alignas(16) int8_t sc[16];
    for (int h = 0; h < 16; ++h) sc[h] = int8_t(q3k_scale(b + 96, h));
    const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(sc));
    return {v, v, d, d * off};
  } else {
    static_assert(Q == QType::IQ4_XS, "a super-block type");
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b));
    alignas(16) int8_t sc[16];
    for (int i = 0; i < 8; ++i) sc[2 * i] = sc[2 * i + 1] = int8_t(iq4xs_scale(b, i));
    const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(sc));
    return {v, v, d, d * off};
  }
}

// The same as floats: s and c per 16 weights.
template <QType Q>
inline void super_scales(const uint8_t* b, float* s, float* c) {
  const SuperBytes q = super_bytes<Q>(b);
  scaled16<true>(q.s, q.d, s);
  scaled16<true>(q.m, q.dm, c);
}

// Block b's scale of a row: in the block, or (split_scales) at scales[b].
template <QType Q>
inline float block_scale(const uint8_t* row, const uint8_t* scales, int64_t b) {
  if constexpr (split_scales(Q)) return e8m0_half(scales[b]);
  const uint8_t* block = row + b * layout_of(Q).bytes;
  if constexpr (Q == QType::MXFP4) return e8m0_half(block[0]);
  else return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(block));
}

#if defined(TOKENWAY_EXPERTS_512)
constexpr int kUnit = 64;
using UV = __m512i;
using FU = __m512;
inline UV join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline UV uload(const int8_t* p) { return _mm512_loadu_si512(p); }
inline UV uload32(const int32_t* p) { return _mm512_loadu_si512(p); }
inline UV uzero() { return _mm512_setzero_si512(); }
inline UV udot(UV acc, UV u, UV x) { return _mm512_dpbusd_epi32(acc, u, x); }
inline UV sdot(UV acc, UV q, UV x) { return udot(acc, q, x); }  // never used: VNNI has offsets
inline FU fzero() { return _mm512_setzero_ps(); }
inline FU fset(float v) { return _mm512_set1_ps(v); }
inline FU fload(const float* p) { return _mm512_loadu_ps(p); }
inline FU fmul(FU a, FU b) { return _mm512_mul_ps(a, b); }
inline FU ffma(FU a, FU b, FU c) { return _mm512_fmadd_ps(a, b, c); }
inline FU fcvt(UV a) { return _mm512_cvtepi32_ps(a); }
inline float fsum(FU a) { return _mm512_reduce_add_ps(a); }
// acc - c . bx over one super-block's 16 sub-blocks.
inline FU fcorrect(FU acc, const float* c, const float* bx) {
  return _mm512_fnmadd_ps(_mm512_loadu_ps(c), _mm512_loadu_ps(bx), acc);
}
// Unit u of a super-block (sub-blocks 4u .. 4u + 3): each lane's scale, 4 lanes a sub-block.
inline FU super_lanes(const float* s, int unit) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(4 * unit),
                                         _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
  return _mm512_permutexvar_ps(index, _mm512_loadu_ps(s));
}
template <QType Q>
inline FU block_lanes(float d0, float d1) {
  if constexpr (interleaved(Q)) {  // [d0 x 4, d1 x 4] twice
    const __m256 pair = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(d0)), _mm_set1_ps(d1), 1);
    return _mm512_broadcast_f32x8(pair);
  }
  return _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
}
// Each 64-bit quarter of v shifted right by its own count: lanes 0-3 by lo, 4-7 by hi.
inline UV shr64x2(UV v, int lo, int hi) { return _mm512_srlv_epi64(v, _mm512_set_epi64(hi, hi, hi, hi, lo, lo, lo, lo)); }
inline UV broadcast256(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <QType Q>
inline UV super_unit(const uint8_t* b, int unit) {
  if constexpr (Q == QType::Q4_K || Q == QType::Q5_K) {
    // Sub-blocks 2u, 2u + 1 are the low and high nibbles of the same 32 bytes: both halves.
    const UV low4 = _mm512_set1_epi8(0x0F);
    UV u = _mm512_and_si512(shr64x2(broadcast256(b + (Q == QType::Q5_K ? 48 : 16) + 32 * unit), 0, 4), low4);
    if constexpr (Q == QType::Q5_K) {
      const UV high = _mm512_and_si512(shr64x2(broadcast256(b + 16), 2 * unit, 2 * unit + 1), _mm512_set1_epi8(1));
      u = _mm512_or_si512(u, _mm512_slli_epi16(high, 4));
    }
    return u;
  } else if constexpr (Q == QType::Q6_K) {
    // Chunks 2u, 2u + 1: ql's 64 bytes of their half, one nibble; qh's 32 bytes, two bit pairs.
    const int n = unit / 2, shift = 4 * (unit % 2);
    const UV ql = _mm512_loadu_si512(b + 64 * n);
    const UV low = _mm512_and_si512(_mm512_srl_epi16(ql, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8(0x0F));
    const UV high = _mm512_and_si512(shr64x2(broadcast256(b + 128 + 32 * n), shift, shift + 2), _mm512_set1_epi8(3));
    return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
  } else {
    return join(decode32<Q>(b, 2 * unit), decode32<Q>(b, 2 * unit + 1));
  }
}
template <QType Q>
inline UV block_unit(const uint8_t* b, bool second) {
  if constexpr (interleaved(Q)) {
    constexpr int kAt = Q == QType::MXFP4 ? 1 : 2;  // the nibbles' offset in a block
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kAt));
    const __m128i q1 = second ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + layout_of(Q).bytes + kAt))
                              : _mm_setzero_si128();
    const UV v = _mm512_broadcast_i64x4(_mm256_set_m128i(q1, q0));  // [q0, q1, q0, q1]
    const UV codes = _mm512_and_si512(shr64x2(v, 0, 4), _mm512_set1_epi8(0x0F));
    if constexpr (Q == QType::Q4_0) return codes;
    const __m256i table = Q == QType::MXFP4 ? table16<12>(kMXFP4Values) : table16<128>(kIQ4Values);
    return _mm512_shuffle_epi8(_mm512_broadcast_i64x4(table), codes);
  }
  return join(decode32<Q>(b, 0), second ? decode32<Q>(b + layout_of(Q).bytes, 0) : _mm256_setzero_si256());
}
constexpr int kBlocksAUnit = 2;
#else
constexpr int kUnit = 32;
using UV = __m256i;
using FU = __m256;
inline UV uload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline UV uload32(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline UV uzero() { return _mm256_setzero_si256(); }
inline UV udot(UV acc, UV u, UV x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}
inline UV sdot(UV acc, UV q, UV x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)),
                                                 _mm256_set1_epi16(1)));
}
inline FU fzero() { return _mm256_setzero_ps(); }
inline FU fset(float v) { return _mm256_set1_ps(v); }
inline FU fload(const float* p) { return _mm256_loadu_ps(p); }
inline FU fmul(FU a, FU b) { return _mm256_mul_ps(a, b); }
inline FU ffma(FU a, FU b, FU c) { return _mm256_fmadd_ps(a, b, c); }
inline FU fcvt(UV a) { return _mm256_cvtepi32_ps(a); }
inline float fsum(FU a) { return vsum(a); }
inline FU fcorrect(FU acc, const float* c, const float* bx) {
  acc = _mm256_fnmadd_ps(_mm256_loadu_ps(c), _mm256_loadu_ps(bx), acc);
  return _mm256_fnmadd_ps(_mm256_loadu_ps(c + 8), _mm256_loadu_ps(bx + 8), acc);
}
inline FU super_lanes(const float* s, int unit) {  // sub-blocks 2u, 2u + 1
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(s + 2 * unit)), _mm_broadcast_ss(s + 2 * unit + 1), 1);
}
template <QType Q>
inline FU block_lanes(float d0, float) { return _mm256_set1_ps(d0); }
template <QType Q>
inline UV super_unit(const uint8_t* b, int unit) { return decode32<Q>(b, unit); }
template <QType Q>
inline UV block_unit(const uint8_t* b, bool) { return decode32<Q>(b, 0); }
constexpr int kBlocksAUnit = 1;
#endif

template <QType Q>
inline UV dot(UV acc, UV u, UV x) {
  if constexpr (signed_codes(Q)) return sdot(acc, u, x);
  else return udot(acc, u, x);
}

#if !defined(TOKENWAY_EXPERTS_512)
// kIntScales's tiles. A super-block's 16 scale bytes widened once to int16, each half of them in
// both 128-bit lanes (Scales16), then unit u's (sub-blocks 2u, 2u + 1) scales, 8 int16 lanes each,
// by one in-lane byte shuffle (llama.cpp's AVX2 K-quant scale shuffle).
struct Scales16 {
  __m256i lo, hi;  // scales 0-7 and 8-15 as int16, in both lanes
};

inline Scales16 widen_scales(__m128i bytes) {
  return {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(bytes)),
          _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(bytes, 8)))};
}

template <int U>
inline __m256i unit_scales(const Scales16& scales) {
  constexpr char a = char(2 * (2 * U % 8)), b = char(2 * ((2 * U + 1) % 8));  // the int16's bytes in its half
  const __m256i pick = _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                        b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1);
  return _mm256_shuffle_epi8(U < 4 ? scales.lo : scales.hi, pick);
}

template <int... U, typename Fn>
inline void for_units(std::integer_sequence<int, U...>, Fn&& fn) {
  (fn(std::integral_constant<int, U>{}), ...);
}

// acc + the unit's products, scaled: madd(maddubs(u, x), scales).
template <QType Q>
inline UV scaled_dot(UV acc, UV u, UV x, UV scales) {
  const UV pairs = signed_codes(Q) ? _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u))
                                   : _mm256_maddubs_epi16(u, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales));
}
#endif

// NR rows (pointers to their blocks) times TT tokens (rows of a): res[r][t].
// The cache lines of [p, p + bytes) into L1, ahead of their use (a prefetch never faults: the
// address may lie past the weight's end).
inline void prefetch(const uint8_t* p, int bytes) {
  for (int at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
}

// ahead: prefetch the rows that many bytes further on as these are read (the next tile's, on a
// chunk's first token tile: its weights come from memory), or 0.
template <QType Q, int NR, int TT>
void tile_quant(const uint8_t* const* rows, const uint8_t* const* scales, const Acts& a, const int32_t* slots,
                float (*res)[TT], int64_t ahead) {
  constexpr Layout L = layout_of(Q);
  const int64_t k = a.k, kp = a.kp;
  FU acc[NR][TT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = fzero();
  const int8_t* xq[TT];
  const float* dxe[TT];
  for (int t = 0; t < TT; ++t) {
    xq[t] = a.xq.data() + int64_t(slots[t]) * kp;
    dxe[t] = a.dxe.data() + int64_t(slots[t]) * kp / 4;
  }
#if !defined(TOKENWAY_EXPERTS_512)
  if constexpr (L.super && kIntScales) {
    // Each super-block: the units' int32 sums carry the rows' integer scales, the corrections
    // (mins, or the offset's scales) meet the activations' integer sums per 16 in one madd, and
    // the floats d dx and dm dx enter once.
    const int16_t* bsum[TT];
    for (int t = 0; t < TT; ++t) bsum[t] = a.bsum.data() + int64_t(slots[t]) * kp / 16;
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      if (ahead)
        for (int r = 0; r < NR; ++r) prefetch(rows[r] + ahead + sb * L.bytes, L.bytes);
      const uint8_t* b[NR];
      SuperBytes q[NR];
      Scales16 scales[NR];
      for (int r = 0; r < NR; ++r) {
        b[r] = rows[r] + sb * L.bytes;
        q[r] = super_bytes<Q>(b[r]);
        scales[r] = widen_scales(q[r].s);
      }
      UV sums[NR][TT];
      for (int r = 0; r < NR; ++r)
        for (int t = 0; t < TT; ++t) sums[r][t] = uzero();
      for_units(std::make_integer_sequence<int, 8>{}, [&](auto U) {
        UV u[NR], sc[NR];
        for (int r = 0; r < NR; ++r) {
          u[r] = super_unit<Q>(b[r], U);
          sc[r] = unit_scales<U>(scales[r]);
        }
        const int64_t at = sb * 256 + U * kUnit;
        for (int t = 0; t < TT; ++t) {
          const UV x = uload(xq[t] + at);
          for (int r = 0; r < NR; ++r) sums[r][t] = scaled_dot<Q>(sums[r][t], u[r], x, sc[r]);
        }
      });
      for (int t = 0; t < TT; ++t) {
        const float dx = dxe[t][sb * 64];
        const UV bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum[t] + sb * 16));
        for (int r = 0; r < NR; ++r) {
          const FU corrections = fcvt(_mm256_madd_epi16(_mm256_cvtepi8_epi16(q[r].m), bs));
          const FU scaled = ffma(fcvt(sums[r][t]), fset(q[r].d * dx), acc[r][t]);
          acc[r][t] = _mm256_fnmadd_ps(corrections, fset(q[r].dm * dx), scaled);
        }
      }
    }
  } else
#endif
  if constexpr (L.super) {
    // A super-block's sums apart (its tokens' dx are one each): dx meets them once.
    const float* bx[TT];
    for (int t = 0; t < TT; ++t) bx[t] = a.bx.data() + int64_t(slots[t]) * kp / 16;
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      if (ahead)
        for (int r = 0; r < NR; ++r) prefetch(rows[r] + ahead + sb * L.bytes, L.bytes);
      alignas(64) float s[NR][16], c[NR][16];
      for (int r = 0; r < NR; ++r) super_scales<Q>(rows[r] + sb * L.bytes, s[r], c[r]);
      FU sums[NR][TT];
      for (int r = 0; r < NR; ++r)
        for (int t = 0; t < TT; ++t) sums[r][t] = fzero();
#pragma GCC unroll 4
      for (int unit = 0; unit < 256 / kUnit; ++unit) {
        UV u[NR];
        FU f[NR];
        for (int r = 0; r < NR; ++r) {
          u[r] = super_unit<Q>(rows[r] + sb * L.bytes, unit);
          f[r] = super_lanes(s[r], unit);
        }
        const int64_t at = sb * 256 + unit * kUnit;
        for (int t = 0; t < TT; ++t) {
          const UV x = uload(xq[t] + at);
          for (int r = 0; r < NR; ++r) sums[r][t] = ffma(fcvt(dot<Q>(uzero(), u[r], x)), f[r], sums[r][t]);
        }
      }
      for (int t = 0; t < TT; ++t) {
        const FU dx = fset(dxe[t][sb * 64]);
        for (int r = 0; r < NR; ++r) acc[r][t] = fcorrect(ffma(sums[r][t], dx, acc[r][t]), c[r], bx[t] + sb * 16);
      }
    }
  } else {
    const int32_t* init[TT];
    for (int t = 0; t < TT; ++t) init[t] = a.init.data() + int64_t(slots[t]) * kp / 4;
    const int64_t blocks = k / 32;
    for (int64_t b = 0; b < blocks; b += kBlocksAUnit) {
      const bool second = b + 1 < blocks;
      if (ahead && (b * L.bytes) % 64 < kBlocksAUnit * L.bytes)  // a new cache line begins in this unit
        for (int r = 0; r < NR; ++r) prefetch(rows[r] + ahead + (b * L.bytes) / 64 * 64 + 64, 64);
      UV u[NR];
      FU f[NR];
      for (int r = 0; r < NR; ++r) {
        u[r] = block_unit<Q>(rows[r] + b * L.bytes, second);
        f[r] = block_lanes<Q>(block_scale<Q>(rows[r], scales[r], b),
                              kBlocksAUnit == 2 && second ? block_scale<Q>(rows[r], scales[r], b + 1) : 0.0f);
      }
      const int64_t at = b * 32;
      for (int t = 0; t < TT; ++t) {
        const UV x = uload(xq[t] + at);
        const UV start = uload32(init[t] + at / 4);
        const FU dx = fload(dxe[t] + at / 4);
        for (int r = 0; r < NR; ++r) acc[r][t] = ffma(fcvt(dot<Q>(start, u[r], x)), fmul(f[r], dx), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TT; ++t) res[r][t] = fsum(acc[r][t]);
}

// Float weights: W floats a vector.
template <QType Q>
inline Vec load_weights(const uint8_t* row, int64_t i) {
#if defined(__AVX512F__)
  if constexpr (Q == QType::F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  else if constexpr (Q == QType::F16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i)));
  else return load_bf16(reinterpret_cast<const uint16_t*>(row) + i);
#else
  if constexpr (Q == QType::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  else if constexpr (Q == QType::F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  else return load_bf16(reinterpret_cast<const uint16_t*>(row) + i);
#endif
}

template <QType Q, int NR, int TT>
void tile_float(const uint8_t* const* rows, const uint8_t* const*, const Acts& a, const int32_t* slots,
                float (*res)[TT], int64_t) {
  const int64_t k = a.k, kp = a.kp, whole = k / W * W;
  Vec acc[NR][TT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  const float* x[TT];
  for (int t = 0; t < TT; ++t) x[t] = a.xf.data() + int64_t(slots[t]) * kp;
  for (int64_t i = 0; i < whole; i += W) {
    Vec w[NR];
    for (int r = 0; r < NR; ++r) w[r] = load_weights<Q>(rows[r], i);
    for (int t = 0; t < TT; ++t) {
      const Vec xv = vload(x[t] + i);
      for (int r = 0; r < NR; ++r) acc[r][t] = vfma(w[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TT; ++t) {
      float total = vsum(acc[r][t]);
      for (int64_t i = whole; i < k; ++i) {
        float wi;
        decode_block<Q>(rows[r] + i * layout_of(Q).bytes, &wi);
        total += wi * x[t][i];
      }
      res[r][t] = total;
    }
}

template <QType Q, int NR, int TT>
inline void tile(const uint8_t* const* rows, const uint8_t* const* scales, const Acts& a, const int32_t* slots,
                 float (*res)[TT], int64_t ahead) {
  if constexpr (layout_of(Q).is_float) tile_float<Q, NR, TT>(rows, scales, a, slots, res, ahead);
  else tile_quant<Q, NR, TT>(rows, scales, a, slots, res, ahead);
}

// Rows a tile takes with TT tokens: their accumulators (and a super-block's sums beside them) in
// registers, 32 with AVX512, 16 with AVX2.
#if defined(TOKENWAY_EXPERTS_512)
constexpr int kMaxTile = 8;
template <int TT> constexpr int rows_at_once() { return TT == 1 ? 4 : TT == 8 ? 1 : 2; }
#else
constexpr int kMaxTile = 4;
template <int TT> constexpr int rows_at_once() { return TT == 4 ? 1 : 2; }
#endif

#else  // the plain path: a decoded row against float activations

constexpr int kMaxTile = 4;
template <int TT> constexpr int rows_at_once() { return 1; }

template <QType Q, int NR, int TT>
inline void tile(const uint8_t* const* rows, const uint8_t* const* scales, const Acts& a, const int32_t* slots,
                 float (*res)[TT], int64_t) {
  static thread_local std::vector<float> weights;
  weights.resize(a.k);
  for (int r = 0; r < NR; ++r) {
    decode_row<Q>(rows[r], scales[r], a.k, weights.data());
    for (int t = 0; t < TT; ++t) {
      const float* x = a.xf.data() + int64_t(slots[t]) * a.kp;
      float total = 0.0f;
      for (int64_t i = 0; i < a.k; ++i) total += weights[i] * x[i];
      res[r][t] = total;
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// One matrix's rows (one expert's, or a dense weight's): row r's blocks at data + r * stride, its
// scales (split_scales types) at scales + r * scale_stride.

struct Rows {
  const uint8_t* data;
  int64_t stride;
  const uint8_t* scales = nullptr;
  int64_t scale_stride = 0;
  const uint8_t* row(int64_t r) const { return data + r * stride; }
  const uint8_t* scale_row(int64_t r) const { return scales == nullptr ? nullptr : scales + r * scale_stride; }
  Rows from(int64_t r) const { return {row(r), stride, scale_row(r), scale_stride}; }
};

// Rows [r0, r1) of one matrix times n tokens (rows slots[i] of a): y[i * ldy + r - r0].

template <QType Q, int TT>
void rows_tile(const Rows& w, int64_t r0, int64_t r1, const Acts& a, const int32_t* slots, float* y, int64_t ldy,
               bool first) {
  constexpr int NR = rows_at_once<TT>();
  for (int64_t r = r0; r < r1; r += NR) {
    const uint8_t* rows[NR];
    const uint8_t* scales[NR];
    for (int i = 0; i < NR; ++i) {
      rows[i] = w.row(std::min(r + i, r1 - 1));
      scales[i] = w.scale_row(std::min(r + i, r1 - 1));
    }
    float res[NR][TT];
    tile<Q, NR, TT>(rows, scales, a, slots, res, first && r + NR < r1 ? 2 * NR * w.stride : 0);
    for (int i = 0; i < NR && r + i < r1; ++i)
      for (int t = 0; t < TT; ++t) y[t * ldy + r + i - r0] = res[i][t];
  }
}

template <QType Q>
void rows_times_tokens(const Rows& w, int64_t r0, int64_t r1, const Acts& a, const int32_t* slots, int64_t n,
                       float* y, int64_t ldy) {
  for (int64_t i = 0; i < n;) {
    const int64_t left = n - i;
    const bool first = i == 0;  // later tiles find the chunk's rows in L2
    if (kMaxTile >= 8 && left >= 8) {
      rows_tile<Q, (kMaxTile >= 8 ? 8 : 4)>(w, r0, r1, a, slots + i, y + i * ldy, ldy, first);
      i += kMaxTile >= 8 ? 8 : 4;
    } else if (left >= 4) {
      rows_tile<Q, 4>(w, r0, r1, a, slots + i, y + i * ldy, ldy, first);
      i += 4;
    } else if (left >= 2) {
      rows_tile<Q, 2>(w, r0, r1, a, slots + i, y + i * ldy, ldy, first);
      i += 2;
    } else {
      rows_tile<Q, 1>(w, r0, r1, a, slots + i, y + i * ldy, ldy, first);
      i += 1;
    }
  }
}


// ---------------------------------------------------------------------------------------------
// Many tokens an expert on AVX2: its tokens in groups of 8 (expert_groups.h).

#if defined(TOKENWAY_EXPERTS_VECTOR) && !defined(TOKENWAY_EXPERTS_512)
#include "expert_groups.h"
#else
constexpr bool grouped(QType) { return false; }
struct Groups {
  std::vector<int64_t> first;
};
void group_acts(const Acts&, QType, const int64_t*, const int32_t*, int64_t, Groups&) {}
template <QType Q>
void grouped_rows_times_tokens(const Rows&, int64_t, int64_t, const Groups&, int64_t, int64_t, float*, int64_t) {}
#endif

// ---------------------------------------------------------------------------------------------
// Many tokens against one matrix (an expert chosen by many of a prompt chunk's tokens, a dense
// matmul over a chunk): each row is decoded once to float32 (in the layout of a.xq, zeros past
// k) and meets the tokens' dx qx (a.xf, the same int8-rounded activations as the int8 path, so
// the same answer up to float32 sums) in a register-blocked FMA kernel: NR rows x TT tokens of
// accumulators, one load per row and per token for NR x TT multiply-adds of W lanes, the rows'
// decode spread over the tokens. Columns go in slices (kSlice) so that the rows' slice and a
// token tile's stay in L1.

// Tokens a matrix (an expert's) needs for its rows to be decoded rather than met block by block,
// and only the 32-weight types: their int8 tiles spend a convert, two scale products and three
// loads on each 64 products (a scale per block and token), the decoded rows one load and a
// W-lane FMA per 16 products; the super-block types' int8 tiles (one convert and FMA a unit) measure faster
// than decoded rows at every token count (bench/expert_kernel_bench.py: Qwen3-30B-A3B's Q4_K,
// Q6_K at T = 128, 512), so they keep them.
constexpr int64_t kDecodedMinTokens = 16;
// Rows decoded at once: 16 x kp floats (180 KiB at k = 2880) stay in L2 while all tokens pass.
constexpr int64_t kDecodedRows = 16;

bool decoded_path(QType q, int64_t tokens) {
  const Layout L = layout_of(q);
  return tokens >= kDecodedMinTokens && !L.is_float && !L.super && !grouped(q);
}

// a.xf for the vector builds (the plain one has it already): dx qx in a.xq's layout, (n, kp).
void float_acts(Acts& a) {
  if (!kVector || !a.xf.empty() || a.kp == 0) return;
  const int64_t kp = a.kp, n = int64_t(a.xq.size()) / kp;
  a.xf.resize(n * kp);
  tokenway_native::parallel_for(0, n, std::max<int64_t>(1, (int64_t(1) << 16) / kp), [&](int64_t first, int64_t last) {
    for (int64_t i = first * kp; i < last * kp; ++i) a.xf[i] = a.dxe[i / 4] * float(a.xq[i]);
  });
}

#if defined(TOKENWAY_EXPERTS_VECTOR)
inline void ustore(uint8_t* p, UV v) {
#if defined(TOKENWAY_EXPERTS_512)
  _mm512_storeu_si512(p, v);
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
#endif
}

// out[0..16) = s u - c for the 16 codes at p (unsigned, or signed with Signed).
template <bool Signed>
inline void affine16(const uint8_t* p, float s, float c, float* out) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(TOKENWAY_EXPERTS_512)
  const __m512 u = _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
  _mm512_storeu_ps(out, _mm512_fmsub_ps(u, _mm512_set1_ps(s), _mm512_set1_ps(c)));
#else
  const __m128i high = _mm_srli_si128(v, 8);
  const __m256 lo = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  const __m256 hi = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high));
  _mm256_storeu_ps(out, _mm256_fmsub_ps(lo, _mm256_set1_ps(s), _mm256_set1_ps(c)));
  _mm256_storeu_ps(out + 8, _mm256_fmsub_ps(hi, _mm256_set1_ps(s), _mm256_set1_ps(c)));
#endif
}
#endif

// One row -> kp floats in a.xq's layout: the weights the int8 path's codes, scales and offsets
// stand for (w = s (u - offset) - m), zeros past k.
template <QType Q>
void decode_for_dot(const uint8_t* row, const uint8_t* scales, int64_t k, int64_t kp, float* out) {
  constexpr Layout L = layout_of(Q);
#if defined(TOKENWAY_EXPERTS_VECTOR)
  constexpr bool kSigned = signed_codes(Q);
  alignas(64) uint8_t codes[kUnit];
  std::fill(out + k, out + kp, 0.0f);
  if constexpr (L.super) {
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const uint8_t* b = row + sb * L.bytes;
      alignas(64) float s[16], c[16];
      super_scales<Q>(b, s, c);
      for (int unit = 0; unit < 256 / kUnit; ++unit) {
        ustore(codes, super_unit<Q>(b, unit));
        for (int g = 0; g < kUnit / 16; ++g) {
          const int h = unit * (kUnit / 16) + g;
          affine16<kSigned>(codes + 16 * g, s[h], c[h], out + sb * 256 + 16 * h);
        }
      }
    }
  } else {
    constexpr float off = float(offset_of(Q));
    const int64_t blocks = k / 32;
    for (int64_t b = 0; b < blocks; b += kBlocksAUnit) {
      const bool second = b + 1 < blocks;
      ustore(codes, block_unit<Q>(row + b * L.bytes, second));
      const float d[2] = {block_scale<Q>(row, scales, b),
                          kBlocksAUnit == 2 && second ? block_scale<Q>(row, scales, b + 1) : 0.0f};
      for (int g = 0; g < kUnit / 16; ++g) {
        // AVX512's pair of blocks: [lo 0, lo 1, hi 0, hi 1] interleaved, else [block 0, block 1].
        const int which = kBlocksAUnit == 1 ? 0 : interleaved(Q) ? g % 2 : g / 2;
        affine16<kSigned>(codes + 16 * g, d[which], d[which] * off, out + b * 32 + 16 * g);
      }
    }
  }
#else
  decode_row<Q>(row, scales, k, out);
  std::fill(out + k, out + kp, 0.0f);
#endif
}

#if defined(TOKENWAY_EXPERTS_512)
constexpr int kFloatRows = 4, kFloatTokens = 6;  // 24 accumulators of 32 registers
#elif defined(TOKENWAY_EXPERTS_VECTOR)
constexpr int kFloatRows = 4, kFloatTokens = 3;  // 12 of 16
#else
constexpr int kFloatRows = 2, kFloatTokens = 4;
#endif

// Columns of the decoded rows a pass takes: kDecodedRows x kSlice floats (16 KiB) and a token
// tile's kSlice floats of x stay in L1 while every token tile passes the rows.
constexpr int64_t kSlice = 256;

// acc[r][t] += rows w[r] . tokens x[t] over len floats (a multiple of W), partial sums in part
// (vectors: summed once, after the last slice).
template <int NR, int TT>
inline void float_tile(const float* const* w, const float* const* x, int64_t len, Vec* part, int64_t ldp) {
  Vec acc[NR][TT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = part[t * ldp + r];
  for (int64_t i = 0; i < len; i += W) {
    Vec wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = vload(w[r] + i);
    for (int t = 0; t < TT; ++t) {
      const Vec xv = vload(x[t] + i);
      for (int r = 0; r < NR; ++r) acc[r][t] = vfma(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TT; ++t) part[t * ldp + r] = acc[r][t];
}

// Columns [s0, s0 + len) of `rows` decoded rows (a multiple of kFloatRows) against TT tokens.
template <int TT>
inline void float_rows_tile(const float* decoded, int64_t rows, int64_t kp, int64_t s0, int64_t len, const float* xf,
                            const int32_t* slots, Vec* part, int64_t ldp) {
  constexpr int NR = kFloatRows;
  const float* x[TT];
  for (int t = 0; t < TT; ++t) x[t] = xf + int64_t(slots[t]) * kp + s0;
  for (int64_t r = 0; r < rows; r += NR) {
    const float* w[NR];
    for (int i = 0; i < NR; ++i) w[i] = decoded + (r + i) * kp + s0;
    float_tile<NR, TT>(w, x, len, part + r, ldp);
  }
}

// Rows [r0, r1) of one matrix times n tokens (rows slots[i] of a, a.xf filled: float_acts):
// y[i * ldy + r - r0], as matmul_rows.
template <QType Q>
void decoded_rows_times_tokens(const Rows& w, int64_t r0, int64_t r1, const Acts& a, const int32_t* slots, int64_t n,
                               float* y, int64_t ldy) {
  const int64_t k = a.k, kp = a.kp;
  constexpr int64_t kRows = (kDecodedRows + kFloatRows - 1) / kFloatRows * kFloatRows;
  static thread_local std::vector<float> decoded;
  static thread_local std::vector<Vec> part;  // (n, kRows) partial sums
  decoded.assign(kRows * kp, 0.0f);
  part.resize(n * kRows);
  for (int64_t c0 = r0; c0 < r1; c0 += kRows) {
    const int64_t rows = std::min(r1 - c0, kRows), padded = (rows + kFloatRows - 1) / kFloatRows * kFloatRows;
    for (int64_t r = 0; r < rows; ++r) decode_for_dot<Q>(w.row(c0 + r), w.scale_row(c0 + r), k, kp, decoded.data() + r * kp);
    std::fill(part.begin(), part.end(), vzero());
    for (int64_t s0 = 0; s0 < kp; s0 += kSlice) {
      const int64_t len = std::min(kSlice, kp - s0);
      int64_t i = 0;
      for (; i + kFloatTokens <= n; i += kFloatTokens)
        float_rows_tile<kFloatTokens>(decoded.data(), padded, kp, s0, len, a.xf.data(), slots + i,
                                      part.data() + i * kRows, kRows);
      for (; i < n; ++i)
        float_rows_tile<1>(decoded.data(), padded, kp, s0, len, a.xf.data(), slots + i, part.data() + i * kRows, kRows);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < rows; ++r) y[i * ldy + c0 - r0 + r] = vsum(part[i * kRows + r]);
  }
}

// The grouped path where the expert's tokens are in groups (grouped, group_acts), the decoded
// path where n is large enough (decoded_path) and a.xf is filled (float_acts), else the int8 (or
// float) tiles.
void matmul_rows(QType q, const Rows& w, int64_t r0, int64_t r1, const Acts& a, const int32_t* slots, int64_t n,
                 float* y, int64_t ldy, const Groups* groups = nullptr, int64_t expert = 0) {
  with_qtype(q, [&](auto qt) {
    constexpr QType Q = decltype(qt)::value;
    if constexpr (grouped(Q)) {
      if (groups != nullptr && !groups->first.empty() && groups->first[expert] >= 0)
        return grouped_rows_times_tokens<Q>(w, r0, r1, *groups, groups->first[expert], n, y, ldy);
    }
    if constexpr (!layout_of(Q).is_float) {
      if (decoded_path(Q, n) && !a.xf.empty()) return decoded_rows_times_tokens<Q>(w, r0, r1, a, slots, n, y, ldy);
    }
    rows_times_tokens<Q>(w, r0, r1, a, slots, n, y, ldy);
  });
}

// ---------------------------------------------------------------------------------------------
// Activation of gate and up, in place into g (n values).

enum Activation : int64_t { kSilu = 0, kSwigluOai = 1 };

void activate(float* g, const float* u, int64_t n, int64_t activation, float alpha, float limit) {
  int64_t i = 0;
  const Vec one = vset(1.0f);
  if (activation == kSilu) {
    for (; i + W <= n; i += W) {
      const Vec gv = vload(g + i);
      vstore(g + i, vmul(vdiv(gv, vadd(one, vexp(vsub(vzero(), gv)))), vload(u + i)));
    }
    for (; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    return;
  }
  const Vec lim = vset(limit), neg = vset(-limit), slope = vset(-alpha);
  for (; i + W <= n; i += W) {
    const Vec gv = vmin(vload(g + i), lim), uv = vmax(vmin(vload(u + i), lim), neg);
    vstore(g + i, vmul(vadd(uv, one), vdiv(gv, vadd(one, vexp(vmul(gv, slope))))));
  }
  for (; i < n; ++i) {
    const float gv = std::min(g[i], limit), uv = std::max(std::min(u[i], limit), -limit);
    g[i] = (uv + 1.0f) * (gv / (1.0f + std::exp(-alpha * gv)));
  }
}

// ---------------------------------------------------------------------------------------------
// The operators.

struct Matrix {  // E matrices of `rows` rows of blocks, at their tensor's strides
  QType qtype;
  int64_t rows, k, row_bytes;  // row_bytes: the bytes of a row's blocks
  const uint8_t* data;
  int64_t row_stride, expert_stride;
  const uint8_t* scales = nullptr;  // split_scales types: (E, rows, blocks a row) bytes
  int64_t scale_row_stride = 0, scale_expert_stride = 0;
  Rows expert(int64_t e) const {
    return {data + e * expert_stride, row_stride, scales == nullptr ? nullptr : scales + e * scale_expert_stride,
            scale_row_stride};
  }
};

int64_t row_bytes_of(QType q, int64_t k) {
  const Layout L = layout_of(q);
  return k / L.block * L.bytes;
}

// t's (experts, rows, row_bytes) strides: a contiguous tensor of that many bytes in any shape, or
// (E, rows, row_bytes) bytes with rows and experts at any strides, each row's bytes consecutive.
std::pair<int64_t, int64_t> matrix_strides(const at::Tensor& t, int64_t experts, int64_t rows, int64_t row_bytes,
                                           const char* what, const char* part) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte, what, ": uint8 ", part, " on the CPU");
  if (t.is_contiguous() && t.numel() == experts * rows * row_bytes) return {row_bytes, rows * row_bytes};
  const bool fits = (t.dim() == 3 && t.size(0) == experts) || (t.dim() == 2 && experts == 1);
  TORCH_CHECK(fits && t.size(-2) == rows && t.size(-1) == row_bytes && (row_bytes <= 1 || t.stride(-1) == 1), what,
              ": ", part, " (", experts, ", ", rows, ", ", row_bytes, ") with consecutive bytes a row expected for ",
              experts, " x ", rows, " rows, got ", t.sizes(), " at strides ", t.strides());
  TORCH_CHECK(t.stride(-2) >= 0 && (t.dim() == 2 || t.stride(0) >= 0), what, ": ", part, ": negative strides");
  return {t.stride(-2), t.dim() == 3 ? t.stride(0) : 0};
}

Matrix checked_matrix(const at::Tensor& blocks, const c10::optional<at::Tensor>& scales, int64_t qtype,
                      int64_t experts, int64_t rows, int64_t k, const char* what) {
  TORCH_CHECK(known_qtype(qtype), what, ": qtype ", qtype, " is not a type these kernels read");
  const QType q = QType(qtype);
  const Layout L = layout_of(q);
  TORCH_CHECK(k % L.block == 0, what, ": in_features ", k, " is not a multiple of the block size ", L.block);
  const int64_t row_bytes = row_bytes_of(q, k);
  const auto [row_stride, expert_stride] = matrix_strides(blocks, experts, rows, row_bytes, what, "blocks");
  Matrix m{q, rows, k, row_bytes, blocks.data_ptr<uint8_t>(), row_stride, expert_stride};
  const bool has_scales = scales.has_value() && scales->defined() && scales->numel() > 0;
  TORCH_CHECK(has_scales == split_scales(q), what, split_scales(q) ? ": this type's scales are a tensor of their own"
                                                                    : ": this type's scales are in its blocks");
  if (has_scales) {
    std::tie(m.scale_row_stride, m.scale_expert_stride) = matrix_strides(*scales, experts, rows, k / 32, what, "scales");
    m.scales = scales->data_ptr<uint8_t>();
  }
  return m;
}

const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t experts, int64_t rows, at::Tensor& keep,
                          const char* what) {
  if (!bias.has_value() || !bias->defined() || bias->numel() == 0) return nullptr;
  TORCH_CHECK(bias->numel() == experts * rows, what, ": ", experts * rows, " values expected, got ", bias->numel());
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// Rows a work item takes: about kChunkBytes of weights, in whole tiles of 4, at least `items`
// items over all (the pool hands them out one at a time, so a late thread holds up at most one).
constexpr int64_t kChunkBytes = 64 * 1024;

int64_t chunk_rows(int64_t rows, int64_t bytes_a_row, int64_t matrices, int64_t want_items) {
  int64_t chunk = std::max<int64_t>(4, kChunkBytes / std::max<int64_t>(1, bytes_a_row));
  const int64_t per_matrix = std::max<int64_t>(1, (want_items + matrices - 1) / matrices);
  chunk = std::min(chunk, std::max<int64_t>(4, (rows + per_matrix - 1) / per_matrix));
  chunk = (chunk + 3) / 4 * 4;
  return std::min(chunk, rows);
}

at::Tensor experts_forward(const at::Tensor& x_in, const at::Tensor& topk_ids_in, const at::Tensor& topk_weights_in,
                           const at::Tensor& gate_blocks, int64_t gate_qtype, const at::Tensor& up_blocks,
                           int64_t up_qtype, const at::Tensor& down_blocks, int64_t down_qtype, int64_t num_experts,
                           int64_t inter, const c10::optional<at::Tensor>& gate_bias_in,
                           const c10::optional<at::Tensor>& up_bias_in, const c10::optional<at::Tensor>& down_bias_in,
                           int64_t activation, double alpha, double limit, const c10::optional<at::Tensor>& gate_scales,
                           const c10::optional<at::Tensor>& up_scales, const c10::optional<at::Tensor>& down_scales) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "x: (T, hidden) on the CPU");
  TORCH_CHECK(activation == kSilu || activation == kSwigluOai, "activation: 0 (silu) or 1 (swiglu_oai)");
  const int64_t tokens = x_in.size(0), hidden = x_in.size(1);
  TORCH_CHECK(topk_ids_in.dim() == 2 && topk_ids_in.size(0) == tokens && topk_weights_in.sizes() == topk_ids_in.sizes(),
              "topk_ids, topk_weights: (T, k)");
  const int64_t k = topk_ids_in.size(1), pairs = tokens * k;
  const Matrix gate = checked_matrix(gate_blocks, gate_scales, gate_qtype, num_experts, inter, hidden, "gate");
  const Matrix up = checked_matrix(up_blocks, up_scales, up_qtype, num_experts, inter, hidden, "up");
  const Matrix down = checked_matrix(down_blocks, down_scales, down_qtype, num_experts, hidden, inter, "down");
  at::Tensor keep_gb, keep_ub, keep_db;
  const float* gate_bias = checked_bias(gate_bias_in, num_experts, inter, keep_gb, "gate_bias");
  const float* up_bias = checked_bias(up_bias_in, num_experts, inter, keep_ub, "up_bias");
  const float* down_bias = checked_bias(down_bias_in, num_experts, hidden, keep_db, "down_bias");
  at::Tensor out = at::zeros({tokens, hidden}, x_in.options().dtype(at::kFloat));
  if (tokens == 0 || k == 0) return out;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids_in.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights_in.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* weight = weights.data_ptr<float>();

  // Pairs grouped by expert (a counting sort): pair p of the sorted order is flat pair order[p].
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "topk_ids: ", id[i], " out of range for ", num_experts, " experts");
    ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int32_t> token_of(pairs), pair_at(pairs);  // sorted pair -> token; flat pair -> sorted pair
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t p = next[id[i]]++;
      token_of[p] = int32_t(i / k);
      pair_at[i] = int32_t(p);
    }
  }
  std::vector<int32_t> pair_ids(pairs);
  for (int64_t p = 0; p < pairs; ++p) pair_ids[p] = int32_t(p);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);

  const int threads = at::get_num_threads();
  const int64_t want_items = 8 * int64_t(threads);
  Acts xg, xu;
  quantize_acts(x.data_ptr<float>(), tokens, hidden, hidden, act_kind(gate.qtype), xg);
  const bool shared = act_kind(up.qtype) == act_kind(gate.qtype);
  if (!shared) quantize_acts(x.data_ptr<float>(), tokens, hidden, hidden, act_kind(up.qtype), xu);
  const Acts& x_up = shared ? xg : xu;
  int64_t most = 0;  // the most tokens an expert has: whether any takes the decoded path
  for (const int64_t e : active) most = std::max(most, start[e + 1] - start[e]);
  if (decoded_path(gate.qtype, most)) float_acts(xg);
  if (!shared && decoded_path(up.qtype, most)) float_acts(xu);
  Groups gg, gu;  // the experts with many tokens, their tokens in groups (grouped types)
  group_acts(xg, gate.qtype, start.data(), token_of.data(), num_experts, gg);
  const bool same_groups = shared && grouped(up.qtype) == grouped(gate.qtype);  // up reads gate's
  if (!same_groups) group_acts(x_up, up.qtype, start.data(), token_of.data(), num_experts, gu);
  const Groups& g_up = same_groups ? gg : gu;

  // gate and up, the activation: h (pairs, inter) in sorted pair order.
  std::vector<float> h(pairs * inter);
  {
    const int64_t rows = chunk_rows(inter, gate.row_bytes + up.row_bytes, int64_t(active.size()), want_items);
    const int64_t per_expert = (inter + rows - 1) / rows;
    const int64_t items = int64_t(active.size()) * per_expert;
    auto run = [&](int64_t item) {
      const int64_t e = active[item / per_expert], r0 = item % per_expert * rows, r1 = std::min(inter, r0 + rows);
      const int64_t first = start[e], n = start[e + 1] - first, width = r1 - r0;
      static thread_local std::vector<float> g, u;
      g.resize(n * width);
      u.resize(n * width);
      matmul_rows(gate.qtype, gate.expert(e).from(r0), 0, width, xg, token_of.data() + first, n, g.data(), width, &gg, e);
      matmul_rows(up.qtype, up.expert(e).from(r0), 0, width, x_up, token_of.data() + first, n, u.data(), width, &g_up,
                  e);
      for (int64_t i = 0; i < n; ++i) {
        float* gi = g.data() + i * width;
        float* ui = u.data() + i * width;
        if (gate_bias != nullptr)
          for (int64_t r = 0; r < width; ++r) gi[r] += gate_bias[e * inter + r0 + r];
        if (up_bias != nullptr)
          for (int64_t r = 0; r < width; ++r) ui[r] += up_bias[e * inter + r0 + r];
        activate(gi, ui, width, activation, float(alpha), float(limit));
        std::memcpy(h.data() + (first + i) * inter + r0, gi, width * sizeof(float));
      }
    };
    pool().run(items, threads, run);
  }

  Acts hq;
  quantize_acts(h.data(), pairs, inter, inter, act_kind(down.qtype), hq);
  if (decoded_path(down.qtype, most)) float_acts(hq);
  Groups gh;
  group_acts(hq, down.qtype, start.data(), pair_ids.data(), num_experts, gh);

  // down: y (pairs, hidden), bias added.
  std::vector<float> y(pairs * hidden);
  {
    const int64_t rows = chunk_rows(hidden, down.row_bytes, int64_t(active.size()), want_items);
    const int64_t per_expert = (hidden + rows - 1) / rows;
    const int64_t items = int64_t(active.size()) * per_expert;
    auto run = [&](int64_t item) {
      const int64_t e = active[item / per_expert], r0 = item % per_expert * rows, r1 = std::min(hidden, r0 + rows);
      const int64_t first = start[e], n = start[e + 1] - first;
      float* yp = y.data() + first * hidden + r0;
      matmul_rows(down.qtype, down.expert(e), r0, r1, hq, pair_ids.data() + first, n, yp, hidden, &gh, e);
      if (down_bias != nullptr)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t r = r0; r < r1; ++r) yp[i * hidden + r - r0] += down_bias[e * hidden + r];
    };
    pool().run(items, threads, run);
  }

  // out[t] = sum_j w_tj y[pair (t, j)]
  float* o = out.data_ptr<float>();
  tokenway_native::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / hidden), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      float* ot = o + t * hidden;
      for (int64_t j = 0; j < k; ++j) {
        const float wj = weight[t * k + j];
        const float* yp = y.data() + int64_t(pair_at[t * k + j]) * hidden;
        for (int64_t r = 0; r < hidden; ++r) ot[r] += wj * yp[r];
      }
    }
  });
  return out;
}

// y (T, N) = x @ W.T (+ bias) for a dense weight (N, bytes a row) of raw blocks, into out.
void raw_linear_out(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype,
                    const c10::optional<at::Tensor>& bias_in, at::Tensor out) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "x: (T, K) on the CPU");
  const int64_t tokens = x_in.size(0), in_features = x_in.size(1);
  TORCH_CHECK(blocks.dim() == 2, "weight: (N, bytes a row)");
  const int64_t n = blocks.size(0);
  const Matrix w = checked_matrix(blocks, c10::nullopt, qtype, 1, n, in_features, "weight");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == tokens && out.size(1) == n &&
                  (n <= 1 || out.stride(1) == 1) && (tokens <= 1 || out.stride(0) >= n),
              "out: float32 (", tokens, ", ", n, ") with unit column stride");
  at::Tensor keep;
  const float* bias = checked_bias(bias_in, 1, n, keep, "bias");
  if (tokens == 0 || n == 0) return;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  Acts a;
  quantize_acts(x.data_ptr<float>(), tokens, in_features, in_features, act_kind(w.qtype), a);
  if (decoded_path(w.qtype, tokens)) float_acts(a);
  std::vector<int32_t> slots(tokens);
  for (int64_t t = 0; t < tokens; ++t) slots[t] = int32_t(t);
  Groups groups;
  const int64_t all[2] = {0, tokens};
  group_acts(a, w.qtype, all, slots.data(), 1, groups);
  const int threads = at::get_num_threads();
  const int64_t rows = chunk_rows(n, w.row_bytes, 1, 4 * int64_t(threads));
  const int64_t items = (n + rows - 1) / rows, ldy = out.stride(0);
  float* y = out.data_ptr<float>();
  auto run = [&](int64_t item) {
    const int64_t r0 = item * rows, r1 = std::min(n, r0 + rows);
    matmul_rows(w.qtype, w.expert(0), r0, r1, a, slots.data(), tokens, y + r0, ldy, &groups, 0);
    if (bias != nullptr)
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t r = r0; r < r1; ++r) y[t * ldy + r] += bias[r];
  };
  pool().run(items, threads, run);
}

at::Tensor raw_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "x: (T, K), weight: (N, bytes a row)");
  at::Tensor out = at::empty({x.size(0), blocks.size(0)}, x.options().dtype(at::kFloat));
  raw_linear_out(x, blocks, qtype, bias, out);
  return out;
}

// Rows `ids` of a dense weight decoded to float32 (len(ids), K) by this build's plain decoder.
at::Tensor decode_rows(const at::Tensor& blocks, int64_t qtype, int64_t in_features, const at::Tensor& ids) {
  TORCH_CHECK(blocks.dim() == 2, "weight: (N, bytes a row)");
  const Matrix w = checked_matrix(blocks, c10::nullopt, qtype, 1, blocks.size(0), in_features, "weight");
  const at::Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t* row = rows.data_ptr<int64_t>();
  at::Tensor out = at::empty({rows.numel(), in_features}, blocks.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < w.rows, "ids: ", row[i], " out of range for ", w.rows, " rows");
    with_qtype(w.qtype, [&](auto qt) {
      constexpr QType Q = decltype(qt)::value;
      decode_row<Q>(w.expert(0).row(row[i]), nullptr, in_features, o + i * in_features);
    });
  }
  return out;
}

// A plain read of a buffer by the same threads and pool, every byte once (their sum, so nothing
// is optimized away): the memory speed the benchmarks hold the kernels to.
int64_t plain_read(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(), "buffer: contiguous on the CPU");
  const uint8_t* data = static_cast<const uint8_t*>(buffer.data_ptr());
  const int64_t words = buffer.nbytes() / 8;
  constexpr int64_t kWords = 32 * 1024;  // 256 KiB a work item
  const int64_t items = (words + kWords - 1) / kWords;
  std::vector<uint64_t> sums(items);
  auto run = [&](int64_t item) {
    const int64_t first = item * kWords, last = std::min(words, first + kWords);
    uint64_t total = 0;
    for (int64_t i = first; i < last; ++i) {
      uint64_t word;
      std::memcpy(&word, data + 8 * i, 8);
      total += word;
    }
    sums[item] = total;
  };
  pool().run(items, at::get_num_threads(), run);
  uint64_t total = 0;
  for (const uint64_t sum : sums) total += sum;
  return int64_t(total);
}

bool reads(int64_t qtype) { return known_qtype(qtype); }
std::string isa() { return kIsa; }
bool fast() { return kVector; }

}  // namespace

// TORCH_LIBRARY stringizes its argument: one more expansion makes it the macro's value.
#define TOKENWAY_DEFINE_LIBRARY(name, m) TORCH_LIBRARY(name, m)
TOKENWAY_DEFINE_LIBRARY(TOKENWAY_LIBRARY, m) {
  m.def("experts_forward(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate, int gate_qtype, Tensor up, "
        "int up_qtype, Tensor down, int down_qtype, int num_experts, int intermediate, Tensor? gate_bias, "
        "Tensor? up_bias, Tensor? down_bias, int activation, float alpha, float limit, Tensor? gate_scales=None, "
        "Tensor? up_scales=None, Tensor? down_scales=None) -> Tensor",
        &experts_forward);
  m.def("raw_linear(Tensor x, Tensor weight, int qtype, Tensor? bias) -> Tensor", &raw_linear);
  m.def("raw_linear_out(Tensor x, Tensor weight, int qtype, Tensor? bias, Tensor(a!) out) -> ()", &raw_linear_out);
  m.def("decode_rows(Tensor weight, int qtype, int in_features, Tensor ids) -> Tensor", &decode_rows);
  m.def("reads(int qtype) -> bool", &reads);
  m.def("plain_read(Tensor buffer) -> int", &plain_read);
  m.def("isa() -> str", &isa);
  m.def("fast() -> bool", &fast);
}
