// Matmuls on GGUF-quantized weights, used as they are stored (never dequantized to floats).
//
//   y (T, N) = x (T, K) @ W.T (+ bias),  W (N, K) in 32-weight blocks, each with a scale d and an offset m:
//     Q4_1: w = d * q + m,          q in 0..15 (two per byte: byte j holds element j low, j + 16 high)
//     Q8_0: w = d * q,  q in -128..127, kept as q + 128 (0..255) with m = -128 * d, so both types
//           are "unsigned codes times d, plus m" and share one kernel.
//
// The activations are quantized per 32-block too (int8, scale dx = max|x| / 127, block sum
// sx = dx * sum(qx)), as llama.cpp does, so a block's dot product is
//     sum_j w_j x_j  ~=  d * dx * sum_j q_j qx_j  +  m * sx,
// one integer dot product (AVX512-VNNI vpdpbusd: 64 unsigned x signed byte products per
// instruction) and two float multiply-adds. A 512-bit register holds two blocks, so the integer
// sums of its lanes 0-7 belong to the first block and 8-15 to the second; each lane is scaled by
// its block's d * dx and all lanes of a row are summed once at the end.
//
// Work: rows of W in chunks (parallel, each chunk's weights small enough to stay in L2), then
// tokens in tiles of up to 8 (a register accumulator each): a weight pair is unpacked once per
// tile. At one token it reads each weight byte once: the matmul runs at memory speed on ~4.5
// bits per weight where bfloat16 reads 16.
//
// On CPUs without AVX512-VNNI a scalar loop computes the same thing (tests and odd machines;
// `fast()` says which one this build has, and the engine only picks quantized weights when fast).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int QK = 32;           // weights per block
constexpr int64_t kChunkBytes = 96 * 1024;  // weight bytes per work item
constexpr int kTile = 8;         // tokens per register tile

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

// Activations quantized per block: codes (T, K) int8, and per block dx and sx.
struct QuantizedActivations {
  std::vector<int8_t> codes;
  std::vector<float> dx, sx;  // (T, K / 32)
};

void quantize_activations(const float* x, int64_t rows, int64_t k, QuantizedActivations& out) {
  const int64_t blocks = k / QK;
  out.codes.resize(rows * k);
  out.dx.resize(rows * blocks);
  out.sx.resize(rows * blocks);
  at::parallel_for(0, rows * blocks, 256, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = item / blocks, block = item % blocks;
      const float* src = x + row * k + block * QK;
      int8_t* dst = out.codes.data() + row * k + block * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
      __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
      float amax = 0.0f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int sum = 0;
      for (int j = 0; j < QK; ++j) {
        const int q = int(std::nearbyint(src[j] * inv));
        dst[j] = int8_t(std::clamp(q, -127, 127));
        sum += dst[j];
      }
#endif
      out.dx[item] = d;
      out.sx[item] = d * float(sum);
    }
  });
}

struct Weights {
  const uint8_t* codes;  // (N, row_code_bytes)
  const uint16_t* d;     // (N, K / 32) fp16
  const uint16_t* m;     // (N, K / 32) fp16
  int64_t n, k, row_code_bytes;
  bool four_bit;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kFast = true;

// Two blocks of codes as 64 unsigned bytes in element order.
template <bool FourBit>
inline __m512i load_pair(const uint8_t* codes) {
  if constexpr (FourBit) {
    // 32 bytes [a (16), b (16)] -> [a & 15, a >> 4, b & 15, b >> 4]
    const __m512i both = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), both);
    const __m512i shifted = _mm512_mask_blend_epi64(0xCC, twice, _mm512_srli_epi16(twice, 4));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_loadu_si512(codes);
  }
}

// A pair's lanes: block 2j in lanes 0-7, block 2j+1 in 8-15, from 16 blocks' values.
inline __m512 pair_lanes(__m512 sixteen, int j) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(2 * j),
                                         _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  return _mm512_permutexvar_ps(index, sixteen);
}

inline __m512 load_fp16x16(const uint16_t* p, int count) {
  if (count == 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << count) - 1), p));
}

// One weight row against TT tokens: out[t] = sum over the row.
// dx_lanes / sx_lanes: (T, K / 64, 16): each pair's dx (and sx / 8) spread over its lanes.
template <bool FourBit, int TT>
inline void row_tile(const Weights& w, int64_t row, const int8_t* codes_x, const float* dx_lanes,
                     const float* sx_lanes, int64_t k, float* out) {
  const int64_t blocks = k / QK, pairs = blocks / 2;
  const uint8_t* row_codes = w.codes + row * w.row_code_bytes;
  const uint16_t* row_d = w.d + row * blocks;
  const uint16_t* row_m = w.m + row * blocks;
  constexpr int pair_bytes = FourBit ? QK : 2 * QK;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t group = 0; group < pairs; group += 8) {
    const int in_group = int(std::min<int64_t>(8, pairs - group));
    const __m512 d16 = load_fp16x16(row_d + 2 * group, 2 * in_group);
    const __m512 m16 = load_fp16x16(row_m + 2 * group, 2 * in_group);
    for (int j = 0; j < in_group; ++j) {
      const int64_t pair = group + j;
      const __m512i wv = load_pair<FourBit>(row_codes + pair * pair_bytes);
      const __m512 dw = pair_lanes(d16, j), mw = pair_lanes(m16, j);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const __m512i xv = _mm512_loadu_si512(codes_x + t * k + pair * 2 * QK);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(dx_lanes + (t * pairs + pair) * 16));
        acc[t] = _mm512_fmadd_ps(dot, scale, acc[t]);
        acc[t] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(sx_lanes + (t * pairs + pair) * 16), acc[t]);
      }
    }
  }
  for (int t = 0; t < TT; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}

