// The SIMD layer of the native kernels: one vector type and a few dozen primitives per ISA
// level, so that kernels.cpp and step.cpp are written once and compiled once per level.
//
//   level    flags (see kernels/native/build.py)                    F (fp32 lanes)  I16 lanes
//   avx2     -mavx2 -mfma -mf16c                                      8               16
//   avx512   + -mavx512f -mavx512bw -mavx512vl -mavx512dq            16               32
//   avx512_vnni  + -mavx512vnni (vpdpwssd: madd_add in one instruction; 16             32
//                vpdpbusd: dot_u8s8's int8 products)
//   avx512_bf16  + -mavx512bf16 (vdpbf16ps: dot_bf16, bf16 weights      16             32
//                times x that is exact in bf16)
//   neon     aarch64 (Advanced SIMD is part of ARMv8-A)               4                8
//   neon_dotprod  -march=armv8.2-a+dotprod (sdot: int8 dot products)  4                8
//
// The level is chosen by the compiler flags (the predefined __AVX512BW__ / __AVX2__ /
// __aarch64__ / __ARM_FEATURE_DOTPROD macros). Everything here is per lane, except where a
// primitive says otherwise: hsum, the pairwise integer multiply-add madd, the decoding of a bf16
// step (bf16_step with its x layout bf16_column) and of int4 codes (q4_piece8 with its x layout
// q4x8_column, their int8 dot products dot_u8s8 / q4_dot8 and lane groups q4_groups). A
// primitive exists only where the operation has no portable spelling (fused multiply-add, 16-bit
// float conversion, int16 / int8 dot products); plain loops are left to the compiler.
//
// `iv8` / `iv4` name the vectors of the int8 / int4 GEMVs (kernels.cpp IntKernel): the level's
// own on AVX2 and NEON; on the AVX-512 levels 512-bit ones (v512) where the build defines
// RWKV_INT8_512 / RWKV_INT4_512 (chosen per CPU family at load, see TUNINGS in
// kernels/native/build.py), else 256-bit ones (v256: the AVX2 primitives, with VNNI's vpdpwssd
// and the 32 registers of AVX-512VL). AMD cores ran the 512-bit form slower at batch 1 (Zen 4
// splits it into two halves), so they keep 256 bits (docs/performance.md has the A/B runs).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define RWKV_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RWKV_SIMD_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__)
#define RWKV_SIMD_NEON 1
#include <arm_neon.h>
#else
#error "rwkv_engine native kernels: build with -mavx2 -mfma -mf16c, the AVX-512 flags, or for aarch64"
#endif

