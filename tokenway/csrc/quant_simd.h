// 16 lanes, one per row of a group, for quant.cpp's kernels: one __m512 / __m512i with AVX512,
// a pair of 8-lane AVX2 vectors (rows 0-7, 8-15) otherwise, so the kernels are written once.
// IV: 16 dwords (each a row's four neighbouring 8-bit codes, or an int32 sum), FV: 16 floats.
// Included inside quant.cpp's anonymous namespace, after <immintrin.h>.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TOKENWAY_QUANT_VECTOR 1
constexpr const char* kVectorIsa = "avx512";
using IV = __m512i;
using FV = __m512;
inline IV iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IV izero() { return _mm512_setzero_si512(); }
inline IV iset8(char v) { return _mm512_set1_epi8(v); }
inline IV iset32(int32_t v) { return _mm512_set1_epi32(v); }
inline IV iand(IV a, IV b) { return _mm512_and_si512(a, b); }
inline IV ior(IV a, IV b) { return _mm512_or_si512(a, b); }
inline IV iadd32(IV a, IV b) { return _mm512_add_epi32(a, b); }
inline IV isub32(IV a, IV b) { return _mm512_sub_epi32(a, b); }
template <int S> inline IV ishl16(IV a) { return _mm512_slli_epi16(a, S); }
template <int S> inline IV ishr16(IV a) { return _mm512_srli_epi16(a, S); }
template <int S> inline IV ishl32(IV a) { return _mm512_slli_epi32(a, S); }
template <int S> inline IV ishr32(IV a) { return _mm512_srli_epi32(a, S); }
inline IV ishuffle8(IV a, IV index) { return _mm512_shuffle_epi8(a, index); }  // within 16-byte lanes
// acc + the dot products of each dword's four unsigned bytes of u with signed bytes of s: exact
// with VNNI; maddubs's int16 pairs saturate past 32767, so u must be below 128 there.
inline IV idot(IV acc, IV u, IV s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
inline FV fzero() { return _mm512_setzero_ps(); }
inline FV fset(float v) { return _mm512_set1_ps(v); }
inline FV fadd(FV a, FV b) { return _mm512_add_ps(a, b); }
inline FV fmul(FV a, FV b) { return _mm512_mul_ps(a, b); }
inline FV ffma(FV a, FV b, FV c) { return _mm512_fmadd_ps(a, b, c); }
inline FV fnfma(FV a, FV b, FV c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline FV fcvt(IV a) { return _mm512_cvtepi32_ps(a); }
inline FV fhalves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline FV fu8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline FV fi8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline void fstore(float* y, FV v, int valid) {
  if (valid == kRows) _mm512_storeu_ps(y, v);
  else _mm512_mask_storeu_ps(y, __mmask16((1u << valid) - 1), v);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENWAY_QUANT_VECTOR 1
#if defined(__AVXVNNI__)
constexpr const char* kVectorIsa = "avx2-vnni";
#else
constexpr const char* kVectorIsa = "avx2";
#endif
struct IV { __m256i a, b; };
struct FV { __m256 a, b; };
inline IV iload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline IV izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline IV iset8(char v) { const __m256i x = _mm256_set1_epi8(v); return {x, x}; }
inline IV iset32(int32_t v) { const __m256i x = _mm256_set1_epi32(v); return {x, x}; }
inline IV iand(IV x, IV y) { return {_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)}; }
inline IV ior(IV x, IV y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
inline IV iadd32(IV x, IV y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline IV isub32(IV x, IV y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
template <int S> inline IV ishl16(IV x) { return {_mm256_slli_epi16(x.a, S), _mm256_slli_epi16(x.b, S)}; }
template <int S> inline IV ishr16(IV x) { return {_mm256_srli_epi16(x.a, S), _mm256_srli_epi16(x.b, S)}; }
template <int S> inline IV ishl32(IV x) { return {_mm256_slli_epi32(x.a, S), _mm256_slli_epi32(x.b, S)}; }
template <int S> inline IV ishr32(IV x) { return {_mm256_srli_epi32(x.a, S), _mm256_srli_epi32(x.b, S)}; }
inline IV ishuffle8(IV x, IV index) { return {_mm256_shuffle_epi8(x.a, index.a), _mm256_shuffle_epi8(x.b, index.b)}; }
inline __m256i dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline IV idot(IV acc, IV u, IV s) { return {dot8(acc.a, u.a, s.a), dot8(acc.b, u.b, s.b)}; }
inline FV fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline FV fset(float v) { const __m256 x = _mm256_set1_ps(v); return {x, x}; }
inline FV fadd(FV x, FV y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline FV fmul(FV x, FV y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline FV ffma(FV x, FV y, FV z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline FV fnfma(FV x, FV y, FV z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
inline FV fcvt(IV x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline FV fhalves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline FV fu8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(p))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(p + 8)))};
}
inline FV fi8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p))), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p + 8)))};
}
inline void fstore(float* y, FV v, int valid) {
  if (valid == kRows) {
    _mm256_storeu_ps(y, v.a);
    _mm256_storeu_ps(y + 8, v.b);
    return;
  }
  alignas(32) float lanes[kRows];
  _mm256_store_ps(lanes, v.a);
  _mm256_store_ps(lanes + 8, v.b);
  std::memcpy(y, lanes, valid * sizeof(float));
}
#endif

#if defined(TOKENWAY_QUANT_VECTOR)
// Four neighbouring int8 activations in every dword; one float in every lane.
inline IV iquad(const int8_t* x) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return iset32(bits);
}
// With VNNI a code's 8 bits meet int8 activations in one product; maddubs takes codes below 128.
#if defined(__AVX512VNNI__) || (!defined(__AVX512F__) && defined(__AVXVNNI__))
constexpr bool kWideDot = true;
#else
constexpr bool kWideDot = false;
#endif
#endif
