// int8 products (vpdpbusd with VNNI, else maddubs): the activations quantized, then the kernels
// of one group of 16 rows times a tile of TT tokens. Included inside quant.cpp's anonymous
// namespace after quant_tiles.h (Activations, SubCodes, token tiles).
//
// Activations are quantized as llama.cpp's Q8 dot products take them, x ~ dx qx, qx in
// [-127, 127], one scale dx per block: 32 activations for the 32-weight types (Q8_0), a
// super-block of 256 for the K-quants (Q8_K). S = sum code qx over a block or sub-block is exact
// in int32 and the weights are exact, so only the activations carry int8's rounding:
//
//   32-weight types, a float epilogue per block and token:
//     w = s (q - c):  x . w = s dx (S - c sum(qx))       (Q4_0, Q5_0, Q8_0)
//     w = s q + o:    x . w = s dx S + o dx sum(qx)      (Q4_1, Q5_1)
//   K-quants: the sub-blocks' S meet their integer scales in int32 (vpmulld after VNNI's sums;
//   without VNNI, madd takes maddubs's int16 sums with (sc, sc) pairs in place of ones, as
//   llama.cpp's AVX2 dots do; vpdpwssd or madd for the offsets against the activation sums B),
//   and floats enter once per super-block and token:
//     Q4_K, Q5_K:  x . w = dx (d sum_j sc_j S_j - dmin sum_j min_j B_j)   (j: 8 sub-blocks of 32)
//     Q6_K:        x . w = dx d sum_h sc_h (S_h - 32 B_h)                 (h: 16 halves of 16)
//   Bounds, int32 (2^31 = 2147M): Q4_K, Q5_K: |sum_j sc_j S_j| <= 8 x 63 x (32 x 31 x 127) = 63.5M,
//   |sum_j min_j B_j| <= 8 x 63 x (32 x 127) = 2.1M with each B_j (<= 4064) an int16; Q6_K:
//   |sum_h sc_h S_h| <= 16 x 128 x (16 x 63 x 127) = 262M, |sum_h 32 sc_h B_h| <= 16 x 32 x 128 x
//   (16 x 127) = 133M, the int16 pairs 32 sc_h (<= 4096) and B_h (<= 2032).
// Without VNNI maddubs's int16 pairs would saturate on 8-bit codes (2 x 255 x 127 > 32767), so
// Q8_0's meet x as two nibbles; 6-bit codes stay below it (2 x 63 x 127).

// Activations in a block of the type's int8 products (one scale dx each).
constexpr int int8_block(Format f) { return f.k_quant ? f.super : kSub; }

