// CPU kernels for weight-only quantized and 16-bit linear layers, written once on the SIMD layer
// of simd.h and compiled once per ISA level (AVX2, AVX-512, NEON).
//
// GEMV: y[b, n] = sum_k x[b, k] * W[n, k] for a short batch x [B, K] (8 rows of x per pass over
// W) and a weight W [N, K] stored as fp32 / bf16 / fp16, int8 with fp16 scales, or packed int4
// with fp16 scales and biases (formats defined in rwkv_engine/quant/primitives.py, which is also
// the reference these kernels are tested against). Plus dequantization into dense tiles (for the
// prefill GEMM) and the int4 quantizer.
//
// Decode reads every weight once per token: one row of x is memory-bound, and the aim is to keep
// the unpacking cheaper than the memory stream; a batch of rows of x uses each weight B times,
// and the aim is to keep the multiply pipes busy (see the tiled driver below).
//   * Dense weights: x is converted to fp32 once per call, then FMAs; at the avx512_bf16 level,
//     bf16 weights times x whose values are bf16 use the bf16 dot product (DenseBF16DotKernel).
//   * int8 / int4: x is rounded to small integers and the products are summed exactly in int32
//     (256- or 512-bit vectors at the AVX-512 levels, see simd.h iv8 / iv4). int8 weights: x in int16 per
//     64 columns, iv8::madd (vpmaddwd, 16 per instruction; vpdpwssd adds in the same instruction
//     with VNNI). int4 weights: x in int8 per 32 columns, iv4::dot_u8s8 (vpdpbusd, 32 per
//     instruction, with VNNI; vpmaddubsw + vpmaddwd on AVX2; sdot / widening multiplies on
//     NEON); x is permuted (iv4::q4x8_column) so that a mask and a shift put the codes in the
//     right lanes (no shuffles in the inner loop).
//   * Blocks of R weight rows x Bt rows of x share their loads; per-chunk / per-group partial
//     sums are scaled once (the int4 bias term is sum_g bias_g * sum(rounded x over group g)).
//   * The next block of rows is prefetched while the current one is read (short quantized rows,
//     and any rows read a K tile at a time).
// Rows are split across threads by pool.h (torch.set_num_threads applies). No torch headers
// here: this file compiles in seconds.

#include "kernels.h"
#include "amx.h"
#include "numeric.h"
#include "pool.h"
#include "simd.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace rwkv_native {
namespace {

using simd::F;
using simd::kW;
namespace iv8 = simd::iv8;  // the vectors of the int8 GEMVs
namespace iv4 = simd::iv4;  // and of the int4 ones
namespace kq = simd::kq;    // and of the K-quant ones

constexpr int kMaxB = 8;                   // rows of x per pass over the weights
constexpr int64_t kMinParallel = 1 << 16;  // weights below which one thread does the whole call
constexpr int64_t kMinItem = 1 << 15;      // weights: the smallest work item of a parallel GEMV

inline float load_elem(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return half_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_elem(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_half(v); break;
  }
}

// `bytes` bytes at `consumed` bytes into next_block, into L1 (kL2: into L2).
template <bool kL2 = false>
inline void prefetch_next(const void* next_block, int64_t consumed, int64_t bytes) {
  const char* p = static_cast<const char*>(next_block) + consumed;
  for (int64_t i = 0; i < bytes; i += 64) kL2 ? simd::prefetch_l2(p + i) : simd::prefetch(p + i);
}

// The output y [B, N] in x's dtype, written one value at a time (B*N stores per call, so the
// runtime dtype switch costs nothing next to the N*K weight reads).
struct Out {
  void* p;
  DType t;
  inline void put(int64_t i, float v) const { store_elem(p, t, i, v); }
  Out offset(int64_t i) const { return {static_cast<char*>(p) + i * dtype_bytes(t), t}; }
};

// ---------------------------------------------------------------------------------------------
// x preparation: an fp32 copy of x [B, K], permuted per weight format.

// fp32 copy of n elements of x (vectorized for the three dtypes).
void to_float(const void* x, DType xt, int64_t off, int64_t n, float* d) {
  int64_t i = 0;
  if (xt == DType::kF32) {
    std::memcpy(d, static_cast<const float*>(x) + off, static_cast<size_t>(n) * 4);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(x) + off;
  if (xt == DType::kBF16) {
    for (; i + kW <= n; i += kW) simd::store(d + i, simd::load_bf16(s + i));
  } else {
    for (; i + kW <= n; i += kW) simd::store(d + i, simd::load_f16(s + i));
  }
  for (; i < n; ++i) d[i] = load_elem(x, xt, off + i);
}

// The fp16 column scales cs [K] in fp32 (empty without them), and row b of x [B, K] in fp32 times
// them: the x that the integer kernels round (see kernels.h).
std::vector<float> col_scales_f32(const uint16_t* cs, int64_t K) {
  std::vector<float> c;
  if (cs != nullptr) {
    c.resize(static_cast<size_t>(K));
    to_float(cs, DType::kF16, 0, K, c.data());
  }
  return c;
}

void scaled_row(const void* x, DType xt, int64_t b, int64_t K, const std::vector<float>& c, float* d) {
  to_float(x, xt, b * K, K, d);
  if (!c.empty())
    for (int64_t k = 0; k < K; ++k) d[k] *= c[k];
}

// Row stride of a prepared x [B, K] with `line` elements per 64-byte cache line: K rounded up
// to whole lines, plus one: rows a multiple of 4 KB apart (K = 2048, 7168) would fall into the
// same L1 sets, and the rows of an x tile would evict each other.
constexpr int64_t padded_stride(int64_t K, int64_t line) { return (K + line - 1) / line * line + line; }

// x [B, K] -> fp32 [B, padded_stride(K, 16)]; with `bf16`, each full 16-column step in the order
// of simd::bf16_step (a tail shorter than a step keeps its order).
std::vector<float> prepare_x(const void* x, DType xt, int64_t B, int64_t K, bool bf16) {
  const int64_t Kx = padded_stride(K, 16);
  std::vector<float> xp(static_cast<size_t>(B * Kx));
  std::vector<float> buf(xt == DType::kF32 ? 0 : static_cast<size_t>(K));
  for (int64_t b = 0; b < B; ++b) {
    const float* s = static_cast<const float*>(x) + b * K;
    if (xt != DType::kF32) {
      to_float(x, xt, b * K, K, buf.data());
      s = buf.data();
    }
    float* d = xp.data() + b * Kx;
    std::copy(s, s + K, d);
    if (bf16)
      for (int64_t k = 0; k + 16 <= K; k += 16)
        for (int p = 0; p < 16; ++p) d[k + p] = s[k + simd::bf16_column(p)];
  }
  return xp;
}

// Row blocks per work item when nblocks blocks of a matrix of `weights` weights are shared out:
// about 1/8 of a thread's share, so a thread that the OS runs late (a shared machine) leaves its
// work to the others instead of holding everyone up; all of them for a small matrix (waking
// threads costs more than it saves).
int64_t blocks_per_item(int64_t nblocks, int64_t weights, int T) {
  return std::max<int64_t>(1, weights < kMinParallel || T <= 1 ? nblocks : nblocks / (8 * T));
}

// Runs fn(n0, n1) over all rows in ranges that are multiples of `block` rows, on all threads
// (pool.h; a single range runs on the calling thread).
template <typename F>
void for_rows(int64_t N, int64_t K, int64_t block, const F& fn) {
  const int64_t nblocks = (N + block - 1) / block;
  const int64_t step = blocks_per_item(nblocks, N * K, omp_get_max_threads());
  parallel_for((nblocks + step - 1) / step, [&](int64_t i) {
    const int64_t b0 = i * step, b1 = std::min(nblocks, b0 + step);
    fn(b0 * block, std::min(N, b1 * block));
  });
}

// ---------------------------------------------------------------------------------------------
// The GEMV driver, shared by all weight formats.
//
// A format's kernel keeps one fp32 accumulator vector per (weight row n, x row b), adds to it
// one "step" of K after the other (16 columns for dense weights, 64 for int8 / int4) and turns
// its horizontal sum into y[b, n] in `finish` (adding the columns past the last full step and
// any bias term). Batch invariance: each accumulator receives the same operations in the same
// order whatever the batch size, the row block and the K tiles, so a row of a batch gives the
// bits of the same x alone.
//
// Speed: a weight row is used by all B rows of x. A kernel's tile<R, Bt> holds an R x Bt block
// of accumulators in registers, so that each weight load serves Bt rows of x and each x load R
// weight rows (with R = 1, as before, every multiply-add needed its own x load, from L2 when
// B x K no longer fits L1). The steps are cut into K tiles small enough that the tile of all B
// rows of x (kXTileBytes) stays in L1 while a panel of kPanel weight rows goes through it; the
// panel's accumulators wait in L1 between tiles. With B = 1 the tile is the whole row.

constexpr int kPanel = 24;                 // weight rows per panel (a multiple of every R)
constexpr int kAheadBlocks = 3;            // with B > 1: prefetch this many row blocks ahead, into L2
constexpr int64_t kXTileBytes = 16 << 10;  // prepared x of one K tile, all rows of the pass

// A kernel's R x Bt block of accumulators, from / back to the panel's acc (row stride `stride`).
template <int R, int Bt, typename V>
inline void load_block(V (&a)[R][Bt], const V* acc, int stride) {
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < Bt; ++b) a[r][b] = acc[r * stride + b];
}
template <int R, int Bt, typename V>
inline void store_block(const V (&a)[R][Bt], V* acc, int stride) {
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < Bt; ++b) acc[r * stride + b] = a[r][b];
}

// Rows [r0, r1) of a pass of B rows of x; results to y [B, N].
template <int B, typename Kern>
void run_tiled(const Kern& kern, int64_t r0, int64_t r1, int64_t N, const Out& y) {
  constexpr int R = Kern::template kRows<B>, Bt = Kern::template kXRows<B>;
  static_assert(kPanel % R == 0);
  const int64_t steps = kern.steps();
  const int64_t tile = std::max<int64_t>(1, kXTileBytes / (B * Kern::kStepBytes));  // steps per K tile
  // While a block of R rows is read, the first group of x rows prefetches the next block's
  // columns of the tile: the panel order (R rows x a tile of columns at a time) defeats the
  // hardware prefetcher. With B = 1 only for the short rows of the quantized formats (see
  // kPrefetchMaxRow).
  const bool pf = B > 1 || kern.prefetch_alone();
  using Acc = typename Kern::Acc;
  alignas(64) Acc acc[kPanel * B];  // [panel row][b]
  for (int64_t p0 = r0; p0 < r1; p0 += kPanel) {
    const int64_t p1 = std::min(r1, p0 + kPanel);
    for (int64_t i = 0; i < (p1 - p0) * B; ++i) acc[i] = Acc{};  // zeros
    for (int64_t s0 = 0; s0 < steps; s0 += tile) {
      const int64_t s1 = std::min(steps, s0 + tile);
      // All B rows of x against weight rows n..n+Rr, in groups of Bt rows of x.
      auto block = [&]<int Rr>(int64_t n) {
        Acc* a = acc + (n - p0) * B;
        for (int b = 0; b + Bt <= B; b += Bt) kern.template tile<Rr, Bt>(n, b, s0, s1, a + b, B, b == 0 && pf);
        if constexpr (B % Bt != 0)
          kern.template tile<Rr, B % Bt>(n, B - B % Bt, s0, s1, a + B - B % Bt, B, false);
      };
      int64_t n = p0;
      for (; n + R <= p1; n += R) block.template operator()<R>(n);
      for (; n < p1; ++n) block.template operator()<1>(n);
    }
    for (int64_t n = p0; n < p1; ++n)
      for (int b = 0; b < B; ++b) y.put(b * N + n, kern.finish(n, b, Kern::hsum(acc[(n - p0) * B + b])));
  }
}