namespace rwkv_native::simd {

#if defined(RWKV_SIMD_AVX512)
#if defined(__AVX512BF16__)
inline constexpr const char* kLevel = "avx512_bf16";
#elif defined(__AVX512VNNI__)
inline constexpr const char* kLevel = "avx512_vnni";
#else
inline constexpr const char* kLevel = "avx512";
#endif
inline constexpr int kW = 16;
using F = __m512;
using I32 = __m512i;
using I16 = __m512i;
#elif defined(RWKV_SIMD_AVX2)
inline constexpr const char* kLevel = "avx2";
#else
#if defined(__ARM_FEATURE_DOTPROD)
inline constexpr const char* kLevel = "neon_dotprod";
#else
inline constexpr const char* kLevel = "neon";
#endif
inline constexpr int kW = 4;
using F = float32x4_t;
using I32 = int32x4_t;
using I16 = int16x8_t;
#endif

// Pins v to a register at this point of the instruction stream. Without it GCC folds a shared
// load into every multiply-add that uses it (R loads instead of one).
template <typename V>
inline void keep(V& v) {
#if defined(RWKV_SIMD_NEON)
  __asm__("" : "+w"(v));
#else
  __asm__("" : "+v"(v));
#endif
}

#if defined(RWKV_SIMD_AVX512) || defined(RWKV_SIMD_AVX2)

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
inline void pause() { _mm_pause(); }
inline void store_fence() { _mm_sfence(); }

// 256-bit vectors: the AVX2 level's, and the int8 / int4 GEMVs' at the AVX-512 levels (iv).
namespace v256 {

inline constexpr int kW = 8;
inline constexpr int kW16 = 16;
using F = __m256;
using I32 = __m256i;
using I16 = __m256i;

inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline void stream(float* p, F v) { _mm256_stream_ps(p, v); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(F v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
inline F load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline F load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline I16 load_i16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline I16 load_i8(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline I32 madd(I16 a, I16 b) { return _mm256_madd_epi16(a, b); }
inline I32 add_i(I32 a, I32 b) { return _mm256_add_epi32(a, b); }
inline I32 madd_add(I32 acc, I16 a, I16 b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return add_i(acc, madd(a, b));
#endif
}
inline F to_float(I32 v) { return _mm256_cvtepi32_ps(v); }
// A 16-column bf16 step as two vectors without widening: 32-bit lane j holds columns 2j (low
// half: a shift) and 2j + 1 (high half: a mask), so vector 0 holds the even columns and vector
// 1 the odd ones (x is permuted to match). Faster than two widening loads (port 5).
inline F bf16_step(const uint16_t* w, int h) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
constexpr int bf16_column(int pos) { return 2 * (pos % 8) + pos / 8; }
// int4: the scale vector of a chunk's int32 sums (q4_dot8 below), lane l taking the value of the
// 32-column block (s0: columns 0-31, s1: 32-63) of the columns summed in it: lanes 0-3 here, 0-1
// on NEON.
inline F q4_groups(float s0, float s1) { return _mm256_blend_ps(_mm256_set1_ps(s0), _mm256_set1_ps(s1), 0xF0); }
// Two int32 sum vectors (lo: one group's columns, hi: the next group's) as one: adjacent lanes
// added, lo's pairs and hi's pairs alternating (lanes 0-1 from lo, 2-3 from hi, 4-5 lo, 6-7 hi);
// pair_scales(s0, s1) is the matching scale vector. One conversion and scaling for both.
inline I32 join_halves(I32 lo, I32 hi) { return _mm256_hadd_epi32(lo, hi); }
inline F pair_scales(const float* two) {  // two[0] twice, two[1] twice, and again
  double pair;
  std::memcpy(&pair, two, 8);
  return _mm256_permute_ps(_mm256_castpd_ps(_mm256_set1_pd(pair)), 0x50);
}

// int4 codes times int8 x (Q4Format): a chunk's 32 code bytes as kQ4Pieces8 byte vectors of u8
// codes, piece h = nibble h of every byte (h = 0: the even columns, 1: the odd ones); x is
// permuted to match (q4x8_column: x bytes 0-31 the even columns, 32-63 the odd ones).
using I8 = __m256i;
inline constexpr int kQ4Pieces8 = 2;
inline I8 q4_piece8(const uint8_t* chunk, int h) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  return _mm256_and_si256(h == 0 ? v : _mm256_srli_epi16(v, 4), mask);
}
constexpr int q4x8_column(int pos) { return 2 * (pos % 32) + pos / 32; }
// sum over 4 adjacent bytes of a0 * b0 + a1 * b1 in each int32 lane, exactly: a0, a1 unsigned
// bytes of at most 15 (codes), b0, b1 signed in [-127, 127]. VNNI: two vpdpbusd; else vpmaddubsw
// (pairs into int16, at most 2 * 15 * 127 each, and the two added: 7620, no saturation), then
// vpmaddwd by ones.
inline I32 dot_u8s8(I8 a0, I8 b0, I8 a1, I8 b1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), a0, b0), a1, b1);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a0, b0), _mm256_maddubs_epi16(a1, b1)),
                           _mm256_set1_epi16(1));
#endif
}
// The int32 sums of a chunk: pieces w (q4_piece8) times the permuted x bytes xb [64]. Int32 lane
// l sums columns 8l .. 8l + 7, so lanes 0-3 cover group 0 and 4-7 group 1, as q4_groups scales.
inline I32 q4_dot8(const I8* w, const int8_t* xb) {
  return dot_u8s8(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)), w[1],
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32)));
}


