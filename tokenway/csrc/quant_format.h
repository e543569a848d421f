// The kernel's layout of GGUF weights (models/quant.py writes it once at load) and the reference
// decoder of one row, which dequantize, embedding and the scalar matmul use. Included inside
// quant.cpp's anonymous namespace, after <cstdint> and <cstring>.
//
// A weight (N, K) is rows in groups of 16 (padded with zero rows), each group one run of tiles,
// one tile per super-block of K (32 weights for Q4_0..Q8_0, 256 for the K-quants):
//
//   tile   = header, then the super-block's 32-weight sub-blocks' codes
//   header = d: 16 fp16 (a row each), then m (Q4_1, Q5_1) or dmin (K-quants): 16 fp16, then
//            K-quants' sub-block scales from byte 64: Q4_K/Q5_K sc[8][16] u8 then min[8][16] u8
//            (the 6-bit values unpacked), Q6_K sc[16][16] i8 (bytes 32..63 unused)
//   codes  = 4-bit plane: 4 vectors of 64 bytes; vector p's byte 4r + i holds row r's code of
//            element 4p + i in its low nibble and of element 16 + 4p + i in its high nibble, so
//            a dword is one row's four neighbouring codes and a vector 16 rows' (one lane each)
//            5-bit (Q5_*): + 64 bytes; byte 4r + i bit j = bit 4 of element 4j + i's code
//            6-bit (Q6_K): + 2 x 64 bytes; vector h's byte 4r + i bits 2p, 2p + 1 = bits 4, 5
//            of element 16h + 4p + i's code
//            8-bit (Q8_0): 8 vectors of 64 bytes; vector j's byte 4r + i = element 4j + i's q + 128
//
// The weights are the stored ones, exactly:
//   Q4_0: d (q - 8)    Q5_0: d (q - 16)    Q8_0: d (u - 128)    Q6_K: (d sc_16) (q - 32)
//   Q4_1, Q5_1: d q + m                    Q4_K, Q5_K: (d sc_32) q - dmin min_32
// (K-quants' d sc and dmin min are exact in float32: 11-bit by 6- or 8-bit integers.)
#pragma once

enum class QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int kRows = 16;  // rows per group: a vector lane each
constexpr int kSub = 32;   // weights per sub-block

struct Format {
  int super;         // weights per super-block (a tile)
  int bits;          // code bits: 4, 5, 6 or 8
  int header;        // header bytes per tile
  int code_offset;   // c in w = s (q - c); 0 for the types with a min
  bool has_min;      // w = s q + offset
  bool k_quant;      // sub-block scales in the header

  constexpr int subs() const { return super / kSub; }
  constexpr int sub_bytes() const { return bits == 8 ? 512 : 256 + (bits - 4) * 64; }
  constexpr int tile_bytes() const { return header + subs() * sub_bytes(); }
};

constexpr Format format_of(QType q) {
  switch (q) {
    case QType::Q4_0: return {32, 4, 32, 8, false, false};
    case QType::Q4_1: return {32, 4, 64, 0, true, false};
    case QType::Q5_0: return {32, 5, 32, 16, false, false};
    case QType::Q5_1: return {32, 5, 64, 0, true, false};
    case QType::Q8_0: return {32, 8, 32, 128, false, false};
    case QType::Q4_K: return {256, 4, 320, 0, true, true};
    case QType::Q5_K: return {256, 5, 320, 0, true, true};
    case QType::Q6_K: return {256, 6, 320, 32, false, true};
  }
  return {0, 0, 0, 0, false, false};
}

inline bool known_qtype(int64_t q) {
  switch (QType(q)) {
    case QType::Q4_0: case QType::Q4_1: case QType::Q5_0: case QType::Q5_1: case QType::Q8_0:
    case QType::Q4_K: case QType::Q5_K: case QType::Q6_K: return true;
  }
  return false;
}

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

inline float half_at(const uint8_t* p, int lane) {
  uint16_t h;
  std::memcpy(&h, p + 2 * lane, 2);
  return fp16_to_float(h);
}