// ---------------------------------------------------------------------------------------------
// Dense weights: fp32, bf16, fp16. A step is 16 columns, decoded as 16 / kW fp32 vectors
// (h = 0 ..) that line up with xp[k + kW h .. k + kW (h + 1)).

struct DenseF32 {
  using T = float;
  static inline F load(const float* w, int h) { return simd::load(w + kW * h); }
  static inline float scalar(const float* w, int64_t k) { return w[k]; }
};

struct DenseBF16 {
  using T = uint16_t;
  static inline F load(const uint16_t* w, int h) { return simd::bf16_step(w, h); }
  static inline float scalar(const uint16_t* w, int64_t k) { return bf16_to_float(w[k]); }
};

struct DenseF16 {
  using T = uint16_t;
  static inline F load(const uint16_t* w, int h) { return simd::load_f16(w + kW * h); }
  static inline float scalar(const uint16_t* w, int64_t k) { return half_to_float(w[k]); }
};

// y = x W^T for one pass, xp [B, Kx] prepared by prepare_x for D.
template <typename D>
struct DenseKernel {
  static constexpr int64_t kStepBytes = 16 * 4;  // prepared x per step and row of x
  // Accumulators R x Bt + R weights + one x vector fit AVX2's 16 registers without spilling; at
  // B = 1 (memory-bound) eight rows keep enough loads in flight (docs/performance.md).
  template <int B> static constexpr int kRows = B == 1 ? 8 : B == 2 ? 4 : B == 3 ? 3 : 2;
  template <int B> static constexpr int kXRows = B <= 4 ? B : 4;
  static constexpr int kVecs = 16 / kW;  // vectors per step
  using Acc = F;
  static float hsum(F v) { return simd::hsum(v); }

  const typename D::T* W;
  int64_t K;
  const float* xp;
  int64_t Kx = padded_stride(K, 16);

  int64_t steps() const { return K / 16; }
  bool prefetch_alone() const { return false; }  // long rows stream well alone

  template <int R, int Bt>
  inline void tile(int64_t n, int b0, int64_t s0, int64_t s1, F* acc, int stride, bool pf) const {
    F a[R][Bt];
    load_block(a, acc, stride);
    const typename D::T* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = W + (n + r) * K;
    const float* x = xp + b0 * Kx;
    for (int64_t k = s0 * 16; k < s1 * 16; k += 16) {
      if (pf)
        for (int r = 0; r < R; ++r) simd::prefetch_l2(rows[r] + kAheadBlocks * R * K + k);
#pragma GCC unroll 4
      for (int h = 0; h < kVecs; ++h) {
        F w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) w[r] = D::load(rows[r] + k, h);
#pragma GCC unroll 4
        for (int b = 0; b < Bt; ++b) {
          F xv = simd::load(x + b * Kx + k + kW * h);
          simd::keep(xv);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) a[r][b] = simd::fma(w[r], xv, a[r][b]);
        }
      }
    }
    store_block(a, acc, stride);
  }

  float finish(int64_t n, int b, float v) const {
    const typename D::T* row = W + n * K;
    for (int64_t k = K / 16 * 16; k < K; ++k) v += D::scalar(row, k) * xp[b * Kx + k];
    return v;
  }
};

#if defined(RWKV_SIMD_BF16_DOT)
// bf16 weights times x whose values are bf16 (the activations of a bf16 model), with the CPU's
// bf16 dot products (simd::dot_bf16, vdpbf16ps): a step is 32 columns, one 64-byte vector of a
// weight row and of a row of xb (x as bf16 [B, padded_stride(K, 32)]), multiplied and added
// into 16 fp32 lanes with no conversion of the weights. Per multiply-add half the instructions of
// DenseKernel<DenseBF16> and twice the multiply-adds per instruction (faster in and out of cache:
// docs/performance.md). The sums round differently from the FMA kernel (pairs of
// products first, denormals flushed), so this level's results are its own; every accumulator
// still takes the same operations for any batch, so batched = alone holds.
struct DenseBF16DotKernel {
  static constexpr int64_t kStepBytes = 32 * 2;  // prepared x per step and row of x
  // R x Bt accumulators + R weights + one x vector within AVX-512's 32 registers; R divides
  // kPanel. One row at a time at B = 1, one sequential stream per thread (as kIntRows), which
  // streamed faster than R = 8 (docs/performance.md, kernel design choices).
  template <int B> static constexpr int kRows = B == 1 ? 1 : B <= 2 ? 8 : B == 3 ? 6 : B <= 6 ? 4 : 3;
  template <int B> static constexpr int kXRows = B;
  using Acc = F;
  static float hsum(F v) { return simd::hsum(v); }

  const uint16_t* W;
  int64_t K;
  const uint16_t* xb;
  int64_t Kx = padded_stride(K, 32);

  int64_t steps() const { return K / 32; }
  bool prefetch_alone() const { return false; }  // long rows stream well alone

  template <int R, int Bt>
  inline void tile(int64_t n, int b0, int64_t s0, int64_t s1, F* acc, int stride, bool pf) const {
    F a[R][Bt];
    load_block(a, acc, stride);
    const uint16_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = W + (n + r) * K;
    const uint16_t* x = xb + b0 * Kx;
    for (int64_t k = s0 * 32; k < s1 * 32; k += 32) {
      if (pf)
        for (int r = 0; r < R; ++r) simd::prefetch_l2(rows[r] + kAheadBlocks * R * K + k);
      simd::H2 w[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) w[r] = simd::load_h2(rows[r] + k);
#pragma GCC unroll 8
      for (int b = 0; b < Bt; ++b) {
        simd::H2 xv = simd::load_h2(x + b * Kx + k);
        simd::keep(xv);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[r][b] = simd::dot_bf16(a[r][b], w[r], xv);
      }
    }
    store_block(a, acc, stride);
  }

  float finish(int64_t n, int b, float v) const {  // the columns past the last full step
    const uint16_t* row = W + n * K;
    for (int64_t k = K / 32 * 32; k < K; ++k) v += bf16_to_float(row[k]) * bf16_to_float(xb[b * Kx + k]);
    return v;
  }
};
#endif

// x [B, K] whose values are bf16 -> bf16 [B, padded_stride(K, 32)] (fp32: the high halves).
std::vector<uint16_t> prepare_xb(const void* x, DType xt, int64_t B, int64_t K) {
  const int64_t Kx = padded_stride(K, 32);
  std::vector<uint16_t> xb(static_cast<size_t>(B * Kx));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < K; ++k) {
      uint16_t v;
      if (xt == DType::kBF16) {
        v = static_cast<const uint16_t*>(x)[b * K + k];
      } else {
        uint32_t u;
        std::memcpy(&u, static_cast<const float*>(x) + b * K + k, 4);
        v = static_cast<uint16_t>(u >> 16);
      }
      xb[b * Kx + k] = v;
    }
  return xb;
}

// Whether a GEMV runs DenseBF16DotKernel: bf16 weights, x exact in bf16, on a level with it.
bool bf16_dot(const GemvCall& c) {
#if defined(RWKV_SIMD_BF16_DOT)
  return c.l->kind == Linear::Kind::kDense && c.l->wt == DType::kBF16 && c.exact == DType::kBF16 &&
         c.xt != DType::kF16;
#else
  (void)c;
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------
// Integer-dot kernels for int8 / int4 weights. x is rounded per block of columns to small signed
// integers (symmetric: step = the block's absmax / qmax, nearest even), the products of codes and
// rounded x are summed exactly in int32, and each chunk's sums are scaled once.
//   * int8 weights: x to int16 per 64-column chunk (step about 1.5e-5 of the chunk's largest
//     value: below bf16 / fp16 rounding), products summed with iv8::madd (vpmaddwd, 16 per
//     instruction; vpdpwssd adds in the same instruction with VNNI). A last partial chunk (K % 64
//     columns, per-channel scales only) uses fp32 x directly.
//   * int4 weights: x to int8 per 32 columns (step 1/127 of the block's absmax; the rounding is
//     part of the format's math, primitives.round_activations_int8), unsigned codes times signed
//     x with iv4::dot_u8s8 (vpdpbusd, 32 per instruction, with VNNI; vpmaddubsw + vpmaddwd on
//     AVX2; sdot / widening multiplies on NEON). A last group of 32 columns (K % 64 == 32) is
//     summed in fp32 from the rounded x.

struct XQ {
  std::vector<int16_t> q;  // int8 weights: [B, padded_stride(K, 32)] int16
  std::vector<int8_t> q8;  // int4 weights: [B, padded_stride(K, 64)] int8, chunks permuted (iv4::q4x8_column)
  std::vector<float> dx;   // the steps: q [B, K / 64]; q8 [B, K / 64, iv4::kW], one vector per chunk
                           // (iv4::q4_groups of its two 32-column blocks' steps)
  std::vector<float> xf;   // [B, K] fp32 x in column order
  std::vector<float> xh;   // [B, K] x as rounded (q * dx) in column order; q: tail exact
};

// Rows b0.. of an XQ, as the kernels read it.
struct XQView {
  const void* q;  // int16 / int8, row stride qs
  const float* dx;  // row stride dxs
  const float* xf;
  const float* xh;
  int64_t qs, dxs;
};

XQView view(const XQ& x, int64_t b0, int64_t K) {
  const int64_t C = K / 64;
  if (!x.q8.empty()) {
    const int64_t qs = padded_stride(K, 64), dxs = C * iv4::kW;
    return {x.q8.data() + b0 * qs, x.dx.data() + b0 * dxs, x.xf.data() + b0 * K, x.xh.data() + b0 * K, qs, dxs};
  }
  const int64_t qs = padded_stride(K, 32);
  return {x.q.data() + b0 * qs, x.dx.data() + b0 * C, x.xf.data() + b0 * K, x.xh.data() + b0 * K, qs, C};
}

// n values of src rounded to integers of magnitude <= qmax in steps of their absmax / qmax
// (nearest even) into q, and the rounded values q * step into xh; returns the step. The same
// fp32 operations as primitives.round_activations_int16 / _int8. A block whose qmax / absmax
// overflows (absmax 0 or below ~1e-37) rounds to zero; a block holding a NaN or an infinity
// returns a NaN step, so the rows it enters come out NaN instead of silently finite.
template <typename T>
float round_block(const float* src, int n, float qmax, T* q, float* xh) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(src[i]);
    amax = std::max(amax, a);
    finite &= a <= std::numeric_limits<float>::max();  // false for a NaN
  }
  if (!finite) {
    for (int i = 0; i < n; ++i) {
      q[i] = 0;
      xh[i] = std::numeric_limits<float>::quiet_NaN();
    }
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float r = qmax / amax, dx = amax / qmax, inv = std::isinf(r) ? 0.f : r;
  for (int i = 0; i < n; ++i) {
    const float v = std::nearbyint(src[i] * inv);  // |v| <= qmax
    q[i] = static_cast<T>(v);
    xh[i] = v * dx;
  }
  return dx;
}

