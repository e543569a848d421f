// The vector kernels of quant.cpp: one group of 16 rows (a lane each) times a tile of TT tokens,
// for every block type (quant_format.h) and kind of products. Included inside quant.cpp's
// anonymous namespace after quant_format.h and quant_simd.h, where TOKENWAY_QUANT_VECTOR is set;
// quant_int8.h has the int8 ones.
//
// A sub-block's codes come as 64-byte vectors of 16 rows x 4 neighbouring elements (SubCodes):
// quad p (elements 4p..4p+3) and quad p + 4 (16 + 4p..) at once, the 4-bit plane's nibbles with
// the high-bit planes merged in (a shift and a mask a plane). Each kind of products sums, per row,
// code x activation over each half of the sub-block (Q6_K's halves have their own scales), then
// applies the row's scale and offset to all 16 rows at once:
//
//   int8: quant_int8.h.
//   bfloat16 (AVX512-BF16): a code q < 128 OR 0x4300 is the bfloat16 of 128 + q, exactly, so two
//     byte shuffles make a vector of 16 rows x 2 bfloat16 weights for vdpbf16ps; the 128 (and c)
//     come off with the block's sum of x. Q8_0's byte u = 16 uh + ul meets 16 x (exact) and x.
//   float32: codes (less c) widened to float lanes, one multiply-add per element and token.

#if defined(__AVX512F__)
constexpr int kMaxTile = 8;
#else
constexpr int kMaxTile = 4;  // 16 ymm registers: past 4 tokens the sums spill
#endif

// Tokens run in tiles of kMaxTile, then the rest in tiles of 4, 2 and 1: the size of the tile
// that starts `left` tokens before the end.
inline int token_tile(int64_t left) { return left >= kMaxTile ? kMaxTile : left >= 4 ? 4 : left >= 2 ? 2 : 1; }

struct TokenTile {
  int64_t first;
  int size;
};

// The tile token t of `tokens` runs in.
inline TokenTile tile_of(int64_t t, int64_t tokens) {
  int64_t first = t / kMaxTile * kMaxTile;  // whole tiles of kMaxTile come first
  int size = token_tile(tokens - first);
  for (; t >= first + size; size = token_tile(tokens - first)) first += size;
  return {first, size};
}

template <int N>
using Const = std::integral_constant<int, N>;

template <typename Fn>
inline void for_each_quad(Fn&& fn) {
  fn(Const<0>{});
  fn(Const<1>{});
  fn(Const<2>{});
  fn(Const<3>{});
}

template <int S>
inline IV shift16(IV v) {  // left by S, right by -S
  if constexpr (S > 0) return ishl16<S>(v);
  else if constexpr (S < 0) return ishr16<-S>(v);
  else return v;
}

template <int Bits>
struct SubCodes {
  const uint8_t* sub;
  IV high0, high1;

  SubCodes() = default;
  explicit SubCodes(const uint8_t* s) : sub(s) {
    if constexpr (Bits == 5 || Bits == 6) high0 = iload(s + 256);
    if constexpr (Bits == 6) high1 = iload(s + 320);
  }

  // Codes of quads P and P + 4: 16 rows x 4 bytes each.
  template <int P>
  void quads(IV& lo, IV& hi) const {
    if constexpr (Bits == 8) {
      lo = iload(sub + P * 64);
      hi = iload(sub + (P + 4) * 64);
    } else {
      const IV v = iload(sub + P * 64), nibble = iset8(0x0F);
      lo = iand(v, nibble);
      hi = iand(ishr16<4>(v), nibble);
      if constexpr (Bits == 5) {  // bit P (quad P) and P + 4 (quad P + 4) to bit 4
        const IV bit4 = iset8(0x10);
        lo = ior(lo, iand(shift16<4 - P>(high0), bit4));
        hi = ior(hi, iand(shift16<-P>(high0), bit4));
      } else if constexpr (Bits == 6) {  // bits 2P, 2P + 1 of each half's plane to bits 4, 5
        const IV bits45 = iset8(0x30);
        lo = ior(lo, iand(shift16<4 - 2 * P>(high0), bits45));
        hi = ior(hi, iand(shift16<4 - 2 * P>(high1), bits45));
      }
    }
  }

  // Codes of quad P of half H alone (quad P + 4H): for Q6_K's halves, which have scales of their own.
  template <int H, int P>
  IV quad() const {
    IV lo, hi;
    quads<P>(lo, hi);
    return H ? hi : lo;
  }
};

