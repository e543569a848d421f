// Matmuls on GGUF-quantized weights, read as they are stored (never kept as floats).
//
//   y (T, N) = x (T, K) @ W.T (+ bias),  W (N, K) in blocks of 32 weights with a scale d and offset m:
//     Q4_1: w = d * q + m, q in 0..15, two per byte (byte j: element j in the low nibble, j + 16 high)
//     Q8_0: w = d * q,     q in -128..127 (m = 0)
//
// Each block is dequantized in registers (two vectors of 16 floats) and met by every token of
// a tile of up to 8: in float32 multiply-adds for a float32 model, or, for a bfloat16 model on
// a CPU with AVX512-BF16, rounded to bfloat16 and met by bfloat16 activations in vdpbf16ps
// (32 products an instruction, twice the float32 rate). Either way the arithmetic is the float
// model's with the dequantized weights (no int8 activations, unlike llama.cpp's vec_dot, whose
// rounding flipped near-ties of this 135M model's first token), and a weight byte is read once
// per tile. At one token the matmul is bound by memory: 5-8.5 bits a weight where bfloat16 reads 16.
//
// Work: rows of W in chunks (parallel; a chunk's weights stay in L2 across token tiles), tokens
// in tiles of up to 8 (a register accumulator each). AVX512F/BW; elsewhere a scalar loop computes
// the same (tests and odd machines: `fast()` says which one was built, and the engine picks
// quantized weights only when fast).

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

struct Weights {
  const uint8_t* codes;  // (N, row_code_bytes)
  const uint16_t* d;     // (N, K / 32) fp16
  const uint16_t* m;     // (N, K / 32) fp16
  int64_t n, k, row_code_bytes;
  bool four_bit;
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kFast = true;

// One block's 32 weights as floats, d * q + m, in element order (lo: 0-15, hi: 16-31).
template <bool FourBit>
inline void dequantize_block(const uint8_t* codes, __m512 d, __m512 m, __m512& lo, __m512& hi) {
  if constexpr (FourBit) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  }
  lo = _mm512_fmadd_ps(lo, d, m);
  hi = _mm512_fmadd_ps(hi, d, m);
}

// One weight row against TT tokens (rows of x, K apart; float32, or bfloat16 bits when Bf16):
// out[t] = x_t . w. d, m: the row's scales and offsets as floats (K / 32 each).
template <bool FourBit, bool Bf16, int TT>
inline void row_tile(const uint8_t* row_codes, const float* d, const float* m, const void* x, int64_t k,
                     float* out) {
  constexpr int block_bytes = FourBit ? QK / 2 : QK;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / QK; ++b) {
    __m512 lo, hi;
    dequantize_block<FourBit>(row_codes + b * block_bytes, _mm512_set1_ps(d[b]), _mm512_set1_ps(m[b]), lo, hi);
    if constexpr (Bf16) {
#if defined(__AVX512BF16__)
      // The block as 32 bfloat16 in element order; vdpbf16ps sums adjacent pairs: 32 products an instruction.
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
      const uint16_t* xb = static_cast<const uint16_t*>(x) + b * QK;
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t)
        acc[t] = _mm512_dpbf16_ps(acc[t], w, (__m512bh)_mm512_loadu_si512(xb + t * k));
#endif
    } else {
      const float* xf = static_cast<const float*>(x) + b * QK;
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + t * k), lo, acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + t * k + 16), hi, acc[t]);
      }
    }
  }
  for (int t = 0; t < TT; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}

inline void fp16_row(const uint16_t* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < count; ++i) dst[i] = fp16_to_float(src[i]);
}

template <bool FourBit, bool Bf16>
void rows_times_tokens(const Weights& w, int64_t row_begin, int64_t row_end, const void* x, int64_t tokens,
                       float* y) {
  const int64_t k = w.k, blocks = k / QK;
  std::vector<float> d(blocks), m(blocks);
  float partial[kTile];
  for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
    const int tile = int(std::min<int64_t>(kTile, tokens - t0));
    const void* xt = static_cast<const char*>(x) + t0 * k * (Bf16 ? 2 : 4);
    for (int64_t row = row_begin; row < row_end; ++row) {
      const uint8_t* codes = w.codes + row * w.row_code_bytes;
      fp16_row(w.d + row * blocks, blocks, d.data());
      fp16_row(w.m + row * blocks, blocks, m.data());
      switch (tile) {
        case 8: row_tile<FourBit, Bf16, 8>(codes, d.data(), m.data(), xt, k, partial); break;
        case 7: row_tile<FourBit, Bf16, 7>(codes, d.data(), m.data(), xt, k, partial); break;
        case 6: row_tile<FourBit, Bf16, 6>(codes, d.data(), m.data(), xt, k, partial); break;
        case 5: row_tile<FourBit, Bf16, 5>(codes, d.data(), m.data(), xt, k, partial); break;
        case 4: row_tile<FourBit, Bf16, 4>(codes, d.data(), m.data(), xt, k, partial); break;
        case 3: row_tile<FourBit, Bf16, 3>(codes, d.data(), m.data(), xt, k, partial); break;
        case 2: row_tile<FourBit, Bf16, 2>(codes, d.data(), m.data(), xt, k, partial); break;
        default: row_tile<FourBit, Bf16, 1>(codes, d.data(), m.data(), xt, k, partial); break;
      }
      for (int t = 0; t < tile; ++t) y[(t0 + t) * w.n + row] = partial[t];
    }
  }
}