// x (T, K) float32 or bfloat16 -> a's int8 arrays (quant_tiles.h: Activations), each token's
// blocks of int8_block to int8 with one scale each (round to nearest even).
void quantize_int8(QType qtype, const void* x, bool x_is_float, int64_t tokens, int64_t k, Activations& a) {
  const Format f = format_of(qtype);
  const int block = int8_block(f), units = block / kSub;
  const int num_sums = qtype == QType::Q6_K ? 16 : 8;  // a K-quant super-block's sums: per 16 or 32
  const int64_t blocks = k / block;
  a.xq.resize(tokens * k);
  a.dx.resize(tokens * blocks);
  if (f.k_quant) {
    a.bsum.resize(tokens * blocks * num_sums);
  } else {
    a.xs.resize(tokens * blocks);
    a.qsum.resize(tokens * blocks);
  }
  const float* xf = static_cast<const float*>(x);
  const uint16_t* xh = static_cast<const uint16_t*>(x);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / k);  // a decode step's tokens: one thread
  tokenway_native::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const TokenTile tile = tile_of(t, tokens);
      const int64_t lane = t - tile.first;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = t * k + b * block;
        auto load = [&](int c) { return x_is_float ? fload(xf + start + 16 * c) : fload_bf16(xh + start + 16 * c); };
        FV amax = fzero();
        for (int c = 0; c < block / 16; ++c) amax = fmaxabs(amax, load(c));
        const float m = fhmax(amax), dx = m / 127.0f;
        const FV inverse = fset(m > 0.0f ? 127.0f / m : 0.0f);
        int32_t sums[16];  // sum(qx) per 16
        for (int c = 0; c < block / 16; ++c) {
          const IV q = iclamp32(iround(fmul(load(c), inverse)), -127, 127);
          const int64_t unit = b * units + c / 2;
          istore8(a.xq.data() + tile.first * k + (unit * tile.size + lane) * kSub + (c % 2) * 16, q);
          sums[c] = ihsum(q);
        }
        const int64_t at = tile.first * blocks + b * tile.size + lane;
        a.dx[at] = dx;
        if (qtype == QType::Q6_K) {
          for (int h = 0; h < 16; ++h) a.bsum[at * 16 + h] = int16_t(sums[h]);
        } else if (f.k_quant) {
          for (int j = 0; j < 8; ++j) a.bsum[at * 8 + j] = int16_t(sums[2 * j] + sums[2 * j + 1]);
        } else {
          // The offsets meet the same rounded activations as the codes (dx qx): sum(x) in an offset
          // term would leave the error of the code term uncentred, 2x larger.
          a.qsum[at] = sums[0] + sums[1];
          a.xs[at] = dx * float(sums[0] + sums[1]);
        }
      }
    }
  });
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: a tile is one block of 32.
template <QType Q, int TT>
void tile_int8(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  constexpr Format F = format_of(Q);
  constexpr bool kNibbles = F.bits == 8 && !kWideDot;  // Q8_0 on maddubs: x . u = x . ul + 16 x . uh
  const int64_t k = w.k, blocks = k / kSub;
  const uint8_t* tile = w.group(g);
  const int8_t* xq = a.xq.data() + t0 * k;  // (blocks, TT, 32)
  const int64_t at = t0 * blocks;           // dx, xs, qsum: (blocks, TT)
  FV acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = fzero();
  for (int64_t b = 0; b < blocks; ++b, tile += F.tile_bytes(), xq += TT * kSub) {
    // A chunk's first token tile streams its weights from memory: the lines 4 KiB on prefetched
    // as this tile is read (past the group's end they are the next group's, or nothing: a
    // prefetch never faults), so that their misses overlap these products. (The K-quant tiles,
    // a super-block of 256 a row, prefetch two tiles on; 2 and 8 KiB were slower here than 4.)
    if (t0 == 0) {
      constexpr int64_t kAheadBytes = 4096;
      constexpr int kLines = (F.tile_bytes() + 63) / 64;
      for (int l = 0; l < kLines; ++l) prefetch(tile, kAheadBytes + l * 64);
    }
    const SubCodes<F.bits> codes(tile + F.header);
    IV sum0[TT], sum1[TT];
    for (int t = 0; t < TT; ++t) sum0[t] = sum1[t] = izero();
    for_each_quad([&](auto P) {
      IV lo, hi;
      codes.template quads<P>(lo, hi);
      if constexpr (kNibbles) {
        const IV nibble = iset8(0x0F);
        const IV lo_l = iand(lo, nibble), lo_h = iand(ishr16<4>(lo), nibble);
        const IV hi_l = iand(hi, nibble), hi_h = iand(ishr16<4>(hi), nibble);
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t) {
          const int8_t* x = xq + t * kSub + 4 * P;
          const IV xa = iquad(x), xb = iquad(x + 16);
          sum0[t] = idot(idot(sum0[t], lo_l, xa), hi_l, xb);
          sum1[t] = idot(idot(sum1[t], lo_h, xa), hi_h, xb);
        }
      } else {
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t) {
          const int8_t* x = xq + t * kSub + 4 * P;
          sum0[t] = idot(idot(sum0[t], lo, iquad(x)), hi, iquad(x + 16));
        }
      }
    });
    const FV d = fhalves(tile);
    for (int t = 0; t < TT; ++t) {
      const int64_t tb = at + b * TT + t;
      IV total = kNibbles ? iadd32(sum0[t], ishl32<4>(sum1[t])) : sum0[t];
      if constexpr (!F.has_min) total = isub32(total, iset32(F.code_offset * a.qsum[tb]));
      acc[t] = ffma(fcvt(total), fmul(d, fset(a.dx[tb])), acc[t]);
      if constexpr (F.has_min) acc[t] = ffma(fhalves(tile + 32), fset(a.xs[tb]), acc[t]);
    }
  }
  const int valid = int(std::min<int64_t>(kRows, w.n - g * kRows));
  for (int t = 0; t < TT; ++t) fstore(y + (t0 + t) * ldy + g * kRows, acc[t], valid);
}

