// Matmuls on GGUF-quantized weights, read as they are stored (never kept as floats).
//
//   y (T, N) = x (T, K) @ W.T (+ bias),  W (N, K) in blocks of 32 weights with a scale d and offset m:
//     Q4_1: w = d * q + m, q in 0..15
//     Q8_0: w = d * q,     q in -128..127 (stored as u = q + 128)
//
// Layout (models/quant.py relays GGUF's blocks once at load): rows in groups of 16, and for each
// group and block a run of 32-byte lines; line e holds, for the 16 rows in turn, the codes of two
// neighbouring elements (byte 2r + j: row r, element 2e + j). Q4_1 packs two such elements a
// byte (low nibble: element 2e + j, high: 16 + 2e + j; 8 lines a block); Q8_0 one (16 lines).
// d and m are (groups, blocks, 16) fp16: a block's 16 scales are one vector load.
//
// So a vector lane is a row: 16 rows' products accumulate side by side and a block's scale is
// applied to all 16 at once, with no horizontal sum per row and no per-row set-up.
//
// bfloat16 (a bfloat16 model, AVX512-BF16): a 4-bit code q OR 0x4300 is the bfloat16 of 128 + q,
// exactly, so a line becomes 32 bfloat16 weights in two integer ops, and vdpbf16ps (with the two
// elements' activations broadcast) sums 16 rows x 2 products an instruction: S = sum x (128 + q).
// Then x . w = d S + (m - 128 d) sum(x), the block sums of x taken once per call. Q8_0's byte
// u = 16 uh + ul is met as two such nibbles (uh against 16 x, exact in bfloat16):
// x . w = d (S - 2304 sum(x)). The weights are the exact d q + m; only the activations are bfloat16,
// as a bfloat16 model's are.
//
// int8 (AVX512-VNNI; the default for a bfloat16 model, as llama.cpp meets its blocks): each token's
// activations are quantized per block of 32 to int8 with one float scale (x ~ dx qx, |qx| <= 127,
// round to nearest), and vpdpbusd multiplies the unsigned weight codes by them four products a
// lane: 16 rows x 4 products an instruction, twice vdpbf16ps's count, with no conversion of the
// codes beyond a nibble mask. A pair of lines is one 64-byte load whose words are interleaved
// (vpermw) so lane r holds row r's elements 4p..4p+3. Then, with S the integer sum of code x qx:
//   Q4_1: x . w = d dx S + m dx sum(qx)
//   Q8_0: x . w = d dx (S - 128 sum(qx))
// which is exactly w . (dx qx).
// The weights are exact; the activations carry int8's rounding, as in llama.cpp's Q8 dot products.
//
// float32 (a float32 model, or no AVX512-BF16): codes widened to float32 lanes of (row, element
// parity), met in multiply-adds by the two elements' activations; the two parities are added at
// the end. Products are the float model's with the dequantized weights, up to summation order.
//
// Work: groups of 16 rows in chunks (parallel; a chunk's weights stay in L2 across token tiles),
// tokens in tiles of up to 8. AVX512F/BW; elsewhere a scalar loop computes the same (tests and odd
// machines: `fast()` says which was built, and the engine picks quantized weights only when fast).

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
#include <vector>

namespace {

#include "vec.h"

constexpr int QK = 32;                      // weights per block
constexpr int kRows = 16;                   // rows per group (a vector of lanes)
constexpr int64_t kChunkBytes = 96 * 1024;  // weight bytes per work item
constexpr int kTile = 8;                    // tokens per register tile

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while (!(mantissa & 0x400)) { mantissa <<= 1; --exponent; }
      bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

struct Weights {
  const uint8_t* codes;  // (groups, blocks, lines, 32)
  const uint16_t* d;     // (groups, blocks, 16) fp16
  const uint16_t* m;     // (groups, blocks, 16) fp16; Q4_1 only
  int64_t n, k;
  bool four_bit;

  int64_t blocks() const { return k / QK; }
  int64_t groups() const { return (n + kRows - 1) / kRows; }
  int64_t lines() const { return four_bit ? 8 : 16; }
  int64_t block_bytes() const { return lines() * 32; }  // 16 rows' codes of one block
  const uint8_t* block_codes(int64_t g, int64_t b) const { return codes + (g * blocks() + b) * block_bytes(); }
  int64_t scale_index(int64_t g, int64_t b) const { return (g * blocks() + b) * kRows; }