// x [B, K] (times the optional fp16 column scales cs, in fp32; see kernels.h) rounded for the
// int8 weights (int16 per 64 columns) or, with `int8`, for the int4 weights (int8 per 32).
XQ prepare_xq(const void* x, DType xt, int64_t B, int64_t K, bool int8, const uint16_t* cs) {
  const int64_t C = K / 64;
  XQ r;
  r.xf.resize(static_cast<size_t>(B * K));
  const std::vector<float> c = col_scales_f32(cs, K);
  for (int64_t b = 0; b < B; ++b) scaled_row(x, xt, b, K, c, r.xf.data() + b * K);
  r.xh = r.xf;
  if (!int8) {
    r.q.resize(static_cast<size_t>(B * padded_stride(K, 32)));
    r.dx.resize(static_cast<size_t>(B * C));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t k = b * K + c * 64;
        r.dx[b * C + c] = round_block(r.xf.data() + k, 64, 32767.f, r.q.data() + b * padded_stride(K, 32) + c * 64,
                                      r.xh.data() + k);
      }
    return r;
  }
  r.q8.resize(static_cast<size_t>(B * padded_stride(K, 64)));
  r.dx.resize(static_cast<size_t>(B * C * iv4::kW));
  int8_t tmp[64];
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t k = b * K + c * 64;
      const float d0 = round_block(r.xf.data() + k, 32, 127.f, tmp, r.xh.data() + k);
      const float d1 = round_block(r.xf.data() + k + 32, 32, 127.f, tmp + 32, r.xh.data() + k + 32);
      iv4::store(r.dx.data() + (b * C + c) * iv4::kW, iv4::q4_groups(d0, d1));
      // position p of the chunk takes the column that iv4::q4_piece8 puts in its lane
      int8_t* d = r.q8.data() + b * padded_stride(K, 64) + c * 64;
      for (int i = 0; i < 64; ++i) d[i] = tmp[iv4::q4x8_column(i)];
    }
    if (C * 64 < K)  // the last 32 columns: only their rounded values (Q4Format::finish)
      round_block(r.xf.data() + b * K + C * 64, 32, 127.f, tmp, r.xh.data() + b * K + C * 64);
  }
  return r;
}

// The int8 / int4 kernel. A step is a 64-column chunk, which the weight format (Q8Format /
// Q4Format) decodes into pieces (int16 vectors for int8, u8 vectors for int4) and multiplies
// with the prepared x into int32 sums (Fmt::dot), then acc[n][b] += (float(sum) * dx[b, chunk])
// * scale. The loop is bound by instructions, not loads, so x loads are not shared between
// weight rows. At B = 1 (decode) one row at a time: each thread then reads one sequential stream
// (plus the next row prefetched), which streams weights from memory faster than R rows a row
// apart (benchmarks/bench_kernels.py).
template <int B> constexpr int kIntRows = B <= 1 ? 1 : B <= 2 ? 4 : B <= 4 ? 2 : 1;
template <int B> constexpr int kIntXRows = B;

// Quantized rows are short (1-4 KB) and read R at a time, which the hardware prefetcher follows
// poorly, so while a block of rows is read the next block's rows are prefetched at the same
// pace (docs/performance.md, kernel design choices). Longer rows (dense weights, or any row over
// kPrefetchMaxRow bytes) stream well on their own and got slower with it.
constexpr int64_t kPrefetchMaxRow = 4096;

template <typename Fmt>
struct IntKernel {
  static constexpr int64_t kStepBytes = Fmt::kXStepBytes;  // prepared x per chunk and row of x
  static constexpr int64_t kMaxSteps = kXTileBytes / kStepBytes;  // of a K tile (B = 1)
  static constexpr int kPieces = Fmt::kPieces;
  using Acc = typename Fmt::Acc;
  using X = typename Fmt::X;
  static float hsum(Acc v) { return Fmt::hsum(v); }
  template <int B> static constexpr int kRows = kIntRows<B>;
  template <int B> static constexpr int kXRows = kIntXRows<B>;

  Fmt f;  // the weight format
  XQView x;

  int64_t steps() const { return f.K / 64; }
  bool prefetch_alone() const { return Fmt::kRowBytes(f.K) <= kPrefetchMaxRow; }

  template <int R, int Bt>
  inline void tile(int64_t n, int b0, int64_t s0, int64_t s1, Acc* acc, int stride, bool pf) const {
    // Everything in locals: the accumulator stores may alias any memory as far as GCC knows.
    const Fmt fm = f;
    const int64_t C = fm.K / 64, rb = Fmt::kRowBytes(fm.K);
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = fm.row(n + r);
    const X* xq[Bt];
    const float* dx[Bt];
    for (int b = 0; b < Bt; ++b) xq[b] = static_cast<const X*>(x.q) + (b0 + b) * x.qs, dx[b] = x.dx + (b0 + b) * x.dxs;
    Acc fa[R][Bt];
    load_block(fa, acc, stride);
    // The rows' fp16 scales for the tile in fp32, two per chunk (its halves' groups), converted
    // 8 at a time once per tile rather than one at a time per chunk.
    alignas(32) float sc[R][2 * kMaxSteps];
    for (int r = 0; r < R; ++r) fm.scales(n + r, s0, s1, sc[r]);
    // contiguous rows; with B > 1 kAheadBlocks blocks ahead, into L2 (as the dense kernels)
    const char* next = reinterpret_cast<const char*>(rows[0] + (Bt > 1 ? kAheadBlocks : 1) * R * rb);
    const bool whole = s0 == 0 && s1 == C;
    for (int64_t c = s0; c < s1; ++c) {
      if (pf) {
        if (whole)  // the next block's R rows are contiguous: read them at the same pace
          prefetch_next<(Bt > 1)>(next, c * R * Fmt::kChunkBytes, R * Fmt::kChunkBytes);
        else if (c * Fmt::kChunkBytes % 64 == 0)  // the next cache line of each row
          for (int r = 0; r < R; ++r) prefetch_next<(Bt > 1)>(next + r * rb, c * Fmt::kChunkBytes, 1);
      }
      // A row's pieces stay in registers while each row of x takes its exact int32 sums (x folds
      // into the multiply-adds), then the scaling (Fmt::scale: each lane's group scale).
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        typename Fmt::Piece w[kPieces];
#pragma GCC unroll 8
        for (int h = 0; h < kPieces; ++h) w[h] = fm.piece(rows[r] + c * Fmt::kChunkBytes, h);
        const Acc s = fm.scale(sc[r] + 2 * (c - s0));
#pragma GCC unroll 8
        for (int b = 0; b < Bt; ++b)
          fa[r][b] = Fmt::accumulate(fa[r][b], fm.dot(w, xq[b] + c * 64), Fmt::xstep(dx[b], c), s);
      }
    }
    store_block(fa, acc, stride);
  }

  float finish(int64_t n, int b, float v) const { return f.finish(n, b, v, x); }
};

// int8 weights, fp16 scales (N, G) with K / G a multiple of 32 or G == 1 (per channel).
// Group 32 (ggml's Q8_0 layout): a chunk's pieces 0-1 are one group and pieces 2-3 the next, and
// the halves' sums are kept apart (kSplit) and joined into one vector (iv8::join_halves) whose
// lanes take each their group's scale (iv8::pair_scales). kSplit is a template parameter: a run-time
// flag tested in the inner loop was slower (docs/performance.md, kernel design choices).
template <bool kSplit>
struct Q8Format {
  static constexpr int64_t kChunkBytes = 64;
  static constexpr int64_t kXStepBytes = 64 * 2;  // int16 x
  static constexpr int kPieces = 64 / iv8::kW16;   // four on x86, eight on NEON
  using X = int16_t;
  using Piece = iv8::I16;
  using Acc = iv8::F;
  static float hsum(Acc v) { return iv8::hsum(v); }
  // acc + (float(sum) * xstep) * scale: a chunk's exact sums scaled into the accumulator
  static inline Acc accumulate(Acc acc, iv8::I32 sum, Acc xstep, Acc scale) {
    return iv8::fma(iv8::mul(iv8::to_float(sum), xstep), scale, acc);
  }
  static constexpr int64_t kRowBytes(int64_t K) { return K; }
  const int8_t* Q;
  const uint16_t* S;
  int64_t K, G;
  int gshift;  // chunk c has the scale of group c >> gshift (power-of-two groups; else c / cpg)
  int cpg;     // chunks per group (per channel: all of them)

  Q8Format(const int8_t* q, const uint16_t* s, int64_t k, int64_t g)
      : Q(q), S(s), K(k), G(g),
        cpg(static_cast<int>(std::max<int64_t>(1, k / g / 64))) {
    gshift = G == 1 ? 31 : (cpg & (cpg - 1)) == 0 ? __builtin_ctz(cpg) : -1;
  }

  const uint8_t* row(int64_t n) const { return reinterpret_cast<const uint8_t*>(Q + n * K); }
  static inline iv8::I16 piece(const uint8_t* chunk, int h) {
    return iv8::load_i8(reinterpret_cast<const int8_t*>(chunk) + iv8::kW16 * h);
  }
  // The exact int32 sums of a chunk: one vector (the order of integer adds does not matter), or
  // with kSplit the halves' sums joined.
  static inline iv8::I32 dot(const iv8::I16* w, const int16_t* xb) {
    iv8::I32 lo = iv8::madd(w[0], iv8::load_i16(xb));
#pragma GCC unroll 4
    for (int h = 1; h < kPieces / 2; ++h) lo = iv8::madd_add(lo, w[h], iv8::load_i16(xb + h * iv8::kW16));
    if constexpr (kSplit) {
      iv8::I32 hi = iv8::madd(w[kPieces / 2], iv8::load_i16(xb + kPieces / 2 * iv8::kW16));
#pragma GCC unroll 4
      for (int h = kPieces / 2 + 1; h < kPieces; ++h) hi = iv8::madd_add(hi, w[h], iv8::load_i16(xb + h * iv8::kW16));
      return iv8::join_halves(lo, hi);
    }
#pragma GCC unroll 4
    for (int h = kPieces / 2; h < kPieces; ++h) lo = iv8::madd_add(lo, w[h], iv8::load_i16(xb + h * iv8::kW16));
    return lo;
  }
  // Row n's scales of chunks [c0, c1): dst[2 (c - c0) + part], part = the chunk's half.
  void scales(int64_t n, int64_t c0, int64_t c1, float* dst) const {
    const uint16_t* s = S + n * G;
    if (kSplit) return to_float(s + 2 * c0, DType::kF16, 0, 2 * (c1 - c0), dst);
    for (int64_t c = c0; c < c1; ++c) {
      const int i = static_cast<int>(c);
      dst[2 * (c - c0)] = dst[2 * (c - c0) + 1] = half_to_float(s[gshift >= 0 ? i >> gshift : i / cpg]);
    }
  }
  // The scale vector of a chunk's sums, from its two scales.
  static inline iv8::F scale(const float* two) {
    if constexpr (kSplit) return iv8::pair_scales(two);
    return iv8::set1(two[0]);
  }
  static inline iv8::F xstep(const float* dx, int64_t c) { return iv8::set1(dx[c]); }