// K-quants (kernels.cpp KQuantKernel, ggml's Q4_K / Q5_K / Q6_K): a 256-column block's codes as
// 8 pieces (KP) of 32 unsigned bytes of at most 63, each piece 32 columns in column order; x the
// block's 256 int8 values in column order. kq_block_sums gives the exact int32 sums of the 16
// groups of 16 columns in kKqVecs vectors, group g in lane kq_lane(g) of them (here vector g / 8,
// even groups in lanes 0-3 and odd ones in 4-7, where two rounds of pairwise adds leave them).
// Per-group float factors are put in the same lanes by kq_scale8 / kq_scale16.
using KP = __m256i;
inline constexpr int kKqVecs = 2;
inline constexpr int kKqPieces = 8;
constexpr int kq_lane(int g) { return 8 * (g / 8) + (g % 2) * 4 + (g % 8) / 2; }
inline KP kq_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline KP kq_or(KP a, KP b) { return _mm256_or_si256(a, b); }
// Each byte shifted left by S (right by -S) and masked; the mask drops the bits a 16-bit shift
// carries over from the neighbouring byte (the bits a byte shift would have dropped).
template <int S>
inline KP kq_bits(KP v, uint8_t mask) {
  static_assert(S > -8 && S < 8);
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  if constexpr (S > 0) return _mm256_and_si256(_mm256_slli_epi16(v, S), m);
  else if constexpr (S < 0) return _mm256_and_si256(_mm256_srli_epi16(v, -S), m);
  else return _mm256_and_si256(v, m);
}
// The int32 sums of one piece times 32 bytes of x: lane l sums columns 4l .. 4l + 3 (codes at
// most 63 times x in [-127, 127]: pairs at most 16002, no saturation in vpmaddubsw).
inline I32 kq_dot32(KP w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
#endif
}
inline void kq_block_sums(const KP* w, const int8_t* x, I32* out) {
  I32 p[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) p[k] = kq_dot32(w[k], x + 32 * k);
  // Within each 128-bit half, the 4 lanes of p[k] summed into lane k (k = 0..3) of the result: the
  // sums hadd(hadd(p0, p1), hadd(p2, p3)) gives, from single-uop unpacks and adds (vphaddd is
  // several uops on AMD cores; measured: this K-quant kernel ~1.2-1.4x faster on a Zen 3).
  // pair(a, b) = (a0+a2, b0+b2, a1+a3, b1+b3); quad(pair(a, b), pair(c, d)) = (sum a, sum b, sum c, sum d).
  auto pair = [](I32 a, I32 b) { return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b)); };
  auto quad = [](I32 t, I32 u) { return _mm256_add_epi32(_mm256_unpacklo_epi64(t, u), _mm256_unpackhi_epi64(t, u)); };
  out[0] = quad(pair(p[0], p[1]), pair(p[2], p[3]));
  out[1] = quad(pair(p[4], p[5]), pair(p[6], p[7]));
}
// Per-group float factors in the lanes of kq_block_sums: f times byte g / 2 of the 8 unsigned
// bytes b8 (one per 32-column sub-block, Q4_K / Q5_K), or f times the signed byte g of s16 (Q6_K).
inline void kq_scale8(uint64_t b8, float f, F* out) {
  const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(b8)))),
                                 _mm256_set1_ps(f));
  out[0] = _mm256_permute2f128_ps(v, v, 0x00);  // sub-blocks 0-3 in both halves: groups 0, 2, 4, 6 | 1, 3, 5, 7
  out[1] = _mm256_permute2f128_ps(v, v, 0x11);
}
inline void kq_scale16(const int8_t* s16, float f, F* out) {
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  const __m128i s = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16)), order);
  const __m256 fv = _mm256_set1_ps(f);
  out[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)), fv);
  out[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(s, s))), fv);
}