  // Row `row`'s weights as floats (the reference: the scalar path and dequantize use it).
  void row(int64_t r, float* out) const {
    const int64_t g = r / kRows, lane = r % kRows;
    for (int64_t b = 0; b < blocks(); ++b) {
      const uint8_t* c = block_codes(g, b);
      const float scale = fp16_to_float(d[scale_index(g, b) + lane]);
      const float offset = four_bit ? fp16_to_float(m[scale_index(g, b) + lane]) : 0.0f;
      for (int j = 0; j < QK; ++j) {
        float q;
        if (four_bit) {
          const int jj = j % 16;
          const uint8_t byte = c[(jj / 2) * 32 + lane * 2 + jj % 2];
          q = float(j < 16 ? (byte & 15) : (byte >> 4));
        } else {
          q = float(int(c[(j / 2) * 32 + lane * 2 + j % 2]) - 128);
        }
        out[b * QK + j] = q * scale + offset;
      }
    }
  }
};

// The precision activations meet the weights in (the weights are always exact).
enum class Products { kFloat32, kBFloat16, kInt8 };

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kFast = true;

// Activations as each path reads them, made once per call.
struct Activations {
  const void* x;              // (T, K): bfloat16 bits, or float32
  std::vector<uint16_t> xb;   // float32 input to bfloat16 products: x rounded to bfloat16 (x points here)
  std::vector<uint16_t> x16;  // bfloat16 Q8_0: 16 x, exact
  std::vector<float> sums;    // (T, blocks): sum of each block's x, as the products see them
  // int8 products
  std::vector<int8_t> xq;     // (T, K): x / dx rounded, per block
  std::vector<float> dx;      // (T, blocks): the block's scale
  std::vector<float> offset;  // (T, blocks): Q4_1 dx sum(qx); Q8_0 -128 dx sum(qx)
};

// 16 fp16 values from `at` (a block's d or m, a row of the group each) as floats.
inline __m512 halves(const uint16_t* values, int64_t at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + at)));
}

inline void store_rows(const Weights& w, int64_t g, __m512 value, float* y_row) {
  const int64_t valid = std::min<int64_t>(kRows, w.n - g * kRows);
  _mm512_mask_storeu_ps(y_row + g * kRows, __mmask16((1u << valid) - 1), value);
}

#if defined(__AVX512BF16__)
inline __m512bh pair_of(const uint16_t* x) {  // two neighbouring bfloat16 activations in every lane
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

template <bool FourBit, int TT>
void group_tile_bf16(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y) {
  constexpr int kChains = TT == 1 ? 4 : TT == 2 ? 2 : 1;  // independent dot-product chains per token
  const int64_t k = w.k, blocks = w.blocks();
  const __m512i low_nibble = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + t0 * k;
  const uint16_t* x16 = FourBit ? nullptr : a.x16.data() + t0 * k;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* codes = w.block_codes(g, b);
    __m512 s[TT][kChains];
    for (int t = 0; t < TT; ++t)
      for (int c = 0; c < kChains; ++c) s[t][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int e = 0; e < (FourBit ? 8 : 16); ++e) {
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + e * 32)));
      const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(words, low_nibble, magic, 0xEA);  // (w & 15) | magic
      const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), magic);
      const int c = e % kChains;
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const uint16_t* xt = x + t * k + b * QK;
        if constexpr (FourBit) {
          s[t][c] = _mm512_dpbf16_ps(s[t][c], lo, pair_of(xt + 2 * e));
          s[t][c] = _mm512_dpbf16_ps(s[t][c], hi, pair_of(xt + 16 + 2 * e));
        } else {
          s[t][c] = _mm512_dpbf16_ps(s[t][c], lo, pair_of(xt + 2 * e));
          s[t][c] = _mm512_dpbf16_ps(s[t][c], hi, pair_of(x16 + t * k + b * QK + 2 * e));
        }
      }
    }
    const int64_t si = w.scale_index(g, b);
    const __m512 d = halves(w.d, si);
    const __m512 offset = FourBit ? _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), halves(w.m, si))
                                  : _mm512_mul_ps(d, _mm512_set1_ps(-2304.0f));
    for (int t = 0; t < TT; ++t) {
      __m512 total = s[t][0];
      for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, s[t][c]);
      acc[t] = _mm512_fmadd_ps(total, d, acc[t]);
      acc[t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.sums[(t0 + t) * blocks + b]), acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) store_rows(w, g, acc[t], y + (t0 + t) * w.n);
}
#endif