  float finish(int64_t n, int b, float v, const XQView& x) const {
    const int64_t C = K / 64;
    if (C * 64 < K) {  // per-channel only (grouped layouts have K % 64 == 0)
      const int8_t* row = Q + n * K;
      float d = 0.f;
      for (int64_t k = C * 64; k < K; ++k) d += static_cast<float>(row[k]) * x.xf[b * K + k];
      v += d * half_to_float(S[n * G + G - 1]);
    }
    return v;
  }
};

// int4 weights, fp16 scales and biases (N, G), group size 32 / 64 / 128.
// w = code * scale + bias, so row n gives  sum_g scale_g * (codes_g . x_g) + sum_g bias_g * xsum_g.
// The int32 lanes of a chunk's sums (iv4::q4_dot8) each cover columns of one 32-column block,
// with its own step of x and (group 32) its own scale: iv4::q4_groups.
struct Q4Format {
  static constexpr int64_t kChunkBytes = 32;
  static constexpr int64_t kXStepBytes = 64 + 4 * iv4::kW;  // int8 x and its steps
  static constexpr int kPieces = iv4::kQ4Pieces8;
  using X = int8_t;
  using Piece = iv4::I8;
  using Acc = iv4::F;
  static float hsum(Acc v) { return iv4::hsum(v); }
  static inline Acc accumulate(Acc acc, iv4::I32 sum, Acc xstep, Acc scale) {  // see Q8Format
    return iv4::fma(iv4::mul(iv4::to_float(sum), xstep), scale, acc);
  }
  static constexpr int64_t kRowBytes(int64_t K) { return K / 2; }
  const uint8_t* Q;
  const uint16_t *S, *Z;
  int64_t K, G;
  const float* xsum;  // [B, G]: sum of the rounded x over each group (the bias term)
  int gshift = K / G == 128;  // group of chunk c (group size 64 / 128): c >> gshift

  const uint8_t* row(int64_t n) const { return Q + n * (K / 2); }
  static inline iv4::I8 piece(const uint8_t* chunk, int h) { return iv4::q4_piece8(chunk, h); }
  static inline iv4::I32 dot(const iv4::I8* w, const int8_t* xb) { return iv4::q4_dot8(w, xb); }
  void scales(int64_t n, int64_t c0, int64_t c1, float* dst) const {
    const uint16_t* s = S + n * G;
    if (K / G == 32) return to_float(s + 2 * c0, DType::kF16, 0, 2 * (c1 - c0), dst);
    for (int64_t c = c0; c < c1; ++c) dst[2 * (c - c0)] = dst[2 * (c - c0) + 1] = half_to_float(s[c >> gshift]);
  }
  // Group 32: the two groups of a chunk scale their own lanes; else both the same.
  static inline iv4::F scale(const float* two) { return iv4::q4_groups(two[0], two[1]); }
  static inline iv4::F xstep(const float* dx, int64_t c) { return iv4::load(dx + c * iv4::kW); }

  float finish(int64_t n, int b, float v, const XQView& x) const {
    const int64_t C = K / 64;
    const uint16_t* srow = S + n * G;
    const uint16_t* zrow = Z + n * G;
    if (C * 64 < K) {  // one last group of 32 columns when K is an odd multiple of 32
      const uint8_t* row = Q + n * (K / 2);
      float d = 0.f;
      for (int64_t kk = C * 64; kk < K; ++kk) {
        const uint8_t byte = row[kk / 2];
        const int code = (kk & 1) ? (byte >> 4) : (byte & 15);
        d += static_cast<float>(code) * x.xh[b * K + kk];
      }
      v += d * half_to_float(srow[G - 1]);
    }
    const float* xs = xsum + b * G;  // bias term: sum_g bias_g * xsum[b, g]
    int64_t g = 0;
    F bacc = simd::zero();
    for (; g + kW <= G; g += kW) bacc = simd::fma(simd::load_f16(zrow + g), simd::load(xs + g), bacc);
    v += simd::hsum(bacc);
    for (; g < G; ++g) v += half_to_float(zrow[g]) * xs[g];
    return v;
  }
};


// ---------------------------------------------------------------------------------------------
// K-quants: ggml's Q4_K, Q5_K and Q6_K blocks read as the GGUF stores them (no repacking). A step
// is one 256-column block. x is rounded to int8 per 32 columns, exactly as for int4 weights
// (round_block, primitives.round_activations_int8), the block's unsigned codes times x are summed
// exactly per group of 16 columns (kq::kq_block_sums: vpmaddubsw + vpmaddwd, vpdpbusd with VNNI,
// sdot on NEON), and each group's sum is scaled once:
//     acc += float(sum_g) * (wscale_g * xstep_g) + wbias_g * xsum_g
// with wscale_g the group's weight scale (d * sub-block scale), xstep_g the x step of its 32
// columns, xsum_g the sum of its rounded x, and wbias_g the offset of its codes: -dmin * min
// (Q4_K, Q5_K; w = d sc q - dmin m) or -32 * wscale_g (Q6_K; w = d sc (q - 32)). The 16 groups'
// factors sit in the lanes of kq::kq_lane (kq_scale8 / kq_scale16). On the AVX2 level
// (RWKV_KQ_AVX2, no VNNI) Q4_K / Q5_K sum per 32-column sub-block instead (kq::kq_sub_sums: the
// width of both their scales and x's steps, so half the float work), and Q6_K as
//     acc += (float(sum_g) * xstep_g + (-32 xsum_g)) * wscale_g
// (prepare_xk stores -32 xsum_g): exact integer sums alike, rounded in another order.

// x [B, K] rounded for the K-quant kernels: int8 in column order, and per block the lanes of its
// groups' x steps and sums.
struct XK {
  std::vector<int8_t> q;   // [B, K]
  std::vector<float> st;   // [B, K / 256, 16] x step of each group's 32 columns, lane order
  std::vector<float> sm;   // [B, K / 256, 16] sum of each group's rounded x, lane order
};

// rows_parallel: the rows on all threads (a call that is the job's only one: prefill).
// On the AVX2 level (kq::kq_sub_sums, RWKV_KQ_AVX2) a block's st / sm of Q4_K / Q5_K are per
// 32-column sub-block instead, in lanes 0-7 (sm: the sum of its 32 rounded x), and sm of Q6_K is
// -32 times the group's sum (exact), so that its code offset folds into one fma.
XK prepare_xk(const void* x, DType xt, int64_t B, int64_t K, const uint16_t* cs, bool rows_parallel, KType kt) {
  const std::vector<float> c = col_scales_f32(cs, K);
  XK r;
  const int64_t nb = K / 256;
  r.q.resize(static_cast<size_t>(B * K));
  r.st.resize(static_cast<size_t>(B * nb * 16));
  r.sm.resize(static_cast<size_t>(B * nb * 16));
  auto row = [&](int64_t b) {
    std::vector<float> xf(static_cast<size_t>(K));
    float xh[32];
    scaled_row(x, xt, b, K, c, xf.data());
    for (int64_t blk = 0; blk < nb; ++blk) {
      float* st = r.st.data() + (b * nb + blk) * 16;
      float* sm = r.sm.data() + (b * nb + blk) * 16;
      for (int h = 0; h < 8; ++h) {  // 32-column x blocks
        const int64_t k = blk * 256 + 32 * h;
        const float dx = round_block(xf.data() + k, 32, 127.f, r.q.data() + b * K + k, xh);
#if defined(RWKV_KQ_AVX2)
        if (kt != KType::kQ6K) {
          float sum = 0.f;
          for (int i = 0; i < 32; ++i) sum += xh[i];
          st[h] = dx, sm[h] = sum;
          continue;
        }
        const float off = -32.f;
#else
        (void)kt;
        const float off = 1.f;
#endif
        for (int j = 0; j < 2; ++j) {  // its two groups
          float sum = 0.f;
          for (int i = 0; i < 16; ++i) sum += xh[16 * j + i];
          st[kq::kq_lane(2 * h + j)] = dx, sm[kq::kq_lane(2 * h + j)] = off * sum;
        }
      }
    }
  };
  if (rows_parallel && B > kMaxB) parallel_for(B, row);
  else for (int64_t b = 0; b < B; ++b) row(b);
  return r;
}

// The 6-bit sub-block scales and mins of Q4_K / Q5_K (12 bytes at blk + 4) as 8 bytes each
// (byte j: sub-block j).
inline void k_scales_mins(const uint8_t* blk, uint64_t& sc, uint64_t& m) {
  uint32_t a, b, c;
  std::memcpy(&a, blk + 4, 4), std::memcpy(&b, blk + 8, 4), std::memcpy(&c, blk + 12, 4);
  // sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: the nibbles of
  // bytes 8-11 with the top 2 bits of bytes 0-3 (scales) or 4-7 (mins) above them
  const uint64_t s03 = a & 0x3F3F3F3Fu, m03 = b & 0x3F3F3F3Fu;
  const uint64_t s47 = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
  const uint64_t m47 = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  sc = s03 | s47 << 32, m = m03 | m47 << 32;
}

inline uint8_t byte_of(uint64_t v, int j) { return static_cast<uint8_t>(v >> (8 * j)); }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// A format: kBytes per block; pieces(blk, w): the kq::kKqPieces pieces of codes in column order;
// factors(blk, ws, wm): the groups' weight scales and code offsets in kq lanes; dequant(blk, out):
// the 256 values as gguf.quants computes them in fp32 (the same operations, so the same bits).
struct Q4KFormat {
  static constexpr KType kType = KType::kQ4K;
  static constexpr int64_t kBytes = 144;  // d, dmin, scales [12], qs [128]
  static constexpr int kMaxCode = 15;
  static inline void pieces(const uint8_t* blk, kq::KP* w) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // 32 bytes: columns 64c + l (low nibbles), 64c + 32 + l (high)
#if defined(RWKV_SIMD_KQ_512)
      w[c] = kq::kq_bits<0>(kq::kq_shift_hi<4>(kq::kq_load_dup(blk + 16 + 32 * c)), 0x0F);
#else
      const kq::KP v = kq::kq_load(blk + 16 + 32 * c);
      w[2 * c] = kq::kq_bits<0>(v, 0x0F), w[2 * c + 1] = kq::kq_bits<-4>(v, 0x0F);
#endif
    }
  }
  static inline void factors(const uint8_t* blk, kq::F* ws, kq::F* wm) {
#if defined(RWKV_SIMD_KQ_512)
    kq::kq_head_k(blk, ws, wm);
#else
    uint64_t sc, m;
    k_scales_mins(blk, sc, m);
    kq::kq_scale8(sc, half_at(blk), ws);
    kq::kq_scale8(m, -half_at(blk + 2), wm);  // -(dmin * m): the product's sign flipped, exactly
#endif
  }
  static void dequant(const uint8_t* blk, float* out) {
    uint64_t sc, m;
    k_scales_mins(blk, sc, m);
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const uint8_t* qs = blk + 16;
    for (int c = 0; c < 4; ++c) {
      const float d0 = d * byte_of(sc, 2 * c), m0 = dmin * byte_of(m, 2 * c);
      const float d1 = d * byte_of(sc, 2 * c + 1), m1 = dmin * byte_of(m, 2 * c + 1);
      for (int l = 0; l < 32; ++l) {
        out[64 * c + l] = d0 * static_cast<float>(qs[32 * c + l] & 15) - m0;
        out[64 * c + 32 + l] = d1 * static_cast<float>(qs[32 * c + l] >> 4) - m1;
      }
    }
  }
};