template <bool FourBit>
void rows_times_tokens(const Weights& w, int64_t row_begin, int64_t row_end, const QuantizedActivations& a,
                       const std::vector<float>& dx_lanes, const std::vector<float>& sx_lanes, int64_t tokens,
                       float* y) {
  const int64_t k = w.k, pairs = k / (2 * QK);
  float partial[kTile];
  for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
    const int tile = int(std::min<int64_t>(kTile, tokens - t0));
    const int8_t* codes_x = a.codes.data() + t0 * k;
    const float* dxl = dx_lanes.data() + t0 * pairs * 16;
    const float* sxl = sx_lanes.data() + t0 * pairs * 16;
    for (int64_t row = row_begin; row < row_end; ++row) {
      switch (tile) {
        case 8: row_tile<FourBit, 8>(w, row, codes_x, dxl, sxl, k, partial); break;
        case 7: row_tile<FourBit, 7>(w, row, codes_x, dxl, sxl, k, partial); break;
        case 6: row_tile<FourBit, 6>(w, row, codes_x, dxl, sxl, k, partial); break;
        case 5: row_tile<FourBit, 5>(w, row, codes_x, dxl, sxl, k, partial); break;
        case 4: row_tile<FourBit, 4>(w, row, codes_x, dxl, sxl, k, partial); break;
        case 3: row_tile<FourBit, 3>(w, row, codes_x, dxl, sxl, k, partial); break;
        case 2: row_tile<FourBit, 2>(w, row, codes_x, dxl, sxl, k, partial); break;
        default: row_tile<FourBit, 1>(w, row, codes_x, dxl, sxl, k, partial); break;
      }
      for (int t = 0; t < tile; ++t) y[(t0 + t) * w.n + row] = partial[t];
    }
  }
}

void matmul(const Weights& w, const QuantizedActivations& a, int64_t tokens, float* y) {
  const int64_t k = w.k, blocks = k / QK, pairs = blocks / 2;
  // Each pair's dx and sx / 8 over its 16 lanes (lanes 0-7: first block; 8-15: second).
  std::vector<float> dx_lanes(tokens * pairs * 16), sx_lanes(tokens * pairs * 16);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t p = 0; p < pairs; ++p)
      for (int lane = 0; lane < 16; ++lane) {
        const int64_t block = t * blocks + 2 * p + lane / 8;
        dx_lanes[(t * pairs + p) * 16 + lane] = a.dx[block];
        sx_lanes[(t * pairs + p) * 16 + lane] = a.sx[block] * 0.125f;
      }
  const int64_t row_bytes = w.row_code_bytes + 4 * blocks;
  const int64_t threads = at::get_num_threads();
  int64_t chunks = std::max<int64_t>(threads, (w.n * row_bytes + kChunkBytes - 1) / kChunkBytes);
  chunks = (chunks + threads - 1) / threads * threads;
  const int64_t rows_per_chunk = (w.n + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; ++chunk) {
      const int64_t begin = chunk * rows_per_chunk, end = std::min(w.n, begin + rows_per_chunk);
      if (begin >= end) continue;
      if (w.four_bit)
        rows_times_tokens<true>(w, begin, end, a, dx_lanes, sx_lanes, tokens, y);
      else
        rows_times_tokens<false>(w, begin, end, a, dx_lanes, sx_lanes, tokens, y);
    }
  });
}

#else
constexpr bool kFast = false;

void matmul(const Weights& w, const QuantizedActivations& a, int64_t tokens, float* y) {
  const int64_t k = w.k, blocks = k / QK;
  at::parallel_for(0, w.n, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const uint8_t* codes = w.codes + row * w.row_code_bytes;
      for (int64_t t = 0; t < tokens; ++t) {
        const int8_t* x = a.codes.data() + t * k;
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          int dot = 0;
          for (int j = 0; j < QK; ++j) {
            int q;
            if (w.four_bit) {
              const uint8_t byte = codes[b * 16 + (j % 16)];
              q = j < 16 ? (byte & 15) : (byte >> 4);
            } else {
              q = codes[b * QK + j];
            }
            dot += q * x[b * QK + j];
          }
          total += fp16_to_float(w.d[row * blocks + b]) * a.dx[t * blocks + b] * float(dot) +
                   fp16_to_float(w.m[row * blocks + b]) * a.sx[t * blocks + b];
        }
        y[t * w.n + row] = total;
      }
    }
  });
}
#endif

bool fast() { return kFast; }

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                        int64_t bits, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "x (T, K), codes (N, K * bits / 8) uint8");
  const int64_t tokens = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(k % (2 * QK) == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(codes.size(1) == k * bits / 8, "codes have ", codes.size(1), " bytes per row, expected ", k * bits / 8);
  for (const at::Tensor* scale : {&d, &m})
    TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->is_contiguous() && scale->dim() == 2 &&
                    scale->size(0) == n && scale->size(1) == k / QK,
                "d and m: (N, K / 32) float16");
  const at::Tensor input = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  if (tokens == 0 || n == 0) return y;
  QuantizedActivations activations;
  quantize_activations(input.data_ptr<float>(), tokens, k, activations);
  const Weights w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                  reinterpret_cast<const uint16_t*>(m.data_ptr()), n, k, codes.size(1), bits == 4};
  matmul(w, activations, tokens, y.data_ptr<float>());
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == n, "bias has ", bias->numel(), " values, expected ", n);
    y.add_(bias->to(at::kFloat));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(tokenway_quant, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor d, Tensor m, int bits, Tensor? bias) -> Tensor", &quant_linear);
  m.def("fast() -> bool", &fast);
}