#if defined(__AVX512VNNI__)
// Words of a pair of lines (line 2p: words 0..15, line 2p + 1: words 16..31, word r = row r's two
// codes) interleaved so dword r is row r's: words r and 16 + r.
inline __m512i rows_of_line_pair() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

inline __m512i quad_of(const int8_t* x) {  // four neighbouring int8 activations in every lane
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

template <bool FourBit, int TT>
void group_tile_int8(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y) {
  constexpr int kChains = TT == 1 ? 4 : TT == 2 ? 2 : 1;  // independent dot-product chains per token
  constexpr int kPairs = FourBit ? 4 : 8;                  // line pairs a block
  const int64_t k = w.k, blocks = w.blocks();
  const __m512i interleave = rows_of_line_pair(), low_nibble = _mm512_set1_epi8(0x0F);
  const int8_t* x = a.xq.data() + t0 * k;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* codes = w.block_codes(g, b);
    __m512i s[TT][kChains];
    for (int t = 0; t < TT; ++t)
      for (int c = 0; c < kChains; ++c) s[t][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int p = 0; p < kPairs; ++p) {
      const __m512i lines = _mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(codes + p * 64));
      const __m512i lo = FourBit ? _mm512_and_si512(lines, low_nibble) : lines;
      const __m512i hi = FourBit ? _mm512_and_si512(_mm512_srli_epi16(lines, 4), low_nibble) : lines;
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int8_t* xt = x + t * k + b * QK + 4 * p;
        if constexpr (FourBit) {
          s[t][(2 * p) % kChains] = _mm512_dpbusd_epi32(s[t][(2 * p) % kChains], lo, quad_of(xt));
          s[t][(2 * p + 1) % kChains] = _mm512_dpbusd_epi32(s[t][(2 * p + 1) % kChains], hi, quad_of(xt + 16));
        } else {
          s[t][p % kChains] = _mm512_dpbusd_epi32(s[t][p % kChains], lo, quad_of(xt));
        }
      }
    }
    const int64_t si = w.scale_index(g, b);
    const __m512 d = halves(w.d, si);
    const __m512 m = FourBit ? halves(w.m, si) : _mm512_setzero_ps();
    for (int t = 0; t < TT; ++t) {
      __m512i total = s[t][0];
      for (int c = 1; c < kChains; ++c) total = _mm512_add_epi32(total, s[t][c]);
      const int64_t tb = (t0 + t) * blocks + b;
      const __m512 dx = _mm512_set1_ps(a.dx[tb]), offset = _mm512_set1_ps(a.offset[tb]);
      if constexpr (FourBit) {
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), dx), d, acc[t]);
        acc[t] = _mm512_fmadd_ps(m, offset, acc[t]);
      } else {
        acc[t] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(total), dx, offset), d, acc[t]);
      }
    }
  }
  for (int t = 0; t < TT; ++t) store_rows(w, g, acc[t], y + (t0 + t) * w.n);
}
#endif