// Activations as each kind of products reads them, made once per call (quant.cpp: prepare).
// int8's are laid out in token tiles (tile_of): tile [t0, t0 + TT) holds unit u (32 codes, a
// block's scale or sums) of its TT tokens side by side, at t0 units + u TT + (t - t0), so a tile
// reads every token's unit at a fixed offset from one pointer.
struct Activations {
  const void* x = nullptr;    // (T, K): float32, or bfloat16 bits for bfloat16 products
  std::vector<uint16_t> xb;   // a float32 x rounded to bfloat16 for bfloat16 products (x points here)
  std::vector<uint16_t> x16;  // bfloat16 products on Q8_0: 16 x, exact
  std::vector<float> sums;    // (T, K / 16): sum of x per 16 elements, as the products see them
  std::vector<int8_t> xq;     // int8: (T, K / 32, 32) x / dx rounded
  std::vector<float> dx;      // int8: (T, K / block) the block's scale (quant_int8.h: the blocks)
  std::vector<float> xs;      // int8, blocks of 32: (T, K / 32) dx sum(qx)
  std::vector<int32_t> qsum;  // int8, blocks of 32: (T, K / 32) sum(qx)
  std::vector<int16_t> bsum;  // int8, K-quants: (T, K / 256, 8 or 16) sum(qx) per 32 or (Q6_K) 16
};

// A tile's row scales for sub-block j (16 lanes): s (both halves, or Q6_K's two) and the offset o.
template <QType Q>
struct SubScales {
  FV lo, hi, offset;  // hi only for Q6_K; offset only for the types with a min (o = m, or -dmin min)

  SubScales(const uint8_t* tile, FV d, FV m, int j) {
    constexpr Format F = format_of(Q);
    if constexpr (Q == QType::Q6_K) {
      lo = fmul(d, fi8(tile + 64 + (2 * j) * kRows));
      hi = fmul(d, fi8(tile + 64 + (2 * j + 1) * kRows));
    } else if constexpr (F.k_quant) {
      lo = fmul(d, fu8(tile + 64 + j * kRows));
      offset = fmul(fset(-1.0f), fmul(m, fu8(tile + 192 + j * kRows)));
    } else {
      lo = d;
      if constexpr (F.has_min) offset = m;
    }
  }
};

template <int I>
inline IV byte_of(IV v) {  // byte I of each dword, as an int32
  if constexpr (I == 3) return ishr32<24>(v);
  else return iand(ishr32<8 * I>(v), iset32(0xFF));
}

template <QType Q, int TT>
void tile_fp32(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  constexpr Format F = format_of(Q);
  constexpr bool kHalves = Q == QType::Q6_K;
  const int64_t k = w.k, blocks16 = k / 16;
  const float* x = static_cast<const float*>(a.x);
  const uint8_t* tile = w.group(g);
  FV acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = fzero();
  for (int64_t s = 0; s < k / F.super; ++s, tile += F.tile_bytes()) {
    const FV d = fhalves(tile);
    const FV m = F.has_min ? fhalves(tile + 32) : fzero();
    for (int j = 0; j < F.subs(); ++j) {
      const int64_t b = s * F.subs() + j;
      const SubCodes<F.bits> codes(tile + F.header + j * F.sub_bytes());
      FV sum0[TT], sum1[TT];
      for (int t = 0; t < TT; ++t) sum0[t] = sum1[t] = fzero();
      for_each_quad([&](auto P) {
        IV lo, hi;
        codes.template quads<P>(lo, hi);
        auto element = [&](auto I) {
          const IV offset = iset32(F.code_offset);
          const FV wl = fcvt(isub32(byte_of<I>(lo), offset)), wh = fcvt(isub32(byte_of<I>(hi), offset));
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            const float* xt = x + (t0 + t) * k + b * kSub + 4 * P + I;
            sum0[t] = ffma(wl, fset(xt[0]), sum0[t]);
            if constexpr (kHalves) sum1[t] = ffma(wh, fset(xt[16]), sum1[t]);
            else sum0[t] = ffma(wh, fset(xt[16]), sum0[t]);
          }
        };
        element(Const<0>{});
        element(Const<1>{});
        element(Const<2>{});
        element(Const<3>{});
      });
      const SubScales<Q> scales(tile, d, m, j);
      for (int t = 0; t < TT; ++t) {
        if constexpr (kHalves) {
          acc[t] = ffma(sum0[t], scales.lo, ffma(sum1[t], scales.hi, acc[t]));
        } else {
          acc[t] = ffma(sum0[t], scales.lo, acc[t]);
          if constexpr (F.has_min) {
            const float* sums = a.sums.data() + (t0 + t) * blocks16 + 2 * b;
            acc[t] = ffma(scales.offset, fset(sums[0] + sums[1]), acc[t]);
          }
        }
      }
    }
  }
  const int valid = int(std::min<int64_t>(kRows, w.n - g * kRows));
  for (int t = 0; t < TT; ++t) fstore(y + (t0 + t) * ldy + g * kRows, acc[t], valid);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TOKENWAY_QUANT_BF16 1