#if defined(RWKV_SIMD_AVX2)
// The AVX2 level (no VNNI): vpmaddubsw's int16 pair sums are added in int16 as far as they cannot
// overflow before vpmaddwd widens them, so that the transposing adds of kq_block_sums run on half
// as many vectors (or on int16 lanes to the end), and Q4_K / Q5_K keep one sum per 32-column
// sub-block (their scales' and x's steps' width) in lane j of one vector: half the float work of
// 16 groups. The sums are the same exact integers (batch 512, 2 threads, forced AVX2 build on a
// Xeon family 6 model 167: Q4_K 1.21-1.24x, Q5_K 1.15-1.20x, Q6_K 1.15-1.19x; docs/performance.md).
#define RWKV_KQ_AVX2 1
// Within each 128-bit half, int16 lanes of a and b summed in pairs so that dword k of the result
// holds the int16 sums of a's (k = 0, 2) or b's (k = 1, 3) two dwords k / 2, k / 2 + 2 (kq_block_sums'
// pair, in int16).
inline I16 kq_pair16(I16 a, I16 b) { return _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b)); }
inline I16 kq_quad16(I16 t, I16 u) { return _mm256_add_epi16(_mm256_unpacklo_epi64(t, u), _mm256_unpackhi_epi64(t, u)); }
inline I16 kq_m16(KP w, const int8_t* x) {
  return _mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
// Q4_K / Q5_K: lane j the sum of piece j (columns 32j .. 32j + 31). A pair of vpmaddubsw is at most
// 2 * kMaxCode * 127 in magnitude: 3810 (Q4_K, 15), eight of them added still fit int16; 7874
// (Q5_K, 31), four.
template <int kMaxCode>
inline I32 kq_sub_sums(const KP* w, const int8_t* x) {
  I16 m[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) m[k] = kq_m16(w[k], x + 32 * k);
  // half h, dword k: pieces k (a) and 4 + k (b), columns 16h .. 16h + 15 of the piece
  const I16 a = kq_quad16(kq_pair16(m[0], m[1]), kq_pair16(m[2], m[3]));
  const I16 b = kq_quad16(kq_pair16(m[4], m[5]), kq_pair16(m[6], m[7]));
  const I16 ones = _mm256_set1_epi16(1);
  if constexpr (8 * 2 * kMaxCode * 127 <= 32767) {
    const I16 s = _mm256_add_epi16(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
    return _mm256_madd_epi16(s, ones);
  } else {
    static_assert(4 * 2 * kMaxCode * 127 <= 32767);
    const I32 a32 = _mm256_madd_epi16(a, ones), b32 = _mm256_madd_epi16(b, ones);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a32, b32, 0x20), _mm256_permute2x128_si256(a32, b32, 0x31));
  }
}
// Q6_K (codes at most 63: a pair at most 16002, two of them added fit int16): kq_block_sums'
// sums in its lanes.
inline void kq_block_sums16(const KP* w, const int8_t* x, I32* out) {
  I16 m[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) m[k] = kq_m16(w[k], x + 32 * k);
  const I16 ones = _mm256_set1_epi16(1);
  I32 t[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) t[j] = _mm256_madd_epi16(kq_pair16(m[2 * j], m[2 * j + 1]), ones);
  auto quad = [](I32 p, I32 q) { return _mm256_add_epi32(_mm256_unpacklo_epi64(p, q), _mm256_unpackhi_epi64(p, q)); };
  out[0] = quad(t[0], t[1]);
  out[1] = quad(t[2], t[3]);
}
// Half h of kq_block_sums16 from that half's four pieces w4 (columns 128h ..) and x at 128h:
// out[h] alone, so that a row of x needs four codes vectors live, not eight.
inline I32 kq_half_sums16(const KP* w4, const int8_t* x) {
  const I16 ones = _mm256_set1_epi16(1);
  const I32 t0 = _mm256_madd_epi16(kq_pair16(kq_m16(w4[0], x), kq_m16(w4[1], x + 32)), ones);
  const I32 t1 = _mm256_madd_epi16(kq_pair16(kq_m16(w4[2], x + 64), kq_m16(w4[3], x + 96)), ones);
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}
// f times the 8 unsigned bytes b8 (lane j: byte j, sub-block j).
inline F kq_sub_scale8(uint64_t b8, float f) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(b8)))),
                       _mm256_set1_ps(f));
}
#endif
}  // namespace v256

#endif

