// 16 lanes, one per row of a group, for quant.cpp's kernels: one __m512 / __m512i with AVX512,
// a pair of 8-lane AVX2 vectors (rows 0-7, 8-15) otherwise, so the kernels are written once.
// IV: 16 dwords (each a row's four neighbouring 8-bit codes, an int32 sum or two int16), FV: 16 floats.
// Included inside quant.cpp's anonymous namespace, after <immintrin.h>.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TOKENWAY_QUANT_VECTOR 1
constexpr const char* kVectorIsa = "avx512";
using IV = __m512i;
using FV = __m512;
inline IV iload(const void* p) { return _mm512_loadu_si512(p); }
inline void istore(void* p, IV a) { _mm512_storeu_si512(p, a); }
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
inline IV imul32(IV a, IV b) { return _mm512_mullo_epi32(a, b); }
inline IV iclamp32(IV a, int32_t lo, int32_t hi) {
  return _mm512_min_epi32(_mm512_max_epi32(a, _mm512_set1_epi32(lo)), _mm512_set1_epi32(hi));
}
inline IV iu8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IV is8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline int32_t ihsum(IV a) { return _mm512_reduce_add_epi32(a); }
inline void istore8(int8_t* p, IV a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a)); }
// acc + the dot products of each dword's four unsigned bytes of u with signed bytes of s: exact
// with VNNI; maddubs's int16 pairs saturate past 32767, so u must be below 128 there.
inline IV idot(IV acc, IV u, IV s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
// Without VNNI, the two steps of idot apart: u's unsigned bytes times s's signed ones, neighbours
// summed into int16 (saturating past 32767), then int16 pairs' products summed into int32.
inline IV imaddubs(IV u, IV s) { return _mm512_maddubs_epi16(u, s); }
inline IV iadd16(IV a, IV b) { return _mm512_add_epi16(a, b); }
inline IV imadd16(IV a, IV b) { return _mm512_madd_epi16(a, b); }
// acc + the dot products of each dword's two int16 of a with those of b.
inline IV idot16(IV acc, IV a, IV b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
inline FV fzero() { return _mm512_setzero_ps(); }
inline FV fset(float v) { return _mm512_set1_ps(v); }
inline FV fadd(FV a, FV b) { return _mm512_add_ps(a, b); }
inline FV fmul(FV a, FV b) { return _mm512_mul_ps(a, b); }
inline FV ffma(FV a, FV b, FV c) { return _mm512_fmadd_ps(a, b, c); }
inline FV fnfma(FV a, FV b, FV c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline FV fcvt(IV a) { return _mm512_cvtepi32_ps(a); }
inline IV iround(FV a) { return _mm512_cvtps_epi32(a); }  // to nearest even
inline FV fload(const float* p) { return _mm512_loadu_ps(p); }
inline FV fload_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline FV fmaxabs(FV m, FV a) { return _mm512_max_ps(m, _mm512_abs_ps(a)); }
inline float fhmax(FV a) { return _mm512_reduce_max_ps(a); }
inline FV fhalves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline FV fu8(const uint8_t* p) { return fcvt(iu8(p)); }
inline FV fi8(const uint8_t* p) { return fcvt(is8(p)); }
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
inline IV iload(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
inline void istore(void* p, IV x) {
  __m256i* v = static_cast<__m256i*>(p);
  _mm256_storeu_si256(v, x.a);
  _mm256_storeu_si256(v + 1, x.b);
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
inline IV imul32(IV x, IV y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
inline IV iclamp32(IV x, int32_t lo, int32_t hi) {
  const __m256i l = _mm256_set1_epi32(lo), h = _mm256_set1_epi32(hi);
  return {_mm256_min_epi32(_mm256_max_epi32(x.a, l), h), _mm256_min_epi32(_mm256_max_epi32(x.b, l), h)};
}
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline IV iu8(const uint8_t* p) { return {_mm256_cvtepu8_epi32(load8(p)), _mm256_cvtepu8_epi32(load8(p + 8))}; }
inline IV is8(const uint8_t* p) { return {_mm256_cvtepi8_epi32(load8(p)), _mm256_cvtepi8_epi32(load8(p + 8))}; }
inline int32_t ihsum(IV x) {
  const __m256i s = _mm256_add_epi32(x.a, x.b);
  __m128i v = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}
inline void istore8(int8_t* p, IV x) {  // values within int8
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(x.a, x.b), 0xD8);  // 16 in order
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
}
inline __m256i dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline IV idot(IV acc, IV u, IV s) { return {dot8(acc.a, u.a, s.a), dot8(acc.b, u.b, s.b)}; }
inline IV imaddubs(IV u, IV s) { return {_mm256_maddubs_epi16(u.a, s.a), _mm256_maddubs_epi16(u.b, s.b)}; }
inline IV iadd16(IV x, IV y) { return {_mm256_add_epi16(x.a, y.a), _mm256_add_epi16(x.b, y.b)}; }
inline IV imadd16(IV x, IV y) { return {_mm256_madd_epi16(x.a, y.a), _mm256_madd_epi16(x.b, y.b)}; }
inline __m256i dot16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
inline IV idot16(IV acc, IV x, IV y) { return {dot16(acc.a, x.a, y.a), dot16(acc.b, x.b, y.b)}; }
inline FV fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline FV fset(float v) { const __m256 x = _mm256_set1_ps(v); return {x, x}; }
inline FV fadd(FV x, FV y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline FV fmul(FV x, FV y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline FV ffma(FV x, FV y, FV z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline FV fnfma(FV x, FV y, FV z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
inline FV fcvt(IV x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline IV iround(FV x) { return {_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)}; }
inline FV fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline FV fload_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline FV fmaxabs(FV m, FV x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_max_ps(m.a, _mm256_andnot_ps(sign, x.a)), _mm256_max_ps(m.b, _mm256_andnot_ps(sign, x.b))};
}
inline float fhmax(FV x) {
  const __m256 m = _mm256_max_ps(x.a, x.b);
  __m128 v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)));
}
inline FV fhalves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline FV fu8(const uint8_t* p) { return fcvt(iu8(p)); }
inline FV fi8(const uint8_t* p) { return fcvt(is8(p)); }
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
// The dword at p (four neighbouring int8 activations, or two int16 sums) in every lane.
inline IV iquad(const void* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return iset32(bits);
}
// The cache line at p + offset into L1, ahead of its use. A prefetch never faults, so the address
// may lie past the buffer's end: it is computed as an integer.
inline void prefetch(const void* p, int64_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + offset), _MM_HINT_T0);
}
// Two int32 vectors' low halves as int16 pairs: lo's in each dword's low word, hi's in its high one.
inline IV ipairs(IV lo, IV hi) { return ior(iand(lo, iset32(0xFFFF)), ishl32<16>(hi)); }
// With VNNI a code's 8 bits meet int8 activations in one product; maddubs takes codes below 128.
#if defined(__AVX512VNNI__) || (!defined(__AVX512F__) && defined(__AVXVNNI__))
constexpr bool kWideDot = true;
#else
constexpr bool kWideDot = false;
#endif
#endif