// float32: lanes are (row, element parity) for 8 rows; two halves make the group's 16 rows.
template <bool FourBit, int TT>
void group_tile_fp32(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y) {
  const int64_t k = w.k, blocks = w.blocks();
  const float* x = static_cast<const float*>(a.x) + t0 * k;
  const __m512i first_half = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
  __m512 acc[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* codes = w.block_codes(g, b);
    __m512 s[TT][2];
    for (int t = 0; t < TT; ++t) s[t][0] = s[t][1] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int e = 0; e < (FourBit ? 8 : 16); ++e) {
      for (int h = 0; h < 2; ++h) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + e * 32 + h * 16)));
        if constexpr (FourBit) {
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            const float* xt = x + t * k + b * QK;
            double lo_pair, hi_pair;
            std::memcpy(&lo_pair, xt + 2 * e, sizeof(double));
            std::memcpy(&hi_pair, xt + 16 + 2 * e, sizeof(double));
            s[t][h] = _mm512_fmadd_ps(lo, _mm512_castpd_ps(_mm512_set1_pd(lo_pair)), s[t][h]);
            s[t][h] = _mm512_fmadd_ps(hi, _mm512_castpd_ps(_mm512_set1_pd(hi_pair)), s[t][h]);
          }
        } else {
          const __m512 u = _mm512_cvtepi32_ps(bytes);  // q + 128
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            double pair;
            std::memcpy(&pair, x + t * k + b * QK + 2 * e, sizeof(double));
            s[t][h] = _mm512_fmadd_ps(u, _mm512_castpd_ps(_mm512_set1_pd(pair)), s[t][h]);
          }
        }
      }
    }
    const int64_t si = w.scale_index(g, b);
    const __m512 d16 = halves(w.d, si);
    // Half of each row's offset term goes to each of its two parity lanes.
    const __m512 offset16 = FourBit ? _mm512_mul_ps(halves(w.m, si), _mm512_set1_ps(0.5f))
                                    : _mm512_mul_ps(d16, _mm512_set1_ps(-64.0f));
    for (int h = 0; h < 2; ++h) {
      const __m512i index = h == 0 ? first_half : second_half;
      const __m512 d = _mm512_permutexvar_ps(index, d16), offset = _mm512_permutexvar_ps(index, offset16);
      for (int t = 0; t < TT; ++t) {
        acc[t][h] = _mm512_fmadd_ps(s[t][h], d, acc[t][h]);
        acc[t][h] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.sums[(t0 + t) * blocks + b]), acc[t][h]);
      }
    }
  }
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int t = 0; t < TT; ++t) {
    const __m512 rows = _mm512_add_ps(_mm512_permutex2var_ps(acc[t][0], even, acc[t][1]),
                                      _mm512_permutex2var_ps(acc[t][0], odd, acc[t][1]));
    store_rows(w, g, rows, y + (t0 + t) * w.n);
  }
}

template <bool FourBit, Products P, int TT>
inline void group_tile(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y) {
#if defined(__AVX512VNNI__)
  if constexpr (P == Products::kInt8) return group_tile_int8<FourBit, TT>(w, g, a, t0, y);
#endif
#if defined(__AVX512BF16__)
  if constexpr (P == Products::kBFloat16) return group_tile_bf16<FourBit, TT>(w, g, a, t0, y);
#endif
  if constexpr (P == Products::kFloat32) group_tile_fp32<FourBit, TT>(w, g, a, t0, y);
}

template <bool FourBit, Products P>
void groups_times_tokens(const Weights& w, int64_t group_begin, int64_t group_end, const Activations& a,
                         int64_t tokens, float* y) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
    const int tile = int(std::min<int64_t>(kTile, tokens - t0));
    for (int64_t g = group_begin; g < group_end; ++g) {
      switch (tile) {
        case 8: group_tile<FourBit, P, 8>(w, g, a, t0, y); break;
        case 7: group_tile<FourBit, P, 7>(w, g, a, t0, y); break;
        case 6: group_tile<FourBit, P, 6>(w, g, a, t0, y); break;
        case 5: group_tile<FourBit, P, 5>(w, g, a, t0, y); break;
        case 4: group_tile<FourBit, P, 4>(w, g, a, t0, y); break;
        case 3: group_tile<FourBit, P, 3>(w, g, a, t0, y); break;
        case 2: group_tile<FourBit, P, 2>(w, g, a, t0, y); break;
        default: group_tile<FourBit, P, 1>(w, g, a, t0, y); break;
      }
    }
  }
}

