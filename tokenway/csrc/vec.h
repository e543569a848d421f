// Vectors of W floats for the C++ kernels (attention.cpp, fused.cpp, quant.cpp): the few operations they
// need, per instruction set: 16 floats (AVX512), 8 (AVX2) or 1 (anything else), whatever
// -march=native allows. Included inside each kernel's anonymous namespace, after <immintrin.h>,
// <cstdint> and <cstring>.
#pragma once

// One bfloat16 (its bits) as a float.
inline float bf16_to_float(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

#if defined(__AVX512F__)
constexpr int W = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vmaxval(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec vround(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for whole n in [-126, 127].
inline Vec vexp2int(Vec n) {
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(bits);
}
// 2W bfloat16 values -> their even and odd elements as floats: one shift and one mask, no shuffle.
inline void load_bf16_pair(const uint16_t* p, Vec& even, Vec& odd) {
  __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xFFFF0000u))));
}
// W bfloat16 values in order.
inline Vec load_bf16(const uint16_t* p) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
// float -> bfloat16 bits (round to nearest even) in the high half of each 32-bit lane.
inline __m512i round_bf16(Vec v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}
inline void store_bf16_pair(uint16_t* p, Vec even, Vec odd) {
  __m512i lo = _mm512_srli_epi32(round_bf16(even), 16);
  __m512i hi = _mm512_and_si512(round_bf16(odd), _mm512_set1_epi32(int(0xFFFF0000u)));
  _mm512_storeu_si512(p, _mm512_or_si512(lo, hi));
}
inline void store_bf16(uint16_t* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16(v), 16)));
}
// acc[t] holds W partial sums of token t's score -> one vector of the W scores, in token order.
inline Vec transpose_sum(const Vec* acc) {
  Vec pairs[8], quads[4];
  for (int j = 0; j < 8; ++j) {  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    Vec a = acc[2 * j], b = acc[2 * j + 1];
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the lane sums of tokens 4j .. 4j+3
    Vec a = pairs[2 * j], b = pairs[2 * j + 1];
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Add the four 128-bit lanes of each quad: lane j of the result is quads[j]'s total.
  Vec low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  Vec high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline float vsum(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float vmaxval(Vec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline Vec vround(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vexp2int(Vec n) {
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(bits);
}
inline void load_bf16_pair(const uint16_t* p, Vec& even, Vec& odd) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline Vec load_bf16(const uint16_t* p) {
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
inline __m256i round_bf16(Vec v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}
inline void store_bf16_pair(uint16_t* p, Vec even, Vec odd) {
  __m256i lo = _mm256_srli_epi32(round_bf16(even), 16);
  __m256i hi = _mm256_and_si256(round_bf16(odd), _mm256_set1_epi32(int(0xFFFF0000u)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(lo, hi));
}
inline void store_bf16(uint16_t* p, Vec v) {
  __m256i shifted = _mm256_srli_epi32(round_bf16(v), 16);  // 8 x 16 bits in 32-bit lanes
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(shifted), _mm256_extracti128_si256(shifted, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline Vec transpose_sum(const Vec* acc) {
  Vec t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  Vec t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  Vec u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: tokens 0-3 / 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#else
constexpr int W = 1;
using Vec = float;
inline Vec vzero() { return 0.0f; }
inline Vec vset(float x) { return x; }
inline Vec vload(const float* p) { return *p; }
inline void vstore(float* p, Vec v) { *p = v; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline Vec vsub(Vec a, Vec b) { return a - b; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vdiv(Vec a, Vec b) { return a / b; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }
inline Vec vmin(Vec a, Vec b) { return a < b ? a : b; }
inline float vsum(Vec v) { return v; }
inline float vmaxval(Vec v) { return v; }
inline Vec vround(Vec v) { return __builtin_nearbyintf(v); }
inline Vec vexp2int(Vec n) {
  uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline uint16_t float_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
inline void load_bf16_pair(const uint16_t* p, Vec& even, Vec& odd) {
  even = bf16_to_float(p[0]);
  odd = bf16_to_float(p[1]);
}
inline Vec load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
inline void store_bf16_pair(uint16_t* p, Vec even, Vec odd) {
  p[0] = float_to_bf16(even);
  p[1] = float_to_bf16(odd);
}
inline void store_bf16(uint16_t* p, Vec v) { *p = float_to_bf16(v); }
inline Vec transpose_sum(const Vec* acc) { return acc[0]; }
#endif

// e^x (Cephes' expf polynomial, ~1 ulp) for x up to 88; anything below -87 gives ~1e-38, not 0.
inline Vec vexp(Vec x) {
  x = vmin(vmax(x, vset(-87.0f)), vset(88.0f));
  Vec n = vround(vmul(x, vset(1.44269504088896341f)));
  Vec r = vsub(vsub(x, vmul(n, vset(0.693359375f))), vmul(n, vset(-2.12194440e-4f)));
  Vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vadd(vfma(p, vmul(r, r), r), vset(1.0f));
  return vmul(p, vexp2int(n));
}