struct Q5KFormat {
  static constexpr KType kType = KType::kQ5K;
  static constexpr int64_t kBytes = 176;  // d, dmin, scales [12], qh [32], qs [128]
  static constexpr int kMaxCode = 31;
  static inline void pieces(const uint8_t* blk, kq::KP* w) {
    // the fifth bit of column 64c + l (+ 32) is bit 2c (2c + 1) of qh[l]
#if defined(RWKV_SIMD_KQ_512)
    // columns 64c + 32 + l in the high half, where qh is shifted down by one: bit 2c there too
    const kq::KP qh = kq::kq_shift_hi<1>(kq::kq_load_dup(blk + 16));
    const kq::KP h[4] = {kq::kq_bits<4>(qh, 0x10), kq::kq_bits<2>(qh, 0x10), kq::kq_bits<0>(qh, 0x10),
                         kq::kq_bits<-2>(qh, 0x10)};
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      w[c] = kq::kq_or(kq::kq_bits<0>(kq::kq_shift_hi<4>(kq::kq_load_dup(blk + 48 + 32 * c)), 0x0F), h[c]);
#else
    const kq::KP qh = kq::kq_load(blk + 16);
    const kq::KP h[8] = {kq::kq_bits<4>(qh, 0x10), kq::kq_bits<3>(qh, 0x10),  kq::kq_bits<2>(qh, 0x10),
                         kq::kq_bits<1>(qh, 0x10), kq::kq_bits<0>(qh, 0x10),  kq::kq_bits<-1>(qh, 0x10),
                         kq::kq_bits<-2>(qh, 0x10), kq::kq_bits<-3>(qh, 0x10)};
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const kq::KP v = kq::kq_load(blk + 48 + 32 * c);
      w[2 * c] = kq::kq_or(kq::kq_bits<0>(v, 0x0F), h[2 * c]);
      w[2 * c + 1] = kq::kq_or(kq::kq_bits<-4>(v, 0x0F), h[2 * c + 1]);
    }
#endif
  }
  static inline void factors(const uint8_t* blk, kq::F* ws, kq::F* wm) { Q4KFormat::factors(blk, ws, wm); }
  static void dequant(const uint8_t* blk, float* out) {
    uint64_t sc, m;
    k_scales_mins(blk, sc, m);
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const uint8_t *qh = blk + 16, *qs = blk + 48;
    for (int c = 0; c < 4; ++c) {
      const float d0 = d * byte_of(sc, 2 * c), m0 = dmin * byte_of(m, 2 * c);
      const float d1 = d * byte_of(sc, 2 * c + 1), m1 = dmin * byte_of(m, 2 * c + 1);
      for (int l = 0; l < 32; ++l) {
        const int lo = (qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
        const int hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
        out[64 * c + l] = d0 * static_cast<float>(lo) - m0;
        out[64 * c + 32 + l] = d1 * static_cast<float>(hi) - m1;
      }
    }
  }
};

struct Q6KFormat {
  static constexpr KType kType = KType::kQ6K;
  static constexpr int64_t kBytes = 210;  // ql [128], qh [64], scales int8 [16], d
  static inline void pieces(const uint8_t* blk, kq::KP* w) {
    // per 128 columns: low 4 bits from 64 bytes of ql (columns l, 32 + l: low nibbles of bytes
    // l, 32 + l; 64 + l, 96 + l: their high nibbles), the top 2 from 32 bytes of qh (bits 2i,
    // 2i + 1 of qh[l] for column 32i + l)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#if defined(RWKV_SIMD_KQ_512)
      // columns 128h + 0-63: the low nibbles of the 64 ql bytes, 64-127 their high nibbles; qh
      // shifted down by two in the high half (columns + 32, + 96: bits 2-3, 6-7)
      const kq::KP l = kq::kq_load(blk + 64 * h);
      const kq::KP qh = kq::kq_shift_hi<2>(kq::kq_load_dup(blk + 128 + 32 * h));
      w[2 * h] = kq::kq_or(kq::kq_bits<0>(l, 0x0F), kq::kq_bits<4>(qh, 0x30));
      w[2 * h + 1] = kq::kq_or(kq::kq_bits<-4>(l, 0x0F), kq::kq_bits<0>(qh, 0x30));
#else
      const kq::KP l0 = kq::kq_load(blk + 64 * h), l1 = kq::kq_load(blk + 64 * h + 32);
      const kq::KP qh = kq::kq_load(blk + 128 + 32 * h);
      w[4 * h] = kq::kq_or(kq::kq_bits<0>(l0, 0x0F), kq::kq_bits<4>(qh, 0x30));
      w[4 * h + 1] = kq::kq_or(kq::kq_bits<0>(l1, 0x0F), kq::kq_bits<2>(qh, 0x30));
      w[4 * h + 2] = kq::kq_or(kq::kq_bits<-4>(l0, 0x0F), kq::kq_bits<0>(qh, 0x30));
      w[4 * h + 3] = kq::kq_or(kq::kq_bits<-4>(l1, 0x0F), kq::kq_bits<-2>(qh, 0x30));
#endif
    }
  }
  static inline void factors(const uint8_t* blk, kq::F* ws, kq::F* wm) {
    const float d = half_at(blk + 208);
    kq::kq_scale16(reinterpret_cast<const int8_t*>(blk + 192), d, ws);
    for (int v = 0; v < kq::kKqVecs; ++v) wm[v] = kq::mul(ws[v], kq::set1(-32.f));  // exact
  }
  static void dequant(const uint8_t* blk, float* out) {
    const float d = half_at(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
      float* o = out + 128 * h;
      for (int i = 0; i < 4; ++i)  // columns 32i + l: groups 2i (l < 16) and 2i + 1
        for (int l0 = 0; l0 < 32; l0 += 16) {
          const float ds = d * static_cast<float>(sc[8 * h + 2 * i + l0 / 16]);
          for (int l = l0; l < l0 + 16; ++l) {
            const int lo = i % 2 == 0 ? ql[l] : ql[l + 32];
            const int q = ((i < 2 ? lo & 15 : lo >> 4) | (((qh[l] >> (2 * i)) & 3) << 4)) - 32;
            o[32 * i + l] = ds * static_cast<float>(q);
          }
        }
    }
  }
};

// The accumulator of one (weight row, row of x): a vector per lane vector of the group sums, so
// that a block's multiply-adds form kKqVecs chains instead of one (on the AVX2 level one vector:
// 8 rows of x already make 8 chains, and 16 accumulators would not leave registers for the codes).
template <int V>
struct KAcc {
  kq::F v[V];
};

// At batch 1 a K-quant row is prefetched while the row at least this many bytes before it is read:
// one row ahead (1152-1680 bytes at K = 2048) was too close to hide the memory's latency, and rows
// at K = 2048 streamed 1.10-1.15x faster two rows ahead (forced AVX2 build, 2 threads, Xeon family
// 6 model 167; 4 KB ahead about the same, 8 KB slower on the long rows; docs/performance.md).
constexpr int64_t kKqAheadBytes = 2048;

template <typename Fmt>
struct KQuantKernel {
  static constexpr int64_t kStepBytes = 256 + 2 * 16 * 4;  // prepared x per block and row of x
  // One weight row at a time (decoding a block's codes and factors is shared by the rows of x).
  template <int B> static constexpr int kRows = 1;
  template <int B> static constexpr int kXRows = B;
#if defined(RWKV_KQ_AVX2)
  // Q4_K / Q5_K: one vector of 8 sub-blocks (kq::kq_sub_sums); Q6_K: its two vectors of groups
  // added into one (half the accumulators: they fit the registers better)
  static constexpr bool kSub = Fmt::kType != KType::kQ6K;
  static constexpr int kAccVecs = 1;
#else
  static constexpr int kAccVecs = kq::kKqVecs;
#endif
  using Acc = KAcc<kAccVecs>;
  static float hsum(const Acc& a) {
    kq::F s = a.v[0];
    for (int v = 1; v < kAccVecs; ++v) s = kq::add(s, a.v[v]);
    return kq::hsum(s);
  }

  const uint8_t* W;
  int64_t K;
  const XK* x;
  int64_t b0;  // the pass's first row of x

  int64_t steps() const { return K / 256; }
  int64_t row_bytes() const { return K / 256 * Fmt::kBytes; }
  // Rows of any length: K-quant rows over kPrefetchMaxRow (Q5_K / Q6_K at K = 7168, Q4_K at 8192)
  // streamed about 1.75x slower without (bench_kernels.py, avx512_bf16 and avx2 builds on a Xeon).
  bool prefetch_alone() const { return true; }