#if defined(__AVX512VNNI__)
// Each token's blocks of 32 activations to int8 with one scale each (round to nearest even).
void quantize_int8(const Weights& w, const void* x, bool x_is_float, int64_t tokens, Activations& a) {
  const int64_t k = w.k, blocks = w.blocks();
  a.xq.resize(tokens * k);
  a.dx.resize(tokens * blocks);
  a.offset.resize(tokens * blocks);
  for (int64_t i = 0; i < tokens * blocks; ++i) {
    __m512 v[2];
    for (int h = 0; h < 2; ++h)
      v[h] = x_is_float ? _mm512_loadu_ps(static_cast<const float*>(x) + i * QK + h * 16)
                        : load_bf16(static_cast<const uint16_t*>(x) + i * QK + h * 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float dx = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i q[2];
    for (int h = 0; h < 2; ++h) {
      q[h] = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inverse)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.xq.data() + i * QK + h * 16), _mm512_cvtsepi32_epi8(q[h]));
    }
    // The products are the exact ones with the int8 activations dx qx, offsets too: sum(x) in Q4_1's
    // m term would leave the error of d dx S uncentred (codes 0..15 average 7.5), 2x larger.
    const float sum = dx * float(_mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1])));
    a.dx[i] = dx;
    a.offset[i] = w.four_bit ? sum : -128.0f * sum;
  }
}
#endif

// x_is_float: a float32 x for bfloat16 products, rounded here (to nearest even, as torch's
// .to(torch.bfloat16)) rather than by a separate torch op per matmul.
Activations prepare(const Weights& w, const void* x, bool x_is_float, Products products, int64_t tokens) {
  Activations a{x, {}, {}, {}, {}, {}, {}};
#if defined(__AVX512VNNI__)
  if (products == Products::kInt8) {
    quantize_int8(w, x, x_is_float, tokens, a);
    return a;
  }
#endif
  const bool bf16 = products == Products::kBFloat16;
  const int64_t k = w.k, blocks = w.blocks();
  a.sums.resize(tokens * blocks);
#if defined(__AVX512BF16__)
  if (bf16 && x_is_float) {
    a.xb.resize(tokens * k);
    const float* src = static_cast<const float*>(x);
    int64_t i = 0;
    for (; i + 16 <= tokens * k; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.xb.data() + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    for (; i < tokens * k; ++i) a.xb[i] = c10::BFloat16(src[i]).x;
    a.x = x = a.xb.data();
  }
#endif
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      float sum = 0.0f;
      for (int j = 0; j < QK; ++j) {
        const int64_t i = t * k + b * QK + j;
        sum += bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
      }
      a.sums[t * blocks + b] = sum;
    }
  if (bf16 && !w.four_bit) {
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

// x: float32 or bfloat16 (T, K); bfloat16 only for bfloat16 or int8 products.
void matmul(const Weights& w, const void* x, bool x_is_float, Products products, int64_t tokens, float* y) {
  const Activations a = prepare(w, x, x_is_float, products, tokens);
  const int64_t group_bytes = w.blocks() * (w.block_bytes() + (w.four_bit ? 64 : 32));
  const int64_t threads = at::get_num_threads();
  int64_t chunks = std::max<int64_t>(threads, (w.groups() * group_bytes + kChunkBytes - 1) / kChunkBytes);
  chunks = std::min(w.groups(), (chunks + threads - 1) / threads * threads);
  const int64_t groups_per_chunk = (w.groups() + chunks - 1) / chunks;
  // Chunks are handed out one at a time, so a thread the OS preempts (the HTTP server and the
  // clients share these cores) holds up at most the chunk it is in.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t chunk; (chunk = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t begin = chunk * groups_per_chunk, end = std::min(w.groups(), begin + groups_per_chunk);
      if (begin >= end) continue;
      switch (products) {
        case Products::kInt8:
          w.four_bit ? groups_times_tokens<true, Products::kInt8>(w, begin, end, a, tokens, y)
                     : groups_times_tokens<false, Products::kInt8>(w, begin, end, a, tokens, y);
          break;
        case Products::kBFloat16:
          w.four_bit ? groups_times_tokens<true, Products::kBFloat16>(w, begin, end, a, tokens, y)
                     : groups_times_tokens<false, Products::kBFloat16>(w, begin, end, a, tokens, y);
          break;
        case Products::kFloat32:
          w.four_bit ? groups_times_tokens<true, Products::kFloat32>(w, begin, end, a, tokens, y)
                     : groups_times_tokens<false, Products::kFloat32>(w, begin, end, a, tokens, y);
          break;
      }
    }
  });
}