inline __m512bh pair_of(const uint16_t* x) {  // two neighbouring bfloat16 activations in every lane
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// Codes below 128, 4 a dword -> bfloat16 of 128 + code: elements 0, 1 and 2, 3 of each dword.
inline void bf16_pairs(IV codes, __m512bh& first, __m512bh& second) {
  const IV magic = _mm512_set1_epi16(0x4300);
  // per dword q of each 16-byte lane: bytes 4q, -, 4q + 1, - and 4q + 2, -, 4q + 3, -
  const IV index0 = _mm512_set_epi8(
      -1, 13, -1, 12, -1, 9, -1, 8, -1, 5, -1, 4, -1, 1, -1, 0, -1, 13, -1, 12, -1, 9, -1, 8, -1, 5, -1, 4, -1, 1, -1, 0,
      -1, 13, -1, 12, -1, 9, -1, 8, -1, 5, -1, 4, -1, 1, -1, 0, -1, 13, -1, 12, -1, 9, -1, 8, -1, 5, -1, 4, -1, 1, -1, 0);
  const IV index1 = _mm512_set_epi8(
      -1, 15, -1, 14, -1, 11, -1, 10, -1, 7, -1, 6, -1, 3, -1, 2, -1, 15, -1, 14, -1, 11, -1, 10, -1, 7, -1, 6, -1, 3, -1, 2,
      -1, 15, -1, 14, -1, 11, -1, 10, -1, 7, -1, 6, -1, 3, -1, 2, -1, 15, -1, 14, -1, 11, -1, 10, -1, 7, -1, 6, -1, 3, -1, 2);
  first = (__m512bh)_mm512_or_si512(_mm512_shuffle_epi8(codes, index0), magic);
  second = (__m512bh)_mm512_or_si512(_mm512_shuffle_epi8(codes, index1), magic);
}

template <QType Q, int TT>
void tile_bf16(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  constexpr Format F = format_of(Q);
  constexpr bool kHalves = Q == QType::Q6_K;
  // What the bfloat16 codes add to S per unit of the half's sum of x: 128 (Q8_0: 128 + 16 128),
  // plus the code offset c.
  constexpr float kBias = F.bits == 8 ? 2304.0f : 128.0f + F.code_offset;
  const int64_t k = w.k, blocks16 = k / 16;
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const uint8_t* tile = w.group(g);
  FV acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = fzero();
  for (int64_t s = 0; s < k / F.super; ++s, tile += F.tile_bytes()) {
    const FV d = fhalves(tile);
    const FV m = F.has_min ? fhalves(tile + 32) : fzero();
    for (int j = 0; j < F.subs(); ++j) {
      const int64_t b = s * F.subs() + j;
      const SubCodes<F.bits> codes(tile + F.header + j * F.sub_bytes());
      FV sum0[TT], sum1[TT];
      for (int t = 0; t < TT; ++t) sum0[t] = sum1[t] = fzero();
      for_each_quad([&](auto P) {
        IV lo, hi;
        codes.template quads<P>(lo, hi);
        auto meet = [&](IV quad, int half, const uint16_t* xs) {  // xs: x or 16 x
          __m512bh first, second;
          bf16_pairs(quad, first, second);
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            const uint16_t* xt = xs + (t0 + t) * k + b * kSub + 16 * half + 4 * P;
            FV& sum = kHalves && half ? sum1[t] : sum0[t];
            sum = _mm512_dpbf16_ps(sum, first, pair_of(xt));
            sum = _mm512_dpbf16_ps(sum, second, pair_of(xt + 2));
          }
        };
        if constexpr (F.bits == 8) {
          const IV nibble = iset8(0x0F);
          meet(iand(lo, nibble), 0, x);
          meet(iand(ishr16<4>(lo), nibble), 0, a.x16.data());
          meet(iand(hi, nibble), 1, x);
          meet(iand(ishr16<4>(hi), nibble), 1, a.x16.data());
        } else {
          meet(lo, 0, x);
          meet(hi, 1, x);
        }
      });
      const SubScales<Q> scales(tile, d, m, j);
      for (int t = 0; t < TT; ++t) {
        const float* sums = a.sums.data() + (t0 + t) * blocks16 + 2 * b;
        if constexpr (kHalves) {
          acc[t] = ffma(sum0[t], scales.lo, acc[t]);
          acc[t] = ffma(fmul(scales.lo, fset(-kBias)), fset(sums[0]), acc[t]);
          acc[t] = ffma(sum1[t], scales.hi, acc[t]);
          acc[t] = ffma(fmul(scales.hi, fset(-kBias)), fset(sums[1]), acc[t]);
        } else {
          FV coefficient = fmul(scales.lo, fset(-kBias));
          if constexpr (F.has_min) coefficient = fadd(coefficient, scales.offset);
          acc[t] = ffma(sum0[t], scales.lo, acc[t]);
          acc[t] = ffma(coefficient, fset(sums[0] + sums[1]), acc[t]);
        }
      }
    }
  }
  const int valid = int(std::min<int64_t>(kRows, w.n - g * kRows));
  for (int t = 0; t < TT; ++t) fstore(y + (t0 + t) * ldy + g * kRows, acc[t], valid);
}
#endif