#if defined(RWKV_SIMD_AVX512)

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline void stream(float* p, F v) { _mm512_stream_ps(p, v); }  // p aligned to kBytes
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float hsum(F v) {  // the two 256-bit halves added, then as the AVX2 level's
  return v256::hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
inline F load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// kW bf16 values in column order.
inline F load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline F bf16_step(const uint16_t* w, int h) { return load_bf16(w + kW * h); }
constexpr int bf16_column(int pos) { return pos; }

#if defined(__AVX512BF16__)
// bf16 dot products (vdpbf16ps): H2 holds 32 bf16 values, and dot_bf16 adds to fp32 lane j the
// products of values 2j and 2j + 1 of a and b (each exact in fp32: 8-bit significands; their sum
// rounded, then added to the lane, rounded to nearest even; denormal inputs and results are
// flushed to zero).
#define RWKV_SIMD_BF16_DOT 1
using H2 = __m512i;
inline H2 load_h2(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline F dot_bf16(F acc, H2 a, H2 b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#endif

// 512-bit vectors for the int8 / int4 GEMVs (iv8 / iv4), built where the CPU runs a 512-bit
// instruction at full width (Intel Xeons with AVX-512; AMD Zen 5 measured better on 256-bit at
// batch 1, see TUNINGS in kernels/native/build.py): a chunk of 64 columns is half the instructions of v256's (int8: two vpdpwssd instead
// of four; int4: one vpdpbusd instead of two), and the accumulators are 16 lanes. The sums of a
// chunk are the same exact integers as v256's, in other lanes, so only the fp32 accumulation order
// (and so the last bits) differs between the two builds; each is batch invariant.
namespace v512 {

inline constexpr int kW = 16;
inline constexpr int kW16 = 32;
using F = __m512;
using I32 = __m512i;
using I16 = __m512i;

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(F v) {
  return v256::hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
inline I16 load_i16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline I16 load_i8(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline I32 madd(I16 a, I16 b) { return _mm512_madd_epi16(a, b); }
inline I32 add_i(I32 a, I32 b) { return _mm512_add_epi32(a, b); }
inline I32 madd_add(I32 acc, I16 a, I16 b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return add_i(acc, madd(a, b));
#endif
}
inline F to_float(I32 v) { return _mm512_cvtepi32_ps(v); }
// int4: lanes 0-3 and 8-11 of a chunk's sums cover columns 0-31 (block s0), lanes 4-7 and 12-15
// columns 32-63 (s1): see q4_dot8.
inline F q4_groups(float s0, float s1) { return _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(s0), _mm512_set1_ps(s1)); }
// int8 group 32: lo and hi each a 32-column group's sums, adjacent lanes added into lanes 0-7 (lo)
// and 8-15 (hi); pair_scales(two) is the matching scale vector.
inline I32 join_halves(I32 lo, I32 hi) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_add_epi32(_mm512_permutex2var_epi32(lo, even, hi), _mm512_permutex2var_epi32(lo, odd, hi));
}
inline F pair_scales(const float* two) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(two[0]), _mm512_set1_ps(two[1])); }
// int4 codes times int8 x: a chunk's 32 code bytes as one vector of u8 codes, the low nibbles
// (even columns) in bytes 0-31 and the high nibbles (odd columns) in bytes 32-63: x is permuted
// as v256's (q4x8_column).
using I8 = __m512i;
inline constexpr int kQ4Pieces8 = 1;
inline I8 q4_piece8(const uint8_t* chunk, int) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), _mm512_set1_epi8(0x0F));
}
constexpr int q4x8_column(int pos) { return v256::q4x8_column(pos); }
// The int32 sums of a chunk: int32 lane l < 8 sums the even columns of 8l .. 8l + 7, lane 8 + l
// their odd columns (codes at most 15 times x in [-127, 127]: exact, see v256::dot_u8s8).
inline I32 q4_dot8(const I8* w, const int8_t* xb) {
  const __m512i x = _mm512_loadu_si512(xb);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w[0], x), _mm512_set1_epi16(1));
#endif
}

// K-quants on 512-bit vectors (kq where the build defines RWKV_KQ_512: Intel, see TUNINGS): a
// block's codes as 4 pieces of 64 columns in column order, the 16 group sums in the 16 lanes of
// one vector (group g in lane kq_lane(g)), half the instructions of v256's 8 pieces and 2 vectors.
// A format's 32 stored bytes often hold two 32-column runs (low and high nibbles, or bit pairs):
// kq_load_dup puts them in both halves and kq_shift_hi moves the high half's bits down, so that
// one kq_bits then takes both runs. The sums are the same exact integers as v256's.
using KP = __m512i;
inline constexpr int kKqVecs = 1;
inline constexpr int kKqPieces = 4;
// Piece k's dot lanes 4j .. 4j + 3 (128-bit lane j) hold group 4k + j; kq_block_sums gathers
// 128-bit lane j of the 4 pieces into lanes 4j .. 4j + 3.
constexpr int kq_lane(int g) { return 4 * (g % 4) + g / 4; }
inline KP kq_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline KP kq_load_dup(const uint8_t* p) {  // 32 bytes, in both 256-bit halves
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline KP kq_or(KP a, KP b) { return _mm512_or_si512(a, b); }
// The high half's 16-bit lanes shifted right by S (the low half as it is).
template <int S>
inline KP kq_shift_hi(KP v) { return _mm512_mask_srli_epi16(v, 0xFFFF0000u, v, S); }
// See v256::kq_bits.
template <int S>
inline KP kq_bits(KP v, uint8_t mask) {
  static_assert(S > -8 && S < 8);
  const __m512i m = _mm512_set1_epi8(static_cast<char>(mask));
  if constexpr (S > 0) return _mm512_and_si512(_mm512_slli_epi16(v, S), m);
  else if constexpr (S < 0) return _mm512_and_si512(_mm512_srli_epi16(v, -S), m);
  else return _mm512_and_si512(v, m);
}
// See v256::kq_dot32: lane l sums columns 4l .. 4l + 3 of the piece.
inline I32 kq_dot64(KP w, const int8_t* x) {
  const __m512i xv = _mm512_loadu_si512(x);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w, xv), _mm512_set1_epi16(1));