// Row `lane`'s code of element e (0..31) of a sub-block.
template <int Bits>
inline int code_at(const uint8_t* sub, int lane, int e) {
  const int i = e % 4;
  if constexpr (Bits == 8) return sub[(e / 4) * 64 + 4 * lane + i];
  const int half = e / 16, p = (e % 16) / 4;
  const uint8_t byte = sub[p * 64 + 4 * lane + i];
  int q = half ? byte >> 4 : byte & 15;
  if constexpr (Bits == 5) q |= ((sub[256 + 4 * lane + i] >> (e / 4)) & 1) << 4;
  if constexpr (Bits == 6) q |= ((sub[256 + half * 64 + 4 * lane + i] >> (2 * p)) & 3) << 4;
  return q;
}

// Row `lane` of a group's tiles as k floats: what gguf-py's dequantize gives, bit for bit (the
// same float32 operations in the same order).
template <QType Q>
void decode_row(const uint8_t* group, int lane, int64_t k, float* out) {
  constexpr Format F = format_of(Q);
  for (int64_t s = 0; s < k / F.super; ++s) {
    const uint8_t* tile = group + s * F.tile_bytes();
    const float d = half_at(tile, lane);
    const float m = F.has_min ? half_at(tile + 32, lane) : 0.0f;
    for (int j = 0; j < F.subs(); ++j) {
      const uint8_t* sub = tile + F.header + j * F.sub_bytes();
      float* o = out + s * F.super + j * kSub;
      if constexpr (Q == QType::Q4_K || Q == QType::Q5_K) {
        const float scale = d * float(tile[64 + j * kRows + lane]);
        const float offset = m * float(tile[192 + j * kRows + lane]);
        for (int e = 0; e < kSub; ++e) o[e] = scale * float(code_at<F.bits>(sub, lane, e)) - offset;
      } else if constexpr (Q == QType::Q6_K) {
        for (int e = 0; e < kSub; ++e) {
          const float scale = d * float(int8_t(tile[64 + (2 * j + e / 16) * kRows + lane]));
          o[e] = scale * float(code_at<6>(sub, lane, e) - 32);
        }
      } else if constexpr (F.has_min) {
        for (int e = 0; e < kSub; ++e) o[e] = d * float(code_at<F.bits>(sub, lane, e)) + m;
      } else if constexpr (F.bits == 8) {
        for (int e = 0; e < kSub; ++e) o[e] = float(code_at<8>(sub, lane, e) - 128) * d;
      } else {
        for (int e = 0; e < kSub; ++e) o[e] = d * float(code_at<F.bits>(sub, lane, e) - F.code_offset);
      }
    }
  }
}

struct Weights {
  const uint8_t* data;  // (groups, group_bytes) quant_format.h's tiles
  int64_t n, k;
  QType qtype;

  int64_t groups() const { return (n + kRows - 1) / kRows; }
  int64_t group_bytes() const { return k / format_of(qtype).super * format_of(qtype).tile_bytes(); }
  const uint8_t* group(int64_t g) const { return data + g * group_bytes(); }
};

// f(std::integral_constant<QType, q>) for a runtime q.
template <typename Fn>
decltype(auto) with_qtype(QType q, Fn&& fn) {
  switch (q) {
    case QType::Q4_0: return fn(std::integral_constant<QType, QType::Q4_0>{});
    case QType::Q4_1: return fn(std::integral_constant<QType, QType::Q4_1>{});
    case QType::Q5_0: return fn(std::integral_constant<QType, QType::Q5_0>{});
    case QType::Q5_1: return fn(std::integral_constant<QType, QType::Q5_1>{});
    case QType::Q8_0: return fn(std::integral_constant<QType, QType::Q8_0>{});
    case QType::Q4_K: return fn(std::integral_constant<QType, QType::Q4_K>{});
    case QType::Q5_K: return fn(std::integral_constant<QType, QType::Q5_K>{});
    default: return fn(std::integral_constant<QType, QType::Q6_K>{});
  }
}
