// An expert (or dense matmul) that many tokens meet at once, on AVX2: its tokens in groups of 8,
// each group's activations interleaved a quad (4 codes) at a time, [quad][token][4], so that one
// 32-byte register holds 8 tokens' quads and one broadcast quad of a row's codes meets all 8 in
// one maddubs. A row's sub-block has one scale for all 8 lanes, so maddubs's int16 pairs add over
// the whole sub-block (as many as an int16 holds) before one madd applies the scale: ~1.1 multiply
// instructions a 32 products, where the in-place tile (a row's 32 codes against one token) spends
// two (maddubs, then madd with the unit's scales). A row's codes are decoded once a pass of up to
// 6 groups (48 tokens), the passes balanced: a 512-token prompt chunk gives Qwen3's experts 25-45
// tokens (4-6 groups), and passes of at most 4 left a 1- or 2-group pass behind that cost as much
// as the in-place tile (the layer no faster; in passes of 6, 1.19-1.37x). A super-block's
// activations (2 KiB a group) stay in L1 while the work item's rows pass them.
//
// MXFP4 and Q4_0 (blocks of 32, w = d (u - offset)): a block's int32 sums meet d dx in float,
// where their float32-decoded rows (decoded_rows_times_tokens, which they took before) spend an
// FMA on each 8 products: gpt-oss's expert layer at 512 tokens 2.1x, at 128 1.7x (Zen 3).
// Q4_K and Q5_K (w = d sc u - dmin m), with llama.cpp's Q8_K activations (one dx a super-block):
//   x . w = dx (d sum_j sc_j S_j - dmin sum_j m_j B_j)   (j: 8 sub-blocks of 32)
// S the int32 sum of codes x qx over a sub-block, B the sum of its qx (quant_int8.h's bounds).
// Q6_K's 6-bit codes let an int16 hold only 2 quads' pairs: a madd every 2 quads, and its decode
// (two broadcasts, five operations a quad) made the grouped tile no faster than the in-place one
// (52-65 against 67-75 GMAC/s at 32-64 tokens on Zen 3, passes of 4), so it keeps that.
// Included inside experts.cpp's anonymous namespace, AVX2 builds (AVX512's 64-weight units meet a
// token in one vpdpbusd already).

// Tokens an expert needs for the grouped path: below it the in-place tiles (a token's products a
// unit, no padding) are as fast. A super-block's per-row work (scales, mins) wants 2 groups or more
// to share it: at one (8 tokens) Q4_K's grouped pass is ~half as fast as the tile (17 against 32
// GMAC/s on one Zen 3 core), at 12 as fast, at 16 1.3x. MXFP4's blocks: 1.5x at 8 already.
constexpr int64_t group_min_tokens(QType q) { return layout_of(q).super ? 16 : 8; }
constexpr int kGroup = 8;           // tokens a group: int32 lanes of a 256-bit register
constexpr int kGroupsAPass = 6;     // groups a pass over a row's codes at most: 6 int16 + 6 int32 sums

constexpr bool grouped(QType q) {
  return q == QType::Q4_K || q == QType::Q5_K || q == QType::MXFP4 || q == QType::Q4_0;
}

// A set of experts' token groups for one input (gate's and up's x, or down's activations).
struct Groups {
  // Units (super-blocks of 256, or blocks of 32) outer, so that a pass's groups lie side by side
  // at fixed distances.
  int64_t k = 0, unit = 256, units = 0, groups = 0;
  std::vector<int64_t> first;   // expert -> its first group (-1: it takes the other paths)
  std::vector<int8_t> xq;       // (units, groups, unit / 4 quads, 8 tokens, 4)
  std::vector<float> dx;        // (units, groups, 8)
  std::vector<int16_t> sums32;  // 256: (units, groups, 4 pairs, 8 tokens, 2): sums of 32 codes, sub-blocks 2i, 2i + 1
  std::vector<int32_t> init;    // 32: (units, groups, 8): -offset x the sum of the block's codes
  int64_t group_bytes() const { return unit / 4 * kGroup * 4; }  // a group's activations of one unit
};