#endif
}
inline void kq_block_sums(const KP* w, const int8_t* x, I32* out) {
  I32 p[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) p[k] = kq_dot64(w[k], x + 64 * k);
  // v256's pair / quad within each 128-bit lane j: lane k of it becomes the sum of p[k]'s.
  auto pair = [](I32 a, I32 b) { return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b)); };
  auto quad = [](I32 t, I32 u) { return _mm512_add_epi32(_mm512_unpacklo_epi64(t, u), _mm512_unpackhi_epi64(t, u)); };
  out[0] = quad(pair(p[0], p[1]), pair(p[2], p[3]));
}
// Per-group float factors: see v256::kq_scale16 (the same products).
inline void kq_scale16(const int8_t* s16, float f, F* out) {
  // lane l holds group kq_lane(l) (kq_lane is its own inverse: a 4 x 4 transpose)
  const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m128i s = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16)), order);
  out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)), _mm512_set1_ps(f));
}
// Q4_K / Q5_K: the factors from a block's 16-byte head (fp16 d, dmin, then the 12 bytes of 6-bit
// sub-block scales and mins, kernels.cpp k_scales_mins) in a few vector operations instead of
// scalar byte shuffles: ws = d * scale, wm = -dmin * min of each group's sub-block (the products
// of v256::kq_scale8, so the same bits).
inline void kq_head_k(const uint8_t* blk, F* ws, F* wm) {
  // bytes 0-11 of the scales: a (0-3), b (4-7), c (8-11); 16 loaded (4 of the codes after them)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  // bytes 0-7: the scales of sub-blocks 0-7, 8-15: their mins. Low bits: a, c, b, c (mins 4-7
  // from c's high nibbles); top 2 bits of sub-blocks 4-7: those of a (scales) or b (mins).
  __m128i lo = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  lo = _mm_mask_blend_epi8(0xF000, lo, _mm_srli_epi16(lo, 4));
  lo = _mm_and_si128(lo, _mm_setr_epi8(0x3F, 0x3F, 0x3F, 0x3F, 0x0F, 0x0F, 0x0F, 0x0F, 0x3F, 0x3F, 0x3F, 0x3F, 0x0F, 0x0F, 0x0F, 0x0F));
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i sm = _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
  // d in lanes 0-7 and -dmin in 8-15, times the 16 bytes; then each group's sub-block in its lane
  __m128 h = _mm_cvtph_ps(_mm_loadu_si32(blk));
  h = _mm_xor_ps(h, _mm_setr_ps(0.f, -0.f, 0.f, 0.f));
  const __m512 dm = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_castps128_ps512(h));
  const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)), dm);
  const __m512i sub = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7);  // kq_lane(l) / 2
  ws[0] = _mm512_permutexvar_ps(sub, f);
  wm[0] = _mm512_permutexvar_ps(_mm512_add_epi32(sub, _mm512_set1_epi32(8)), f);
}

}  // namespace v512

#if defined(RWKV_INT8_512)
namespace iv8 = v512;
#else
namespace iv8 = v256;
#endif
#if defined(RWKV_INT4_512)
namespace iv4 = v512;
#else
namespace iv4 = v256;
#endif
#if defined(RWKV_KQ_512)
#define RWKV_SIMD_KQ_512 1  // K-quants: kq_head_k, kq_load_dup, kq_shift_hi (kernels.cpp formats)
namespace kq = v512;
#else
namespace kq = v256;  // K-quants: 256-bit vectors (with VNNI's vpdpbusd)
#endif

#elif defined(RWKV_SIMD_AVX2)

using namespace v256;
namespace iv8 = v256;
namespace iv4 = v256;
namespace kq = v256;