  template <int R, int Bt>
  inline void tile(int64_t n, int b, int64_t s0, int64_t s1, Acc* acc, int stride, bool pf) const {
    constexpr int V = kq::kKqVecs;
    const int64_t rb = row_bytes(), nb = K / 256;
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = W + (n + r) * rb;
    const int8_t* xq[Bt];
    const float *st[Bt], *sm[Bt];
    for (int i = 0; i < Bt; ++i) {
      const int64_t row = b0 + b + i;
      xq[i] = x->q.data() + row * K, st[i] = x->st.data() + row * nb * 16, sm[i] = x->sm.data() + row * nb * 16;
    }
    Acc fa[R][Bt];
    load_block(fa, acc, stride);
    // rows are contiguous; at batch 1 the rows at least kKqAheadBytes on (see there)
    const int64_t ahead = Bt > 1 ? kAheadBlocks : std::max<int64_t>(1, (kKqAheadBytes + R * rb - 1) / (R * rb));
    const uint8_t* next = rows[0] + ahead * R * rb;
    for (int64_t c = s0; c < s1; ++c) {
      if (pf) prefetch_next<(Bt > 1)>(next, c * R * Fmt::kBytes, R * Fmt::kBytes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = rows[r] + c * Fmt::kBytes;
        kq::KP w[kq::kKqPieces];
        Fmt::pieces(blk, w);
#if defined(RWKV_KQ_AVX2)
        if constexpr (kSub) {
          // a += float(sum_j) * (ws_j * xstep_j) + wm_j * xsum_j over the 8 sub-blocks j
          uint64_t sc, m;
          k_scales_mins(blk, sc, m);
          const kq::F ws = kq::kq_sub_scale8(sc, half_at(blk)), wm = kq::kq_sub_scale8(m, -half_at(blk + 2));
#pragma GCC unroll 8
          for (int i = 0; i < Bt; ++i) {
            const kq::I32 sums = kq::kq_sub_sums<Fmt::kMaxCode>(w, xq[i] + 256 * c);
            kq::F& a = fa[r][i].v[0];
            a = kq::fma(kq::to_float(sums), kq::mul(ws, kq::load(st[i] + 16 * c)), a);
            a = kq::fma(wm, kq::load(sm[i] + 16 * c), a);
          }
        } else {
          // Q6_K: a += (float(sum_g) * xstep_g + (-32 xsum_g)) * ws_g, sm holding -32 xsum_g; a
          // half block (vector v of groups) at a time for every row of x, so that four codes
          // vectors are live instead of eight (the 16 registers of AVX2 held 8 codes and 8 sums)
          kq::F ws[V], wm[V];
          Fmt::factors(blk, ws, wm);
#pragma GCC unroll 2
          for (int v = 0; v < V; ++v) {
#pragma GCC unroll 8
            for (int i = 0; i < Bt; ++i) {
              const kq::I32 sums = kq::kq_half_sums16(w + 4 * v, xq[i] + 256 * c + 128 * v);
              kq::F& a = fa[r][i].v[0];
              const kq::F t = kq::fma(kq::to_float(sums), kq::load(st[i] + 16 * c + kq::kW * v),
                                      kq::load(sm[i] + 16 * c + kq::kW * v));
              a = kq::fma(t, ws[v], a);
            }
          }
        }
#else
        kq::F ws[V], wm[V];
        Fmt::factors(blk, ws, wm);
#pragma GCC unroll 8
        for (int i = 0; i < Bt; ++i) {
          kq::I32 sums[V];
          kq::kq_block_sums(w, xq[i] + 256 * c, sums);
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v) {
            kq::F& a = fa[r][i].v[v];
            a = kq::fma(kq::to_float(sums[v]), kq::mul(ws[v], kq::load(st[i] + 16 * c + kq::kW * v)), a);
            a = kq::fma(wm[v], kq::load(sm[i] + 16 * c + kq::kW * v), a);
          }
        }
#endif
      }
    }
    store_block(fa, acc, stride);
  }

  float finish(int64_t, int, float v) const { return v; }
};

// fn.template operator()<Fmt>() for the format of K-quant type t.
template <typename F>
void with_ktype(KType t, const F& fn) {
  switch (t) {
    case KType::kQ4K: fn.template operator()<Q4KFormat>(); break;
    case KType::kQ5K: fn.template operator()<Q5KFormat>(); break;
    default: fn.template operator()<Q6KFormat>(); break;
  }
}

// ---------------------------------------------------------------------------------------------
// Passes of up to kMaxB rows of x over each weight.

// fn.template operator()<Bc>() for a pass of Bc (1..kMaxB) rows of x.
template <typename F>
void with_batch(int64_t Bc, const F& fn) {
  switch (Bc) {
    case 1: fn.template operator()<1>(); break;
    case 2: fn.template operator()<2>(); break;
    case 3: fn.template operator()<3>(); break;
    case 4: fn.template operator()<4>(); break;
    case 5: fn.template operator()<5>(); break;
    case 6: fn.template operator()<6>(); break;
    case 7: fn.template operator()<7>(); break;
    default: fn.template operator()<8>(); break;
  }
}

// 32-bit words of one pass's packed x on AMX tiles (amx::pack_x, up to kMaxB rows).
constexpr int64_t amx_words(int64_t K) { return K / 32 * 16 * kMaxB; }

// A GEMV with its x prepared for the weight format.
struct Prepared {
  const GemvCall* call;
  std::vector<uint16_t> xb; // dense bf16 weights on DenseBF16DotKernel (bf16_dot): x as bf16
  std::vector<uint32_t> xt; // and on AMX tiles (use_amx): each pass's x as amx::pack_x lays it out
  std::vector<float> xp;    // dense: fp32 x, permuted
  XQ xq;                    // int8 / int4: x rounded (int16 per 64 columns / int8 per 32)
  XK xk;                    // K-quants: x rounded (int8 per 32 columns)
  std::vector<float> xsum;  // int4: sum of the rounded x over each group (the bias term)
};

// rows_parallel: see prepare_xk.
Prepared prepare(const GemvCall& c, int64_t B, bool rows_parallel) {
  const Linear& l = *c.l;
  Prepared p{&c, {}, {}, {}, {}, {}, {}};
  switch (l.kind) {
    case Linear::Kind::kDense:
      if (bf16_dot(c)) {
        p.xb = prepare_xb(c.x, c.xt, B, l.K);
        if (amx::available() && B >= amx::kMinRows) {
          const int64_t Kx = padded_stride(l.K, 32), words = amx_words(l.K);
          p.xt.resize(static_cast<size_t>((B + kMaxB - 1) / kMaxB * words));
          for (int64_t b0 = 0; b0 < B; b0 += kMaxB)
            amx::pack_x(p.xb.data() + b0 * Kx, Kx, static_cast<int>(std::min<int64_t>(kMaxB, B - b0)), l.K,
                        p.xt.data() + b0 / kMaxB * words);
        }
      }
      else p.xp = prepare_x(c.x, c.xt, B, l.K, l.wt == DType::kBF16);
      break;
    case Linear::Kind::kQ8: p.xq = prepare_xq(c.x, c.xt, B, l.K, false, l.cs); break;
    case Linear::Kind::kKQuant: p.xk = prepare_xk(c.x, c.xt, B, l.K, l.cs, rows_parallel, l.kt); break;
    default: {
      p.xq = prepare_xq(c.x, c.xt, B, l.K, true, l.cs);
      // xsum[b, g] = sum of the rounded x[b] over the columns of group g, so that the result
      // is exactly x_rounded . (code * scale + bias).
      const int64_t G = l.G, gs = l.K / G;
      p.xsum.resize(static_cast<size_t>(B * G));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < G; ++g) {
          const float* s = p.xq.xh.data() + b * l.K + g * gs;
          F acc = simd::zero();
          for (int64_t k = 0; k < gs; k += kW) acc = simd::add(acc, simd::load(s + k));
          p.xsum[b * G + g] = simd::hsum(acc);
        }
    }
  }
  return p;
}

// Whether the pass of Bc rows of x runs on AMX tiles: bf16 weights times bf16 x, AMX available
// (amx.h: from amx::kMinRows rows of x, so a row's bits then differ from its bits alone).
bool use_amx(const Prepared& p, int64_t Bc) { return !p.xt.empty() && Bc >= amx::kMinRows; }

// The row block of a pass of Bc rows of x (work items are cut at multiples of it).
int64_t block_rows(const Prepared& p, int64_t Bc) {
  if (use_amx(p, Bc)) return 16;  // a tile's rows
  int64_t R = 1;
  with_batch(Bc, [&]<int B>() {
    const Linear::Kind kind = p.call->l->kind;
    R = kind == Linear::Kind::kKQuant ? KQuantKernel<Q4KFormat>::kRows<B>
        : kind != Linear::Kind::kDense ? kIntRows<B>
                                       : DenseKernel<DenseF32>::kRows<B>;
#if defined(RWKV_SIMD_BF16_DOT)
    if (bf16_dot(*p.call)) R = DenseBF16DotKernel::kRows<B>;
#endif
  });
  return R;
}