// The groups of every expert e with at least group_min_tokens(q) tokens, for matrices of type q:
// tokens slots[start[e] .. start[e + 1]) of a (rows of its xq), in order, the last group padded
// with zeros. Nothing where q is not grouped.
void group_acts(const Acts& a, QType q, const int64_t* start, const int32_t* slots, int64_t experts, Groups& g) {
  if (!grouped(q)) return;
  g.k = a.k;
  g.unit = a.init.empty() ? 256 : 32;  // the 32-weight types' activations carry their offsets (init)
  g.units = a.k / g.unit;
  g.first.assign(experts, -1);
  std::vector<std::pair<int64_t, int64_t>> work;  // (expert, group within it)
  int64_t groups = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n < group_min_tokens(q)) continue;
    g.first[e] = groups;
    for (int64_t i = 0; i < (n + kGroup - 1) / kGroup; ++i) work.emplace_back(e, i);
    groups += (n + kGroup - 1) / kGroup;
  }
  g.groups = groups;
  if (groups == 0) return;
  const int64_t bytes = g.group_bytes(), quads = g.unit / 4;
  g.xq.assign(groups * g.units * bytes, 0);
  g.dx.assign(groups * g.units * kGroup, 0.0f);
  if (g.unit == 256) g.sums32.assign(groups * g.units * 8 * kGroup, 0);
  else g.init.assign(groups * g.units * kGroup, 0);
  const int64_t kp = a.kp, grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, a.k));
  tokenway_native::parallel_for(0, int64_t(work.size()), grain, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const auto [e, i] = work[w];
      const int64_t group = g.first[e] + i, n = start[e + 1] - start[e];
      for (int lane = 0; lane < kGroup && i * kGroup + lane < n; ++lane) {
        const int64_t row = slots[start[e] + i * kGroup + lane];
        const int8_t* x = a.xq.data() + row * kp;
        const float* dx = a.dxe.data() + row * kp / 4;
        for (int64_t u = 0; u < g.units; ++u) {
          const int64_t at = u * groups + group;
          int8_t* out = g.xq.data() + at * bytes + lane * 4;
          for (int q = 0; q < quads; ++q) std::memcpy(out + q * kGroup * 4, x + u * g.unit + 4 * q, 4);
          g.dx[at * kGroup + lane] = dx[u * quads];
          if (g.unit == 32) {
            const int32_t* init = a.init.data() + row * kp / 4 + u * 8;
            g.init[at * kGroup + lane] = init[0] + init[1] + init[2] + init[3] + init[4] + init[5] + init[6] + init[7];
            continue;
          }
          int32_t half[16];
          for (int h = 0; h < 16; ++h) {
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + u * 256 + 16 * h));
            const __m128i pairs = _mm_maddubs_epi16(_mm_set1_epi8(1), v);  // 8 int16 sums of 2
            const __m128i quads4 = _mm_madd_epi16(pairs, _mm_set1_epi16(1));
            const __m128i two = _mm_add_epi32(quads4, _mm_shuffle_epi32(quads4, 0x4E));
            half[h] = _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 0xB1)));
          }
          for (int j = 0; j < 8; ++j)
            g.sums32[((at * 4 + j / 2) * kGroup + lane) * 2 + j % 2] = int16_t(half[2 * j] + half[2 * j + 1]);
        }
      }
    }
  });
}

inline __m256i broadcast_quad(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Int32 pair i (int16 elements 2i, 2i + 1) of v in every lane.
inline __m256i pair_of(__m128i v, int i) {
  return _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(v), _mm256_set1_epi32(i));
}

// All 16 int16 lanes: int16 h of a super-block's widened scales (widen_scales).
inline __m256i scale_lanes(const Scales16& scales, int h) {
  const int a = 2 * (h % 8);
  return _mm256_shuffle_epi8(h < 8 ? scales.lo : scales.hi, _mm256_set1_epi16(int16_t(a | (a + 1) << 8)));
}