#else
constexpr bool kFast = false;

void matmul(const Weights& w, const void* input, bool /*x_is_float: always*/, Products /*always float32*/,
            int64_t tokens, float* y) {
  const float* x = static_cast<const float*>(input);
  const int64_t k = w.k;
  at::parallel_for(0, w.n, 16, [&](int64_t first, int64_t last) {
    std::vector<float> weight(k);
    for (int64_t r = first; r < last; ++r) {
      w.row(r, weight.data());
      for (int64_t t = 0; t < tokens; ++t) {
        float total = 0.0f;
        for (int64_t i = 0; i < k; ++i) total += x[t * k + i] * weight[i];
        y[t * w.n + r] = total;
      }
    }
  });
}
#endif

bool fast() { return kFast; }

// Which products this build computes (the vector path's; the scalar one has float32 only).
bool computes(Products products) {
  switch (products) {
    case Products::kFloat32: return true;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    case Products::kBFloat16: return true;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
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

Weights checked_weights(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t n, int64_t k,
                        int64_t bits) {
  TORCH_CHECK(codes.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(k % QK == 0, "in_features must be a multiple of 32");
  const int64_t groups = (n + kRows - 1) / kRows, blocks = k / QK;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == groups * blocks * (bits == 4 ? 256 : 512),
              "codes: ", groups * blocks * (bits == 4 ? 256 : 512), " bytes expected for ", n, " rows of ", k,
              " in_features, got ", codes.numel());
  for (const at::Tensor* scale : {&d, &m}) {
    if (scale == &m && bits == 8) continue;
    TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->is_contiguous() && scale->numel() == groups * blocks * kRows,
                "d and m: (groups, K / 32, 16) float16");
  }
  return Weights{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                 bits == 4 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr, n, k, bits == 4};
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                        int64_t n, int64_t bits, c10::string_view products_name,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x: (T, K) on the CPU");
  const int64_t tokens = x.size(0), k = x.size(1);
  const Weights w = checked_weights(codes, d, m, n, k, bits);
  const Products products = products_named(std::string(products_name));
  TORCH_CHECK(computes(products), "this build has no ", std::string(products_name), " products (has_products)");
  // bfloat16 and int8 products take a bfloat16 x as it is and a float32 one too (rounded as they read it).
  const bool as_is = products != Products::kFloat32 &&
                     (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  const at::Tensor input = (as_is ? x : x.to(at::kFloat)).contiguous();
  at::Tensor y = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  if (tokens == 0 || n == 0) return y;
  matmul(w, input.data_ptr(), input.scalar_type() == at::kFloat, products, tokens, y.data_ptr<float>());
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == n, "bias has ", bias->numel(), " values, expected ", n);
    y.add_(bias->to(at::kFloat));
  }
  return y;
}

// The float weight (N, K) in `dtype` (float32 or bfloat16): for long prompt chunks, where a
// GEMM library's blocked kernels beat reading each block once per 8-token tile.
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t n, int64_t k,
                      int64_t bits, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  const Weights w = checked_weights(codes, d, m, n, k, bits);
  at::Tensor out = at::empty({n, k}, codes.options().dtype(dtype));
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    std::vector<float> row(k);
    for (int64_t r = first; r < last; ++r) {
      w.row(r, row.data());
      if (dtype == at::kFloat) {
        std::memcpy(out.data_ptr<float>() + r * k, row.data(), k * sizeof(float));
      } else {
        c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + r * k;
        for (int64_t i = 0; i < k; ++i) dst[i] = c10::BFloat16(row[i]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenway_quant, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor d, Tensor m, int n, int bits, str products, Tensor? bias) -> Tensor",
        &quant_linear);
  m.def("fast() -> bool", &fast);
  m.def("has_products(str products) -> bool", &has_products);
  m.def("dequantize(Tensor codes, Tensor d, Tensor m, int n, int k, int bits, ScalarType dtype) -> Tensor",
        &dequantize);
}