// Rows [r0, r1) of the pass of x rows b0.. of a prepared GEMV.
void run_part(const Prepared& p, int64_t B, int64_t b0, int64_t r0, int64_t r1) {
  const Linear& l = *p.call->l;
  const int64_t N = l.N, K = l.K, G = l.G;
  const Out y = Out{p.call->y, p.call->xt}.offset(b0 * N);
  with_batch(std::min<int64_t>(kMaxB, B - b0), [&]<int Bc>() {
    switch (l.kind) {
      case Linear::Kind::kDense: {
#if defined(RWKV_SIMD_BF16_DOT)
        if (use_amx(p, Bc)) {
          const int64_t Kx = padded_stride(K, 32), rows = r1 - r0;
          std::vector<float> yf(static_cast<size_t>(Bc * rows));
          amx::gemm_bf16(static_cast<const uint16_t*>(l.w), K, p.xt.data() + b0 / kMaxB * amx_words(K),
                         p.xb.data() + b0 * Kx, Kx, Bc, r0, r1, yf.data(), rows);
          for (int b = 0; b < Bc; ++b)
            for (int64_t n = r0; n < r1; ++n) y.put(b * N + n, yf[b * rows + n - r0]);
          break;
        }
        if (bf16_dot(*p.call)) {
          const DenseBF16DotKernel kern{static_cast<const uint16_t*>(l.w), K, p.xb.data() + b0 * padded_stride(K, 32)};
          run_tiled<Bc>(kern, r0, r1, N, y);
          break;
        }
#endif
        auto dense = [&]<typename D>(const D*) {
          const DenseKernel<D> kern{static_cast<const typename D::T*>(l.w), K, p.xp.data() + b0 * padded_stride(K, 16)};
          run_tiled<Bc>(kern, r0, r1, N, y);
        };
        if (l.wt == DType::kF32) dense(static_cast<const DenseF32*>(nullptr));
        else if (l.wt == DType::kBF16) dense(static_cast<const DenseBF16*>(nullptr));
        else dense(static_cast<const DenseF16*>(nullptr));
        break;
      }
      case Linear::Kind::kQ8:
        if (G > 1 && K / G == 32)  // group size 32: two groups per chunk
          run_tiled<Bc>(IntKernel<Q8Format<true>>{{l.q8, l.s8, K, G}, view(p.xq, b0, K)}, r0, r1, N, y);
        else
          run_tiled<Bc>(IntKernel<Q8Format<false>>{{l.q8, l.s8, K, G}, view(p.xq, b0, K)}, r0, r1, N, y);
        break;
      case Linear::Kind::kKQuant:
        with_ktype(l.kt, [&]<typename Fmt>() { run_tiled<Bc>(KQuantKernel<Fmt>{l.kq, K, &p.xk, b0}, r0, r1, N, y); });
        break;
      default:
        run_tiled<Bc>(IntKernel<Q4Format>{Q4Format{l.q4, l.s4, l.z4, K, G, p.xsum.data() + b0 * G}, view(p.xq, b0, K)}, r0,
                      r1, N, y);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// K-quant prefill on the AVX2 level (more than kKqGemvMaxRows rows of x): llama.cpp's arithmetic,
// with x rounded to int8 per 256 columns (one step per block and row of x, as ggml's Q8_K) so that
// a block's sums stay in the integers to its end: per 32-column piece one vpmaddubsw (x + 128 as
// the unsigned operand, the codes as the signed one: Q6_K's less 32) and one vpmaddwd by the
// scales of its groups, added in int32, with no transposes; the +128 comes off as one integer per
// weight row and block, and Q4_K / Q5_K's mins as sum_j min_j * (sum of x over sub-block j).
// The codes of kKTileRows weight rows are unpacked once per block into a tile that stays in L1
// while a chunk of kKTileChunk rows of x passes over it (the per-32 kernel above decodes a block
// once per 8 rows of x and spends most of its time transposing sums). Exact integer sums; each
// block adds step * (d * sum - dmin * mins) to the fp32 result. Limited to AVX2, 2 threads, 512
// rows, G multiply-adds a second against the per-32 kernel: Zen 5 Q6_K 185-205 against 137-157;
// Xeon (family 6 model 167) Q6_K 92-106 against 78-86, Q5_K 91-106 against 83-86, Q4_K level
// (docs/performance.md). Decode batches (at most kKqGemvMaxRows rows) keep the per-32 kernel.
constexpr int64_t kKqGemvMaxRows = 16;  // kernels/native/__init__.py GEMV_MAX_ROWS

#if defined(RWKV_KQ_AVX2)
constexpr int kKTileRows = 16;       // weight rows of a tile
constexpr int64_t kKTileChunk = 64;  // rows of x that pass over a tile (a multiple of 8)

// x [B, K] rounded per 256 columns: q = round(x / step) + 128 (unsigned), rows padded to a multiple
// of 8 with zeros (q = 128, step 0), and the sums of the rounded x per 32-column sub-block. Block-
// major: a block's rows of x lie together (rows K bytes apart fell into a few L1 sets and evicted
// each other), and 8 rows' steps or sums load as one vector.
struct XK256 {
  int64_t Bp;
  std::vector<uint8_t> q;  // [K / 256, Bp, 256]
  std::vector<float> dx;   // [K / 256, Bp]
  std::vector<float> sub;  // [K / 256, 8, Bp] (exact: at most 32 * 127)
};

XK256 prepare_xk256(const void* x, DType xt, int64_t B, int64_t K, const uint16_t* cs) {
  const int64_t nb = K / 256;
  XK256 r;
  r.Bp = (B + 7) / 8 * 8;
  r.q.assign(static_cast<size_t>(nb * r.Bp * 256), 128);
  r.dx.assign(static_cast<size_t>(nb * r.Bp), 0.f);
  r.sub.assign(static_cast<size_t>(nb * 8 * r.Bp), 0.f);
  const std::vector<float> c = col_scales_f32(cs, K);
  parallel_for(B, [&](int64_t b) {
    std::vector<float> xf(static_cast<size_t>(K));
    int8_t q[256];
    float xh[256];
    scaled_row(x, xt, b, K, c, xf.data());
    for (int64_t blk = 0; blk < nb; ++blk) {
      r.dx[blk * r.Bp + b] = round_block(xf.data() + blk * 256, 256, 127.f, q, xh);
      uint8_t* o = r.q.data() + (blk * r.Bp + b) * 256;
      for (int i = 0; i < 256; ++i) o[i] = static_cast<uint8_t>(q[i] + 128);
      for (int j = 0; j < 8; ++j) {
        int s = 0;
        for (int i = 0; i < 32; ++i) s += q[32 * j + i];
        r.sub[(blk * 8 + j) * r.Bp + b] = static_cast<float>(s);
      }
    }
  });
  return r;
}

// One 256-column block of kKTileRows weight rows: the codes (signed: Q6_K's less 32), each
// piece's scale lanes (Q6_K: group 2p in the low 128 bits, 2p + 1 in the high; Q4_K / Q5_K: the
// piece's sub-block in all), d, dmin and the mins (Q4_K / Q5_K), and 128 * sum_g scale_g *
// sum(codes of group g).
struct KTile {
  alignas(32) int8_t w[kKTileRows][256];
  alignas(32) int16_t s[kKTileRows][8][16];
  float d[kKTileRows], dmin[kKTileRows], m[kKTileRows][8];
  int32_t bias[kKTileRows];
};

template <typename Fmt>
void unpack_tile(const uint8_t* W, int64_t rb, int64_t n0, int rows, int64_t blk, KTile& t) {
  constexpr bool kQ6 = Fmt::kType == KType::kQ6K;
  const __m256i ones = _mm256_set1_epi8(1);
  for (int r = 0; r < kKTileRows; ++r) {
    if (r >= rows) {  // past the last weight row: zeros, never stored
      std::memset(t.w[r], 0, 256), std::memset(t.s[r], 0, sizeof t.s[r]), std::memset(t.m[r], 0, sizeof t.m[r]);
      t.d[r] = t.dmin[r] = 0.f, t.bias[r] = 0;
      continue;
    }
    const uint8_t* b = W + (n0 + r) * rb + blk * Fmt::kBytes;
    kq::KP codes[8];
    Fmt::pieces(b, codes);
    int16_t sc[16];
    if constexpr (kQ6) {
      for (int g = 0; g < 16; ++g) sc[g] = reinterpret_cast<const int8_t*>(b + 192)[g];
      t.d[r] = half_at(b + 208), t.dmin[r] = 0.f;
    } else {
      uint64_t s8, m8;
      k_scales_mins(b, s8, m8);
      for (int j = 0; j < 8; ++j) sc[2 * j] = sc[2 * j + 1] = byte_of(s8, j), t.m[r][j] = byte_of(m8, j);
      t.d[r] = half_at(b), t.dmin[r] = half_at(b + 2);
    }
    __m256i bias = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
      const __m256i w = kQ6 ? _mm256_sub_epi8(codes[p], _mm256_set1_epi8(32)) : codes[p];
      _mm256_store_si256(reinterpret_cast<__m256i*>(t.w[r] + 32 * p), w);
      const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * p + 1]), _mm_set1_epi16(sc[2 * p]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(t.s[r][p]), s);
      bias = _mm256_add_epi32(bias, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, w), s));
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), bias);
    int32_t sum = 0;
    for (int i = 0; i < 8; ++i) sum += lanes[i];
    t.bias[r] = 128 * sum;
  }
}

// lane i of the result: the sum of the 8 lanes of a[i].
inline __m256i sum_lanes8(const __m256i* a) {
  auto pair = [](__m256i u, __m256i v) { return _mm256_add_epi32(_mm256_unpacklo_epi32(u, v), _mm256_unpackhi_epi32(u, v)); };
  auto quad = [](__m256i u, __m256i v) { return _mm256_add_epi32(_mm256_unpacklo_epi64(u, v), _mm256_unpackhi_epi64(u, v)); };
  const __m256i lo = quad(pair(a[0], a[1]), pair(a[2], a[3])), hi = quad(pair(a[4], a[5]), pair(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

// Rows [t0, t0 + tc) of x (tc a multiple of 8) times the weight rows of tile t, block blk, added
// to acc [kKTileRows][kKTileChunk].
template <bool kMins>
inline void tile_rows(const KTile& t, int rows, const XK256& x, int64_t blk, int64_t t0, int64_t tc, float* acc) {
  for (int r = 0; r < rows; ++r) {
    const __m256 d = _mm256_set1_ps(t.d[r]);
    const __m256i bias = _mm256_set1_epi32(t.bias[r]);
    for (int64_t i0 = 0; i0 < tc; i0 += 8) {
      const uint8_t* xq = x.q.data() + (blk * x.Bp + t0 + i0) * 256;
      __m256i s[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) s[i] = _mm256_setzero_si256();
      // a piece at a time (its codes and scales live, 8 sums: 11 of the 16 registers; unrolled,
      // the compiler hoisted every piece's codes and spilled: 1.3x slower)
#pragma GCC unroll 1
      for (int p = 0; p < 8; ++p) {
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.w[r] + 32 * p));
        const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.s[r][p]));
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * 256 + 32 * p));
          s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w), sc));
        }
      }
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum_lanes8(s), bias)), d);
      if constexpr (kMins) {  // less dmin * sum_j m_j * (sum of x over sub-block j), exact before dmin
        __m256 mins = _mm256_setzero_ps();
        for (int j = 0; j < 8; ++j)
          mins = _mm256_fmadd_ps(_mm256_set1_ps(t.m[r][j]), _mm256_loadu_ps(x.sub.data() + (blk * 8 + j) * x.Bp + t0 + i0), mins);
        v = _mm256_fnmadd_ps(_mm256_set1_ps(t.dmin[r]), mins, v);
      }
      float* a = acc + r * kKTileChunk + i0;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(v, _mm256_loadu_ps(x.dx.data() + blk * x.Bp + t0 + i0), _mm256_loadu_ps(a)));
    }
  }
}

template <typename Fmt>
void gemv_kq_prefill(const uint8_t* W, const uint16_t* cs, int64_t N, int64_t K, const void* x, DType xt, int64_t B,
                     void* y) {
  const XK256 xk = prepare_xk256(x, xt, B, K, cs);
  const Out out{y, xt};
  const int64_t rb = K / 256 * Fmt::kBytes, nb = K / 256, tiles = (N + kKTileRows - 1) / kKTileRows;
  parallel_for(tiles, [&](int64_t ti) {
    const int64_t n0 = ti * kKTileRows;
    const int rows = static_cast<int>(std::min<int64_t>(kKTileRows, N - n0));
    KTile tile;
    alignas(32) float acc[kKTileRows * kKTileChunk];
    for (int64_t t0 = 0; t0 < xk.Bp; t0 += kKTileChunk) {
      const int64_t tc = std::min(kKTileChunk, xk.Bp - t0);
      std::fill(acc, acc + kKTileRows * kKTileChunk, 0.f);
      for (int64_t blk = 0; blk < nb; ++blk) {
        unpack_tile<Fmt>(W, rb, n0, rows, blk, tile);
        tile_rows<Fmt::kType != KType::kQ6K>(tile, rows, xk, blk, t0, tc, acc);
      }
      for (int64_t i = 0; i < tc && t0 + i < B; ++i) {  // row i of x: the tile's outputs lie together
        float v[kKTileRows];
        for (int r = 0; r < rows; ++r) v[r] = acc[r * kKTileChunk + i];
        const int64_t o = (t0 + i) * N + n0;
        if (xt == DType::kF32) std::memcpy(static_cast<float*>(y) + o, v, sizeof(float) * rows);
        else for (int r = 0; r < rows; ++r) out.put(o + r, v[r]);
      }
    }
  });
}
#endif

}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points (see kernels.h).