// acc (rows r0 .. r1, NG, 8) += those rows against NG groups from group g0. Super-blocks outer,
// rows inner: a super-block's activations (NG x 2 KiB) stay in L1 while the rows pass. ahead: on
// a chunk's first pass, each row's next super-block is prefetched as this one is read.
template <QType Q, int NG>
void group_pass(const Rows& w, int64_t r0, int64_t r1, const Groups& x, int64_t g0, float* acc, bool ahead) {
  constexpr Layout L = layout_of(Q);
  // Quads whose maddubs pairs an int16 holds (each pair <= 2 (2^bits - 1) 127): Q4_K 8, Q5_K 4.
  constexpr int kFlush = Q == QType::Q4_K ? 8 : 4;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  constexpr int64_t kGroupBytes = 64 * kGroup * 4;
  for (int64_t sb = 0; sb < x.units; ++sb) {
    const int64_t at = sb * x.groups + g0;  // group n of the pass: at + n
    const int8_t* xs = x.xq.data() + at * kGroupBytes;
    const float* dxs = x.dx.data() + at * kGroup;
    const int16_t* bs = x.sums32.data() + at * 8 * kGroup;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* b = w.row(r) + sb * L.bytes;
      if (ahead)
        for (int at = 0; at < L.bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(b + L.bytes + at), _MM_HINT_T0);
      const SuperBytes q = super_bytes<Q>(b);
      const Scales16 scales = widen_scales(q.s);
      __m256i total[NG], part[NG];
      for (int n = 0; n < NG; ++n) total[n] = part[n] = _mm256_setzero_si256();
      // Quad i of the super-block (weights 4i .. 4i + 3) against every group, into part; the
      // sub-block's scale meets part in one madd into total after each kFlush quads.
      auto meet = [&](__m256i codes, int i) {
        for (int n = 0; n < NG; ++n) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + n * kGroupBytes + i * kGroup * 4));
          part[n] = _mm256_add_epi16(part[n], _mm256_maddubs_epi16(codes, xv));
        }
      };
      auto flush = [&](__m256i sc) {
        for (int n = 0; n < NG; ++n) {
          total[n] = _mm256_add_epi32(total[n], _mm256_madd_epi16(part[n], sc));
          part[n] = _mm256_setzero_si256();
        }
      };
      constexpr int kCodes = Q == QType::Q5_K ? 48 : 16;
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {  // a loop: unrolled, the compiler hoists the scales and spills
        const __m256i sc = scale_lanes(scales, 2 * j);  // the per-16 bytes repeat each sub-block's
        const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
        for (int q0 = 0; q0 < 8; q0 += kFlush) {
#pragma GCC unroll 1
          for (int qd = q0; qd < q0 + kFlush; ++qd) {  // unrolled, the compiler spills the sums
            const __m256i v = broadcast_quad(b + kCodes + 32 * (j / 2) + 4 * qd);
            __m256i codes = _mm256_and_si256(_mm256_srl_epi16(v, shift), low4);
            if constexpr (Q == QType::Q5_K) {
              const __m256i qh = broadcast_quad(b + 16 + 4 * qd);
              codes = _mm256_or_si256(codes, _mm256_slli_epi16(_mm256_and_si256(shr16(qh, j), _mm256_set1_epi8(1)), 4));
            }
            meet(codes, 8 * j + qd);
          }
          flush(sc);
        }
      }
      // sum_j m_j B_j: the mins as int16 pairs (2i, 2i + 1) against B's pairs.
      const __m128i mins = _mm_cvtepi8_epi16(_mm_shuffle_epi8(q.m, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1)));
      __m256i corr[NG];
      for (int n = 0; n < NG; ++n) corr[n] = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256i pair = pair_of(mins, i);
        for (int n = 0; n < NG; ++n) {
          const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + (n * 4 + i) * 2 * kGroup));
          corr[n] = _mm256_add_epi32(corr[n], _mm256_madd_epi16(pair, sums));
        }
      }
      const __m256 d = _mm256_set1_ps(q.d), dmin = _mm256_set1_ps(q.dm);
      for (int n = 0; n < NG; ++n) {
        float* out = acc + ((r - r0) * NG + n) * kGroup;
        const __m256 f = _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(corr[n]), _mm256_mul_ps(d, _mm256_cvtepi32_ps(total[n])));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(f, _mm256_loadu_ps(dxs + n * kGroup), _mm256_loadu_ps(out)));
      }
    }
  }
}

