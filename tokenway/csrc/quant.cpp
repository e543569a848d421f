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

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kFast = true;

// Activations as each path reads them, made once per call.
struct Activations {
  const void* x;              // (T, K): bfloat16 bits, or float32
  std::vector<uint16_t> xb;   // float32 input to bfloat16 products: x rounded to bfloat16 (x points here)
  std::vector<uint16_t> x16;  // bfloat16 Q8_0: 16 x, exact
  std::vector<float> sums;    // (T, blocks): sum of each block's x, as the products see them
};

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
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + si)));
    const __m512 offset =
        FourBit ? _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f),
                                   _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + si))))
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
    const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + si)));
    // Half of each row's offset term goes to each of its two parity lanes.
    const __m512 offset16 =
        FourBit ? _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + si))),
                                _mm512_set1_ps(0.5f))
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

template <bool FourBit, bool Bf16, int TT>
inline void group_tile(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y) {
#if defined(__AVX512BF16__)
  if constexpr (Bf16) return group_tile_bf16<FourBit, TT>(w, g, a, t0, y);
#endif
  if constexpr (!Bf16) group_tile_fp32<FourBit, TT>(w, g, a, t0, y);
}

template <bool FourBit, bool Bf16>
void groups_times_tokens(const Weights& w, int64_t group_begin, int64_t group_end, const Activations& a,
                         int64_t tokens, float* y) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
    const int tile = int(std::min<int64_t>(kTile, tokens - t0));
    for (int64_t g = group_begin; g < group_end; ++g) {
      switch (tile) {
        case 8: group_tile<FourBit, Bf16, 8>(w, g, a, t0, y); break;
        case 7: group_tile<FourBit, Bf16, 7>(w, g, a, t0, y); break;
        case 6: group_tile<FourBit, Bf16, 6>(w, g, a, t0, y); break;
        case 5: group_tile<FourBit, Bf16, 5>(w, g, a, t0, y); break;
        case 4: group_tile<FourBit, Bf16, 4>(w, g, a, t0, y); break;
        case 3: group_tile<FourBit, Bf16, 3>(w, g, a, t0, y); break;
        case 2: group_tile<FourBit, Bf16, 2>(w, g, a, t0, y); break;
        default: group_tile<FourBit, Bf16, 1>(w, g, a, t0, y); break;
      }
    }
  }
}

// x_is_float: a float32 x for bfloat16 products, rounded here (to nearest even, as torch's
// .to(torch.bfloat16)) rather than by a separate torch op per matmul.
Activations prepare(const Weights& w, const void* x, bool x_is_float, bool bf16, int64_t tokens) {
  const int64_t k = w.k, blocks = w.blocks();
  Activations a{x, {}, {}, std::vector<float>(tokens * blocks)};
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

// x: float32 (T, K), or bfloat16 when bf16 (products then in bfloat16 as a bfloat16 model's are).
void matmul(const Weights& w, const void* x, bool x_is_float, bool bf16, int64_t tokens, float* y) {
  const Activations a = prepare(w, x, x_is_float, bf16, tokens);
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
      if (w.four_bit && bf16)
        groups_times_tokens<true, true>(w, begin, end, a, tokens, y);
      else if (w.four_bit)
        groups_times_tokens<true, false>(w, begin, end, a, tokens, y);
      else if (bf16)
        groups_times_tokens<false, true>(w, begin, end, a, tokens, y);
      else
        groups_times_tokens<false, false>(w, begin, end, a, tokens, y);
    }
  });
}

#else
constexpr bool kFast = false;

void matmul(const Weights& w, const void* input, bool /*x_is_float: always*/, bool /*bf16: never requested*/,
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kBf16 = true;
#else
constexpr bool kBf16 = false;
#endif

bool has_bf16() { return kBf16; }

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
                        int64_t n, int64_t bits, bool bf16, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x: (T, K) on the CPU");
  const int64_t tokens = x.size(0), k = x.size(1);
  const Weights w = checked_weights(codes, d, m, n, k, bits);
  bf16 = bf16 && kBf16;  // elsewhere float32 products
  // bfloat16 products take a bfloat16 x as it is and round a float32 one themselves.
  const bool keep_float = bf16 && x.scalar_type() == at::kFloat;
  const at::Tensor input = x.to(bf16 && !keep_float ? at::kBFloat16 : at::kFloat).contiguous();
  at::Tensor y = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  if (tokens == 0 || n == 0) return y;
  matmul(w, input.data_ptr(), input.scalar_type() == at::kFloat, bf16, tokens, y.data_ptr<float>());
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
  m.def("quant_linear(Tensor x, Tensor codes, Tensor d, Tensor m, int n, int bits, bool bf16, Tensor? bias) -> Tensor",
        &quant_linear);
  m.def("fast() -> bool", &fast);
  m.def("has_bf16() -> bool", &has_bf16);
  m.def("dequantize(Tensor codes, Tensor d, Tensor m, int n, int k, int bits, ScalarType dtype) -> Tensor",
        &dequantize);
}