void gemv_many(const GemvCall* calls, int n, int64_t B) {
  const int T = omp_get_max_threads();
  int64_t weights = 0;
  for (int i = 0; i < n; ++i) weights += calls[i].l->N * calls[i].l->K;
  const bool parallel = weights >= kMinParallel && T > 1;
  // Each GEMV's x on its own work item: at batch 8 the x preparations of a decode step are a
  // few ms (int8 / int4: quantizing x), and the GEMVs of one gemv_many take x of the same size.
  std::vector<Prepared> prep(n);
  auto prepare_one = [&](int64_t i) { prep[i] = prepare(calls[i], B, n == 1 && parallel); };
  if (parallel) parallel_for(n, prepare_one);
  else for (int i = 0; i < n; ++i) prepare_one(i);
  // Work items: (call, rows [r0, r1)), taken in this order. An item is at most
  // blocks_per_item, and towards the end of the job ever smaller (guided: about 1 / (2T) of
  // the weights left, down to kMinItem weights), so that the threads finish together instead of
  // one waiting for the other's last item (docs/performance.md, where a decode step's time goes).
  // With more than kMaxB rows of x (several passes), an item runs every pass over its rows, so
  // that they are read from memory once and stay in cache while the passes go by (rows of a
  // K-quant prefill, batches of 9-16 rows); its rows are a multiple of every pass's row block.
  struct Item {
    int call;
    int64_t r0, r1;
  };
  const int64_t passes = (B + kMaxB - 1) / kMaxB;
  int64_t left = 0;  // weights of the job not yet in an item, times the passes that read them
  for (int i = 0; i < n; ++i) left += passes * calls[i].l->N * calls[i].l->K;
  std::vector<Item> items;
  for (int i = 0; i < n; ++i) {
    const Linear& l = *calls[i].l;
    int64_t R = 1;
    for (int64_t b0 = 0; b0 < B; b0 += kMaxB) R = std::lcm(R, block_rows(prep[i], std::min<int64_t>(kMaxB, B - b0)));
    const int64_t nblocks = (l.N + R - 1) / R;
    const int64_t step = blocks_per_item(nblocks, l.N * l.K, T), block = passes * R * l.K;
    for (int64_t k = 0; k < nblocks;) {
      const int64_t guided = std::max(left / (2 * T), kMinItem) / block;
      const int64_t take = std::min(nblocks - k, std::clamp<int64_t>(guided, 1, step));
      items.push_back({i, k * R, std::min(l.N, (k + take) * R)});
      left -= take * block;
      k += take;
    }
  }
  auto run_item = [&](int64_t j) {
    const Item& it = items[j];
    for (int64_t b0 = 0; b0 < B; b0 += kMaxB) run_part(prep[it.call], B, b0, it.r0, it.r1);
  };
  if (!parallel) {
    for (size_t j = 0; j < items.size(); ++j) run_item(static_cast<int64_t>(j));
    return;
  }
  parallel_for(static_cast<int64_t>(items.size()), run_item);
}

void gemv_dense(const void* w, DType wt, int64_t N, int64_t K, const void* x, DType xt, int64_t B, void* y) {
  Linear l;
  l.kind = Linear::Kind::kDense, l.N = N, l.K = K, l.w = w, l.wt = wt;
  const GemvCall c{&l, x, y, xt};
  gemv_many(&c, 1, B);
}

void gemv_q8(const int8_t* q, const uint16_t* s, const uint16_t* cs, int64_t N, int64_t K, int64_t G, const void* x,
             DType xt, int64_t B, void* y) {
  Linear l;
  l.kind = Linear::Kind::kQ8, l.N = N, l.K = K, l.G = G, l.q8 = q, l.s8 = s, l.cs = cs;
  const GemvCall c{&l, x, y, xt};
  gemv_many(&c, 1, B);
}

void gemv_q4(const uint8_t* q, const uint16_t* s, const uint16_t* z, const uint16_t* cs, int64_t N, int64_t K,
             int64_t G, const void* x, DType xt, int64_t B, void* y) {
  Linear l;
  l.kind = Linear::Kind::kQ4, l.N = N, l.K = K, l.G = G, l.q4 = q, l.s4 = s, l.z4 = z, l.cs = cs;
  const GemvCall c{&l, x, y, xt};
  gemv_many(&c, 1, B);
}

int kq_x_group(KType t, int64_t B) {
  (void)t;
#if defined(RWKV_KQ_AVX2)
  if (B > kKqGemvMaxRows) return 256;
#else
  (void)B;
#endif
  return 32;
}

void gemv_kq(KType t, const uint8_t* blocks, const uint16_t* cs, int64_t N, int64_t K, const void* x, DType xt,
             int64_t B, void* y) {
#if defined(RWKV_KQ_AVX2)
  if (kq_x_group(t, B) == 256) {
    with_ktype(t, [&]<typename Fmt>() { gemv_kq_prefill<Fmt>(blocks, cs, N, K, x, xt, B, y); });
    return;
  }
#endif
  Linear l;
  l.kind = Linear::Kind::kKQuant, l.N = N, l.K = K, l.kq = blocks, l.kt = t, l.cs = cs;
  const GemvCall c{&l, x, y, xt};
  gemv_many(&c, 1, B);
}

// Dequantization for prefill: the tile is then multiplied by the GEMM.

namespace {

// n floats -> out (dtype ot) at element offset off; bf16 rounds to nearest even, like torch.
void store_row(const float* src, int64_t n, void* out, DType ot, int64_t off) {
  if (ot == DType::kF32) {
    std::memcpy(static_cast<float*>(out) + off, src, static_cast<size_t>(n) * 4);
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(out) + off;
  if (ot == DType::kBF16)
    for (int64_t k = 0; k < n; ++k) d[k] = float_to_bf16(src[k]);
  else
    for (int64_t k = 0; k < n; ++k) d[k] = float_to_half(src[k]);
}

}  // namespace

void dequant_q8(const int8_t* q, const uint16_t* s, int64_t K, int64_t G, int64_t r0, int64_t r1, void* out, DType ot) {
  const int64_t gs = K / G;  // a multiple of 32, or K (per channel: any K)
  for_rows(r1 - r0, K, 1, [&](int64_t a, int64_t b) {
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t i = a; i < b; ++i) {
      const int64_t n = r0 + i;
      const int8_t* qr = q + n * K;
      // 32 columns at a time in a fixed loop, which the compiler vectorizes (see dequant_q4)
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        const float sc = half_to_float(s[n * G + k / gs]);
        for (int j = 0; j < 32; ++j) row[k + j] = static_cast<float>(qr[k + j]) * sc;
      }
      for (; k < K; ++k) row[k] = static_cast<float>(qr[k]) * half_to_float(s[n * G + k / gs]);
      store_row(row.data(), K, out, ot, i * K);
    }
  });
}

void dequant_q4(const uint8_t* q, const uint16_t* s, const uint16_t* z, int64_t K, int64_t G, int64_t r0, int64_t r1,
                void* out, DType ot) {
  const int64_t gs = K / G;  // 32, 64 or 128
  for_rows(r1 - r0, K, 1, [&](int64_t a, int64_t b) {
    std::vector<float> row(static_cast<size_t>(K));
    // 32 columns at a time, the even ones (low nibbles) and the odd ones (high nibbles) apart: fixed
    // loops over 16 bytes that the compiler vectorizes (the interleaved loop over a group stayed
    // scalar).
    float lo[16], hi[16];
    for (int64_t i = a; i < b; ++i) {
      const int64_t n = r0 + i;
      for (int64_t k = 0; k < K; k += 32) {
        const int64_t g = k / gs;
        // code * scale is exact in fp32 (4 bits times 11), so the sum rounds once, as torch's
        const float sc = half_to_float(s[n * G + g]), zz = half_to_float(z[n * G + g]);
        const uint8_t* qr = q + n * (K / 2) + k / 2;
        for (int j = 0; j < 16; ++j) {
          lo[j] = static_cast<float>(qr[j] & 15) * sc + zz;
          hi[j] = static_cast<float>(qr[j] >> 4) * sc + zz;
        }
        if (ot == DType::kBF16) {  // columns 2j, 2j + 1 as one 32-bit word
          uint32_t* o = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(out) + i * K + k);
          for (int j = 0; j < 16; ++j)
            o[j] = static_cast<uint32_t>(float_to_bf16(lo[j])) | static_cast<uint32_t>(float_to_bf16(hi[j])) << 16;
        } else {
          for (int j = 0; j < 16; ++j) row[k + 2 * j] = lo[j], row[k + 2 * j + 1] = hi[j];
        }
      }
      if (ot != DType::kBF16) store_row(row.data(), K, out, ot, i * K);
    }
  });
}

void dequant_kq(KType t, const uint8_t* blocks, int64_t K, int64_t r0, int64_t r1, void* out, DType ot) {
  with_ktype(t, [&]<typename Fmt>() {
    const int64_t rb = K / 256 * Fmt::kBytes;
    for_rows(r1 - r0, K, 1, [&](int64_t a, int64_t b) {
      std::vector<float> row(static_cast<size_t>(K));
      for (int64_t i = a; i < b; ++i) {
        const uint8_t* src = blocks + (r0 + i) * rb;
        for (int64_t k = 0; k < K; k += 256) Fmt::dequant(src + k / 256 * Fmt::kBytes, row.data() + k);
        store_row(row.data(), K, out, ot, i * K);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
// int4 quantization (asymmetric, with the range search of primitives.quantize_int4): the same
// fp32 steps in the same order, so the bytes equal the reference's (the error sums are fp64 in
// both; only their summation order differs, which could flip an exact tie at 1e-16).

namespace {
// t rounded to the nearest int4 code (ties to even), clamped to [0, 15].
inline float code_of(float t) { return std::min(std::max(std::nearbyint(t), 0.f), 15.f); }
}  // namespace

void quantize_q4(const void* w, DType wt, const uint16_t* cs, int64_t N, int64_t K, int64_t gs, const float* shrinks,
                 int nshrink, uint8_t* q, uint16_t* s, uint16_t* z) {
  const std::vector<float> c = col_scales_f32(cs, K);
  const int64_t G = K / gs;
  for_rows(N, K * 8 * nshrink, 1, [&](int64_t a, int64_t b) {
    std::vector<float> row(static_cast<size_t>(K));
    float codes[128];
    for (int64_t n = a; n < b; ++n) {
      to_float(w, wt, n * K, K, row.data());
      if (cs != nullptr)
        for (int64_t k = 0; k < K; ++k) row[k] /= c[k];
      for (int64_t g = 0; g < G; ++g) {
        const float* x = row.data() + g * gs;
        float lo = x[0], hi = x[0];
        for (int64_t k = 1; k < gs; ++k) {
          lo = std::min(lo, x[k]);
          hi = std::max(hi, x[k]);
        }
        const float mid = 0.5f * (lo + hi);
        double best = 0.0;
        uint16_t bs = 0, bz = 0;
        for (int i = 0; i < nshrink; ++i) {
          const float lo_s = mid + (lo - mid) * shrinks[i];
          const float hi_s = mid + (hi - mid) * shrinks[i];
          const uint16_t s16 = float_to_half((hi_s - lo_s) / 15.f), z16 = float_to_half(lo_s);
          if (nshrink == 1) {
            bs = s16, bz = z16;
            break;
          }
          const float sf = half_to_float(s16), zf = half_to_float(z16);
          const float inv = sf != 0.f ? 1.f / sf : 0.f;
          double acc[8] = {};  // d*d is exact in fp64; summed in the lanes of the AVX2 version
          for (int64_t k = 0; k < gs; ++k) {
            const float t = (x[k] - zf) * inv;
            const float d = code_of(t) - t;
            acc[k % 8] += static_cast<double>(d) * d;
          }
          const double err = (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) *
                             (static_cast<double>(sf) * sf);
          if (i == 0 || err < best) best = err, bs = s16, bz = z16;
        }
        s[n * G + g] = bs;
        z[n * G + g] = bz;
        const float sf = half_to_float(bs), zf = half_to_float(bz);
        const float inv = sf != 0.f ? 1.f / sf : 0.f;
        for (int64_t k = 0; k < gs; ++k) codes[k] = code_of((x[k] - zf) * inv);
        uint8_t* qr = q + n * (K / 2) + g * gs / 2;
        for (int64_t j = 0; j < gs / 2; ++j)
          qr[j] = static_cast<uint8_t>(static_cast<int>(codes[2 * j]) | (static_cast<int>(codes[2 * j + 1]) << 4));
      }
    }
  });
}

}  // namespace rwkv_native