// The same for the nibble types of 32-weight blocks (MXFP4, Q4_0; w = d (u - offset)): each
// block's 8 quads against every group, its low nibbles (quads 0-3) and high (4-7) in two int16
// halves (MXFP4's codes reach 24: 4 quads' pairs a half), madd into int32 beside the activations'
// offsets (init), then the block's d dx in float.
template <QType Q, int NG>
void group_pass_blocks(const Rows& w, int64_t r0, int64_t r1, const Groups& x, int64_t g0, float* acc, bool ahead) {
  constexpr Layout L = layout_of(Q);
  constexpr int kAt = Q == QType::MXFP4 ? 1 : 2;  // the nibbles' offset in a block
  constexpr int64_t kGroupBytes = 8 * kGroup * 4;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i table = table16<12>(kMXFP4Values);
  for (int64_t blk = 0; blk < x.units; ++blk) {
    const int64_t at = blk * x.groups + g0;
    const int8_t* xs = x.xq.data() + at * kGroupBytes;
    const float* dxs = x.dx.data() + at * kGroup;
    const int32_t* init = x.init.data() + at * kGroup;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* b = w.row(r) + blk * L.bytes;
      if (ahead && blk % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(b + 4 * L.bytes + 64), _MM_HINT_T0);
      const float d = Q == QType::MXFP4 ? e8m0_half(b[0]) : half_at(b);
      __m256i total[NG];
      for (int n = 0; n < NG; ++n) total[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + n * kGroup));
      for (int high = 0; high < 2; ++high) {
        __m256i part[NG];
        for (int n = 0; n < NG; ++n) part[n] = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          const __m256i v = broadcast_quad(b + kAt + 4 * i);
          __m256i codes = _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, low4);
          if constexpr (Q == QType::MXFP4) codes = _mm256_shuffle_epi8(table, codes);
          for (int n = 0; n < NG; ++n) {
            const __m256i xv = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(xs + n * kGroupBytes + (4 * high + i) * kGroup * 4));
            part[n] = _mm256_add_epi16(part[n], _mm256_maddubs_epi16(codes, xv));
          }
        }
        for (int n = 0; n < NG; ++n) total[n] = _mm256_add_epi32(total[n], _mm256_madd_epi16(part[n], ones));
      }
      const __m256 dv = _mm256_set1_ps(d);
      for (int n = 0; n < NG; ++n) {
        float* out = acc + ((r - r0) * NG + n) * kGroup;
        const __m256 scale = _mm256_mul_ps(dv, _mm256_loadu_ps(dxs + n * kGroup));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[n]), scale, _mm256_loadu_ps(out)));
      }
    }
  }
}

// One pass of NG groups: the kernel of Q's layout.
template <QType Q, int NG>
void group_pass_of(const Rows& w, int64_t r0, int64_t r1, const Groups& x, int64_t g0, float* acc, bool ahead) {
  if constexpr (layout_of(Q).super) group_pass<Q, NG>(w, r0, r1, x, g0, acc, ahead);
  else group_pass_blocks<Q, NG>(w, r0, r1, x, g0, acc, ahead);
}

// Rows [r0, r1) of one matrix times an expert's n tokens in their groups from `first`:
// y[i * ldy + r - r0], as matmul_rows.
template <QType Q>
void grouped_rows_times_tokens(const Rows& w, int64_t r0, int64_t r1, const Groups& x, int64_t first, int64_t n,
                               float* y, int64_t ldy) {
  static thread_local std::vector<float> acc;
  const int64_t rows = r1 - r0, count = (n + kGroup - 1) / kGroup;
  for (int64_t g = 0; g < count;) {
    // The groups left in as few passes as kGroupsAPass allows, split evenly (7 groups: 4 + 3).
    const int64_t passes = (count - g + kGroupsAPass - 1) / kGroupsAPass;
    const int ng = int((count - g + passes - 1) / passes);
    acc.assign(rows * ng * kGroup, 0.0f);
    const bool ahead = g == 0;  // later passes find the chunk's rows in L2
    const int64_t g0 = first + g;
    switch (ng) {
      case 6: group_pass_of<Q, 6>(w, r0, r1, x, g0, acc.data(), ahead); break;
      case 5: group_pass_of<Q, 5>(w, r0, r1, x, g0, acc.data(), ahead); break;
      case 4: group_pass_of<Q, 4>(w, r0, r1, x, g0, acc.data(), ahead); break;
      case 3: group_pass_of<Q, 3>(w, r0, r1, x, g0, acc.data(), ahead); break;
      case 2: group_pass_of<Q, 2>(w, r0, r1, x, g0, acc.data(), ahead); break;
      default: group_pass_of<Q, 1>(w, r0, r1, x, g0, acc.data(), ahead); break;
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int m = 0; m < ng; ++m)
        for (int lane = 0; lane < kGroup; ++lane) {
          const int64_t t = (g + m) * kGroup + lane;
          if (t < n) y[t * ldy + r] = acc[(r * ng + m) * kGroup + lane];
        }
    g += ng;
  }
}