// Groups a K-quant tile takes at once: with AVX512's 32 registers two groups' sums fit, and each
// activation broadcast meets both; AVX2's 16 hold one (two spill: slower than one).
#if defined(__AVX512F__)
constexpr int kGroupsAtOnce = 2;
#else
constexpr int kGroupsAtOnce = 1;
#endif

// Q4_K, Q5_K, Q6_K: a tile is a super-block of 256, its sub-blocks' scales integers. NG groups
// (1 or 2) at once.
template <QType Q, int TT, int NG>
void tile_int8_k(const Weights& w, int64_t g, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  constexpr Format F = format_of(Q);
  constexpr bool kQ6 = Q == QType::Q6_K;
  constexpr int kSums = kQ6 ? 16 : 8;
  // Without VNNI: maddubs's int16 sums a quad adds per token (Q6_K's halves take one of their
  // quads, the others both), and how many of them an int16 holds before madd must take them:
  // each <= 2 (2^bits - 1) 127, so Q4_K 8 (a sub-block), Q5_K 4, Q6_K 2.
  constexpr int kPerQuad = kQ6 ? 1 : 2;
  constexpr int kPairsPerMadd = 32767 / (2 * ((1 << F.bits) - 1) * 127);
  static_assert(kPairsPerMadd >= kPerQuad && 4 * kPerQuad % kPairsPerMadd == 0);
  const int64_t k = w.k, supers = k / F.super;
  const uint8_t* tiles[NG];
  for (int n = 0; n < NG; ++n) tiles[n] = w.group(g + n);
  const int8_t* xq = a.xq.data() + t0 * k;                    // (supers, 8, TT, 32)
  const float* dx = a.dx.data() + t0 * supers;                // (supers, TT)
  const int16_t* bsum = a.bsum.data() + t0 * supers * kSums;  // (supers, TT, kSums)
  // Kept in memory (L1): the registers hold the sums of NG x TT.
  alignas(64) float acc[NG][TT][kRows] = {};
  alignas(64) int32_t total[NG][TT][kRows];
  for (int64_t s = 0; s < supers; ++s, xq += 8 * TT * kSub, dx += TT, bsum += TT * kSums) {
    FV d[NG], dmin[NG];  // loaded first: the tile's bytes are read in order
    for (int n = 0; n < NG; ++n) {
      d[n] = fhalves(tiles[n]);
      if constexpr (!kQ6) dmin[n] = fhalves(tiles[n] + 32);
    }
    for (int n = 0; n < NG; ++n)
      for (int t = 0; t < TT; ++t) istore(total[n][t], izero());
    for (int j = 0; j < F.subs(); ++j) {
      // A chunk's first token tile streams its weights from memory (later ones find them in L2):
      // the tile two ahead prefetched, a sub-block's share of its lines at a time, so that its
      // misses overlap these products. All of a tile's lines at once (53 for Q6_K) fill the
      // core's miss buffers and the prefetches stall it: the head's Q6_K matmul took 11.2 ms a
      // token that way on Zen 3, 8.7 spread.
      if (t0 == 0) {
        constexpr int kLines = (F.tile_bytes() + 64 * F.subs() - 1) / (64 * F.subs());
        for (int n = 0; n < NG; ++n)
          for (int l = 0; l < kLines; ++l) prefetch(tiles[n], 2 * F.tile_bytes() + (j * kLines + l) * 64);
      }
      // The sub-block's sums of NG x TT, into total. Q6_K's halves have scales of their own: a pass
      // each (H), so that one half's sums fill the registers.
      auto pass = [&](auto H) {
        SubCodes<F.bits> codes[NG];
        for (int n = 0; n < NG; ++n) codes[n] = SubCodes<F.bits>(tiles[n] + F.header + j * F.sub_bytes());
        IV sc[NG];  // the pass's scales: int32 (vpmulld after VNNI's sums), else (sc, sc) int16 pairs
        for (int n = 0; n < NG; ++n) {
          const IV s = kQ6 ? is8(tiles[n] + 64 + (2 * j + H) * kRows) : iu8(tiles[n] + 64 + j * kRows);
          sc[n] = kWideDot ? s : ipairs(s, s);
        }
        IV sum[NG][TT];  // int32 with VNNI; else maddubs's int16 pairs, which madd scales into int32
        for (int n = 0; n < NG; ++n)
          for (int t = 0; t < TT; ++t) sum[n][t] = izero();
        auto flush = [&] {
          for (int n = 0; n < NG; ++n)
            for (int t = 0; t < TT; ++t) {
              const IV scaled = kWideDot ? imul32(sum[n][t], sc[n]) : imadd16(sum[n][t], sc[n]);
              istore(total[n][t], iadd32(iload(total[n][t]), scaled));
              sum[n][t] = izero();
            }
        };
        for_each_quad([&](auto P) {
          IV lo[NG], hi[NG];
          for (int n = 0; n < NG; ++n) {
            if constexpr (kQ6) lo[n] = codes[n].template quad<H, P>();
            else codes[n].template quads<P>(lo[n], hi[n]);
          }
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            const int8_t* x = xq + (j * TT + t) * kSub + 4 * P;
            if constexpr (kQ6) {
              const IV xa = iquad(x + 16 * H);
              for (int n = 0; n < NG; ++n)
                sum[n][t] = kWideDot ? idot(sum[n][t], lo[n], xa) : iadd16(sum[n][t], imaddubs(lo[n], xa));
            } else {
              const IV xa = iquad(x), xb = iquad(x + 16);
              for (int n = 0; n < NG; ++n)
                sum[n][t] = kWideDot ? idot(idot(sum[n][t], lo[n], xa), hi[n], xb)
                                     : iadd16(sum[n][t], iadd16(imaddubs(lo[n], xa), imaddubs(hi[n], xb)));
            }
          }
          if constexpr (!kWideDot && P < 3 && (P + 1) * kPerQuad % kPairsPerMadd == 0) flush();
        });
        flush();
      };
      pass(Const<0>{});
      if constexpr (kQ6) {
        pass(Const<1>{});
        IV bias[NG];  // -32 sc_h of both halves as an int16 pair, against their B_h as one
        for (int n = 0; n < NG; ++n) {
          const IV sc0 = is8(tiles[n] + 64 + 2 * j * kRows), sc1 = is8(tiles[n] + 64 + (2 * j + 1) * kRows);
          bias[n] = ipairs(isub32(izero(), ishl32<5>(sc0)), isub32(izero(), ishl32<5>(sc1)));
        }
        for (int t = 0; t < TT; ++t) {
          const IV b = iquad(bsum + t * kSums + 2 * j);
          for (int n = 0; n < NG; ++n) istore(total[n][t], idot16(iload(total[n][t]), bias[n], b));
        }
      }
    }
    IV mins[NG][4];  // Q4_K, Q5_K: min_2i, min_2i+1 as int16 pairs, against B_2i, B_2i+1
    for (int n = 0; n < NG; ++n) {
      if constexpr (!kQ6) {
        for (int i = 0; i < 4; ++i)
          mins[n][i] = ipairs(iu8(tiles[n] + 192 + 2 * i * kRows), iu8(tiles[n] + 192 + (2 * i + 1) * kRows));
      }
      tiles[n] += F.tile_bytes();
    }
    for (int t = 0; t < TT; ++t) {
      const FV scale = fset(dx[t]);
      if constexpr (kQ6) {
        for (int n = 0; n < NG; ++n)
          fstore(acc[n][t], ffma(fmul(d[n], fcvt(iload(total[n][t]))), scale, fload(acc[n][t])), kRows);
      } else {
        IV b[4];
        for (int i = 0; i < 4; ++i) b[i] = iquad(bsum + t * kSums + 2 * i);
        for (int n = 0; n < NG; ++n) {
          IV offset = izero();
          for (int i = 0; i < 4; ++i) offset = idot16(offset, mins[n][i], b[i]);
          const FV sum = fnfma(dmin[n], fcvt(offset), fmul(d[n], fcvt(iload(total[n][t]))));
          fstore(acc[n][t], ffma(sum, scale, fload(acc[n][t])), kRows);
        }
      }
    }
  }
  for (int n = 0; n < NG; ++n) {
    const int valid = int(std::min<int64_t>(kRows, w.n - (g + n) * kRows));
    for (int t = 0; t < TT; ++t) fstore(y + (t0 + t) * ldy + (g + n) * kRows, fload(acc[n][t]), valid);
  }
}