// x: float32 (T, K), or bfloat16 when bf16 (products then in bfloat16 as a bfloat16 model's are).
void matmul(const Weights& w, const void* x, bool bf16, int64_t tokens, float* y) {
  const int64_t row_bytes = w.row_code_bytes + 4 * (w.k / QK);
  const int64_t threads = at::get_num_threads();
  int64_t chunks = std::max<int64_t>(threads, (w.n * row_bytes + kChunkBytes - 1) / kChunkBytes);
  chunks = (chunks + threads - 1) / threads * threads;
  const int64_t rows_per_chunk = (w.n + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; ++chunk) {
      const int64_t begin = chunk * rows_per_chunk, end = std::min(w.n, begin + rows_per_chunk);
      if (begin >= end) continue;
      if (w.four_bit && bf16)
        rows_times_tokens<true, true>(w, begin, end, x, tokens, y);
      else if (w.four_bit)
        rows_times_tokens<true, false>(w, begin, end, x, tokens, y);
      else if (bf16)
        rows_times_tokens<false, true>(w, begin, end, x, tokens, y);
      else
        rows_times_tokens<false, false>(w, begin, end, x, tokens, y);
    }
  });
}

#else
constexpr bool kFast = false;

void matmul(const Weights& w, const void* input, bool /*bf16: never requested*/, int64_t tokens, float* y) {
  const float* x = static_cast<const float*>(input);
  const int64_t k = w.k, blocks = k / QK;
  at::parallel_for(0, w.n, 16, [&](int64_t first, int64_t last) {
    std::vector<float> weight(k);
    for (int64_t row = first; row < last; ++row) {
      const uint8_t* codes = w.codes + row * w.row_code_bytes;
      for (int64_t b = 0; b < blocks; ++b) {
        const float d = fp16_to_float(w.d[row * blocks + b]), m = fp16_to_float(w.m[row * blocks + b]);
        for (int j = 0; j < QK; ++j) {
          const float q = w.four_bit ? float(j < 16 ? (codes[b * 16 + j] & 15) : (codes[b * 16 + j - 16] >> 4))
                                     : float(int8_t(codes[b * QK + j]));
          weight[b * QK + j] = q * d + m;
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        float total = 0.0f;
        for (int64_t i = 0; i < k; ++i) total += x[t * k + i] * weight[i];
        y[t * w.n + row] = total;
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

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                        int64_t bits, bool bf16, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "x (T, K), codes (N, K * bits / 8) uint8");
  const int64_t tokens = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(k % QK == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(codes.size(1) == k * bits / 8, "codes have ", codes.size(1), " bytes per row, expected ", k * bits / 8);
  for (const at::Tensor* scale : {&d, &m})
    TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->is_contiguous() && scale->dim() == 2 &&
                    scale->size(0) == n && scale->size(1) == k / QK,
                "d and m: (N, K / 32) float16");
  bf16 = bf16 && kBf16;  // elsewhere float32 products
  const at::Tensor input = x.to(bf16 ? at::kBFloat16 : at::kFloat).contiguous();
  at::Tensor y = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  if (tokens == 0 || n == 0) return y;
  const Weights w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                  reinterpret_cast<const uint16_t*>(m.data_ptr()), n, k, codes.size(1), bits == 4};
  matmul(w, input.data_ptr(), bf16, tokens, y.data_ptr<float>());
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == n, "bias has ", bias->numel(), " values, expected ", n);
    y.add_(bias->to(at::kFloat));
  }
  return y;
}

// The float weight (N, K) in `dtype` (float32 or bfloat16): for long prompt chunks, where a
// GEMM library's blocked kernels beat dequantizing each block once per 8-token tile.
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                      at::ScalarType dtype) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes uint8 (N, bytes)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t n = codes.size(0), k = codes.size(1) * 8 / bits, blocks = k / QK;
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() && m.is_contiguous() &&
                  d.numel() == n * blocks && m.numel() == n * blocks,
              "d and m: (N, K / 32) float16");
  at::Tensor out = at::empty({n, k}, codes.options().dtype(dtype));
  const uint8_t* src = codes.data_ptr<uint8_t>();
  const uint16_t* ds = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* ms = reinterpret_cast<const uint16_t*>(m.data_ptr());
  const int64_t row_bytes = codes.size(1);
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    std::vector<float> row(k);
    for (int64_t r = first; r < last; ++r) {
      const uint8_t* c = src + r * row_bytes;
      for (int64_t b = 0; b < blocks; ++b) {
        const float scale = fp16_to_float(ds[r * blocks + b]), offset = fp16_to_float(ms[r * blocks + b]);
        for (int j = 0; j < QK; ++j) {
          const float q = bits == 4 ? float(j < 16 ? (c[b * 16 + j] & 15) : (c[b * 16 + j - 16] >> 4))
                                    : float(int8_t(c[b * QK + j]));
          row[b * QK + j] = q * scale + offset;
        }
      }
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
  m.def("quant_linear(Tensor x, Tensor codes, Tensor d, Tensor m, int bits, bool bf16, Tensor? bias) -> Tensor",
        &quant_linear);
  m.def("fast() -> bool", &fast);
  m.def("has_bf16() -> bool", &has_bf16);
  m.def("dequantize(Tensor codes, Tensor d, Tensor m, int bits, ScalarType dtype) -> Tensor", &dequantize);
}