#else  // NEON

inline F zero() { return vdupq_n_f32(0.f); }
inline F set1(float v) { return vdupq_n_f32(v); }
inline F load(const float* p) { return vld1q_f32(p); }
inline void store(float* p, F v) { vst1q_f32(p, v); }
inline void stream(float* p, F v) { vst1q_f32(p, v); }
inline F add(F a, F b) { return vaddq_f32(a, b); }
inline F mul(F a, F b) { return vmulq_f32(a, b); }
inline F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
inline float hsum(F v) { return (vgetq_lane_f32(v, 0) + vgetq_lane_f32(v, 2)) + (vgetq_lane_f32(v, 1) + vgetq_lane_f32(v, 3)); }
inline F load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline F load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline I16 load_i16(const int16_t* p) { return vld1q_s16(p); }
inline I16 load_i8(const int8_t* p) { return vmovl_s8(vld1_s8(p)); }
inline I32 madd(I16 a, I16 b) {
  return vpaddq_s32(vmull_s16(vget_low_s16(a), vget_low_s16(b)), vmull_high_s16(a, b));
}
inline I32 add_i(I32 a, I32 b) { return vaddq_s32(a, b); }
inline I32 madd_add(I32 acc, I16 a, I16 b) { return add_i(acc, madd(a, b)); }
inline F to_float(I32 v) { return vcvtq_f32_s32(v); }
inline F bf16_step(const uint16_t* w, int h) { return load_bf16(w + kW * h); }
constexpr int bf16_column(int pos) { return pos; }
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline void pause() { __asm__ __volatile__("yield"); }
inline void store_fence() { __atomic_thread_fence(__ATOMIC_RELEASE); }
inline constexpr int kW16 = 2 * kW;  // int16 lanes of an I16
// See v256::q4_groups.
inline F q4_groups(float s0, float s1) { return vcombine_f32(vdup_n_f32(s0), vdup_n_f32(s1)); }
// See v256::join_halves: lanes 0-1 from lo, 2-3 from hi.
inline I32 join_halves(I32 lo, I32 hi) { return vpaddq_s32(lo, hi); }
inline F pair_scales(const float* two) { return q4_groups(two[0], two[1]); }
// int4 codes times int8 x: see v256::q4_piece8. Four 16-byte pieces: h = 0, 1 the low and high
// nibbles of bytes 0-15 (columns 0-31), h = 2, 3 those of bytes 16-31 (columns 32-63).
using I8 = uint8x16_t;
inline constexpr int kQ4Pieces8 = 4;
inline I8 q4_piece8(const uint8_t* chunk, int h) {
  const uint8x16_t v = vld1q_u8(chunk + 16 * (h / 2));
  return h % 2 == 0 ? vandq_u8(v, vdupq_n_u8(0x0F)) : vshrq_n_u8(v, 4);
}
constexpr int q4x8_column(int pos) { return 32 * (pos / 32) + 2 * (pos % 16) + (pos % 32) / 16; }
// See v256::dot_u8s8 (codes at most 15 read as signed bytes: the same values). With the dot
// product instructions (ARMv8.2 dotprod) two sdot; else widening multiplies into int16 (at most
// 2 * 15 * 127 per lane), pairs added, then pairs widened into int32.
inline I32 dot_u8s8(I8 a0, int8x16_t b0, I8 a1, int8x16_t b1) {
  const int8x16_t s0 = vreinterpretq_s8_u8(a0), s1 = vreinterpretq_s8_u8(a1);
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), s0, b0), s1, b1);
#else
  const int16x8_t lo = vmlal_s8(vmull_s8(vget_low_s8(s0), vget_low_s8(b0)), vget_low_s8(s1), vget_low_s8(b1));
  const int16x8_t hi = vmlal_high_s8(vmull_high_s8(s0, b0), s1, b1);
  return vpaddlq_s16(vpaddq_s16(lo, hi));
#endif
}
// See v256::q4_dot8: the two groups' lanes joined so that lanes 0-1 cover group 0 and 2-3 group 1.
inline I32 q4_dot8(const I8* w, const int8_t* xb) {
  const I32 g0 = dot_u8s8(w[0], vld1q_s8(xb), w[1], vld1q_s8(xb + 16));
  const I32 g1 = dot_u8s8(w[2], vld1q_s8(xb + 32), w[3], vld1q_s8(xb + 48));
  return vpaddq_s32(g0, g1);
}

// K-quants: see v256::KP. A piece is two 16-byte vectors (columns 0-15, 16-31), and each group
// of 16 columns is one sdot's four lanes, reduced pairwise in column order: group g in lane g of
// the four vectors of kq_block_sums.
struct KP {
  uint8x16_t lo, hi;
};
inline constexpr int kKqVecs = 4;
inline constexpr int kKqPieces = 8;
constexpr int kq_lane(int g) { return g; }
inline KP kq_load(const uint8_t* p) { return {vld1q_u8(p), vld1q_u8(p + 16)}; }
inline KP kq_or(KP a, KP b) { return {vorrq_u8(a.lo, b.lo), vorrq_u8(a.hi, b.hi)}; }
template <int S>
inline uint8x16_t kq_bits1(uint8x16_t v, uint8_t mask) {
  static_assert(S > -8 && S < 8);
  const uint8x16_t m = vdupq_n_u8(mask);
  if constexpr (S > 0) return vandq_u8(vshlq_n_u8(v, S), m);
  else if constexpr (S < 0) return vandq_u8(vshrq_n_u8(v, -S), m);
  else return vandq_u8(v, m);
}
template <int S>
inline KP kq_bits(KP v, uint8_t mask) { return {kq_bits1<S>(v.lo, mask), kq_bits1<S>(v.hi, mask)}; }
// 16 codes (at most 63, read as signed bytes) times 16 bytes of x, summed in 4 lanes of 4 columns.
inline I32 kq_dot16(uint8x16_t w, int8x16_t x) {
  const int8x16_t s = vreinterpretq_s8_u8(w);
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(vdupq_n_s32(0), s, x);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(s), vget_low_s8(x));
  const int16x8_t hi = vmull_high_s8(s, x);  // products at most 63 * 127: pairs fit int16
  return vpaddlq_s16(vpaddq_s16(lo, hi));
#endif
}
inline void kq_block_sums(const KP* w, const int8_t* x, I32* out) {
  I32 g[16];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    g[2 * k] = kq_dot16(w[k].lo, vld1q_s8(x + 32 * k));
    g[2 * k + 1] = kq_dot16(w[k].hi, vld1q_s8(x + 32 * k + 16));
  }
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) out[v] = vpaddq_s32(vpaddq_s32(g[4 * v], g[4 * v + 1]), vpaddq_s32(g[4 * v + 2], g[4 * v + 3]));
}
inline void kq_scale8(uint64_t b8, float f, F* out) {
  const uint16x8_t w = vmovl_u8(vcreate_u8(b8));
  const float32x4_t a = vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), f);
  const float32x4_t b = vmulq_n_f32(vcvtq_f32_u32(vmovl_high_u16(w)), f);
  out[0] = vzip1q_f32(a, a), out[1] = vzip2q_f32(a, a), out[2] = vzip1q_f32(b, b), out[3] = vzip2q_f32(b, b);
}
inline void kq_scale16(const int8_t* s16, float f, F* out) {
  const int8x16_t s = vld1q_s8(s16);
  const int16x8_t lo = vmovl_s8(vget_low_s8(s)), hi = vmovl_high_s8(s);
  out[0] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), f);
  out[1] = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), f);
  out[2] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), f);
  out[3] = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), f);
}
namespace iv8 = ::rwkv_native::simd;
namespace iv4 = ::rwkv_native::simd;
namespace kq = ::rwkv_native::simd;

#endif

inline constexpr int kBytes = kW * 4;  // of a vector

// The x permutations above are permutations (that each int32 lane of q4_dot8 sums one 32-column
// block is checked by the tests: groups of 32 with different scales).
constexpr bool layouts_consistent() {
  bool seen_q4[64] = {}, seen_bf16[16] = {};
  for (int pos = 0; pos < 64; ++pos) seen_q4[iv4::q4x8_column(pos)] = true;
  for (int pos = 0; pos < 16; ++pos) seen_bf16[bf16_column(pos)] = true;
  bool seen_kq[16] = {};
  for (int g = 0; g < 16; ++g) seen_kq[kq::kq_lane(g)] = true;
  for (bool b : seen_kq) if (!b) return false;
  for (bool b : seen_q4) if (!b) return false;
  for (bool b : seen_bf16) if (!b) return false;
  return true;
}
static_assert(layouts_consistent());

}  // namespace rwkv_native::simd
