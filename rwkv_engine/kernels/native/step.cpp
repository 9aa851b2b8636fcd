// One decode step of a whole RWKV model, one or a few tokens per sequence: see step.h. The
// per-token formulas are those of rwkv_engine/models (docs/formats.md A.2-A.8); the comments name
// the PyTorch line each loop repeats.
//
// The GEMVs split their weight rows over all threads themselves. The rest is a few thousand
// floats per row and layer, but at batch 8 it was a sixth of the step on one thread: it runs
// a sequence per work item (parallel_for; with one sequence, on the calling thread), the
// matrix-state updates a head per item (its tokens in order), and the elementwise passes are
// vectorized.

#include "step.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <vector>

#include "numeric.h"
#include "pool.h"
#include "simd.h"

namespace rwkv_native {
namespace {

using simd::kW;

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGroupNormEps = 64e-5f;
const float kDecayScale7 = std::exp(-0.5f);  // RWKV-7: log w = -e^-0.5 sigmoid(...)

// The value the PyTorch path holds after `.to(dt)`: fp32 rounded to the model dtype.
inline float round_to(DType t, float v) {
  switch (t) {
    case DType::kBF16: return bf16_to_float(float_to_bf16(v));
    case DType::kF16: return half_to_float(float_to_half(v));
    default: return v;
  }
}

void round_all(DType t, float* v, int64_t n) {
  if (t == DType::kBF16)
    for (int64_t i = 0; i < n; ++i) v[i] = round_to(DType::kBF16, v[i]);
  else if (t == DType::kF16)
    for (int64_t i = 0; i < n; ++i) v[i] = round_to(DType::kF16, v[i]);
}

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// out = (x - mean) / sqrt(var + eps) * w + b over n values, as torch (biased variance); out may be x.
// The sums are fp64 in eight lanes, added pairwise at the end (n is a multiple of 8 in every
// model; a rest is summed one by one): the same bits on every ISA level.
double sum8(const double* s) { return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7])); }

void normalize(const float* x, const float* w, const float* b, int64_t n, float eps, float* out) {
  const int64_t n8 = n / 8 * 8;
  double s[8] = {};
  for (int64_t i = 0; i < n8; i += 8)
    for (int l = 0; l < 8; ++l) s[l] += x[i + l];
  double mean = sum8(s);
  for (int64_t i = n8; i < n; ++i) mean += x[i];
  mean /= n;
  double q[8] = {};
  for (int64_t i = 0; i < n8; i += 8)
    for (int l = 0; l < 8; ++l) {
      const double d = x[i + l] - mean;
      q[l] += d * d;
    }
  double var = sum8(q);
  for (int64_t i = n8; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= n;
  const float m = static_cast<float>(mean);
  const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - m) * inv * w[i] + b[i];
}

void layer_norm(const float* x, const float* w, const float* b, int64_t n, float* out) {
  normalize(x, w, b, n, kLayerNormEps, out);
}

// out = prev + (x - prev) * m, rounded to dt (mix(...).to(dt)).
void mix_to(const float* x, const float* prev, const float* m, int64_t n, DType dt, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = prev[i] + (x[i] - prev[i]) * m[i];
  round_all(dt, out, n);
}

// The LoRA products y [B, N] = x [B, K] @ W [K, N] of small matrices (RWKV-6/7, step.h
// LoraMatrix): fp32 math on the stored fp32 / bf16 / fp16 values, on all threads at any batch
// size. The work is cut by a fixed partition of W, the same whatever B and the thread count:
// an item is a tile of kLoraRows rows x kLoraCols columns (for all B rows of x, which share its
// loads from the cache). Each output is an fma chain over its tile's rows in order; the tiles'
// partial sums over K are added in order afterwards. So a row's result does not depend on the
// batch it is in nor on the threads ("batched = alone, bit for bit").
constexpr int64_t kLoraRows = 256;
constexpr int64_t kLoraCols = 1024;
constexpr int64_t kLoraGroup = 32;  // rows per pass over a tile's columns (lora_tile), rows of 1 KB and more

template <DType T>
inline simd::F load_w(const void* w, int64_t i) {
  if constexpr (T == DType::kF32) return simd::load(static_cast<const float*>(w) + i);
  else if constexpr (T == DType::kBF16) return simd::load_bf16(static_cast<const uint16_t*>(w) + i);
  else return simd::load_f16(static_cast<const uint16_t*>(w) + i);
}

template <DType T>
inline float load_w1(const void* w, int64_t i) {
  if constexpr (T == DType::kF32) return static_cast<const float*>(w)[i];
  else if constexpr (T == DType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(w)[i]);
  else return half_to_float(static_cast<const uint16_t*>(w)[i]);
}

// Rows b < Bt of y [.., ldy], columns n .. n + NB kW: y[b, n] = sum over k in [k0, k1) of
// x[b, k] W[k, n], as one fma chain per output in k order: from zero when `first`, else
// continuing the chain from y. Each weight vector is loaded (and converted) once for the Bt rows.
template <DType T, int Bt, int NB>
void lora_block(const void* W, int64_t N, const float* x, int64_t ldx, int64_t k0, int64_t k1, int64_t n, float* y,
                int64_t ldy, bool first) {
  simd::F acc[Bt][NB];
  for (int b = 0; b < Bt; ++b)
    for (int j = 0; j < NB; ++j) acc[b][j] = first ? simd::zero() : simd::load(y + b * ldy + n + kW * j);
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t row = k * N + n;
    simd::F w[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) w[j] = load_w<T>(W, row + kW * j);
#pragma GCC unroll 4
    for (int b = 0; b < Bt; ++b) {
      const simd::F xk = simd::set1(x[b * ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[b][j] = simd::fma(xk, w[j], acc[b][j]);
    }
  }
  for (int b = 0; b < Bt; ++b)
    for (int j = 0; j < NB; ++j) simd::store(y + b * ldy + n + kW * j, acc[b][j]);
}

// Vectors of columns per block for Bt rows of x: accumulators in 16 of the 32 vector registers of
// AVX-512 and NEON, 8 of AVX2's 16; 8 for one row (16 measured slower).
template <int Bt> constexpr int kLoraVecs = Bt == 1 ? 8 : (simd::kW == 8 ? 8 : 16) / Bt;

// lora_block with R whole vectors, for any R < 1 + Rmax (the columns left after the full blocks).
template <DType T, int Bt, int Rmax>
void lora_rest(int64_t R, const void* W, int64_t N, const float* x, int64_t ldx, int64_t k0, int64_t k1, int64_t n,
               float* y, int64_t ldy, bool first) {
  if constexpr (Rmax > 0) {
    if (R == Rmax) return lora_block<T, Bt, Rmax>(W, N, x, ldx, k0, k1, n, y, ldy, first);
    lora_rest<T, Bt, Rmax - 1>(R, W, N, x, ldx, k0, k1, n, y, ldy, first);
  }
}

// Rows b < Bt of y: the columns [n0, n1) in blocks of kLoraVecs<Bt> vectors, the rest of the
// whole vectors in one block (not in halving blocks, each a pass over the rows), the last
// columns (< kW) scalar with std::fma (the same per-lane operation).
template <DType T, int Bt>
void lora_rows(const void* W, int64_t N, const float* x, int64_t ldx, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
               float* y, int64_t ldy, bool first) {
  constexpr int NB = kLoraVecs<Bt>;
  int64_t n = n0;
  for (; n + NB * kW <= n1; n += NB * kW) lora_block<T, Bt, NB>(W, N, x, ldx, k0, k1, n, y, ldy, first);
  lora_rest<T, Bt, NB - 1>((n1 - n) / kW, W, N, x, ldx, k0, k1, n, y, ldy, first);
  n += (n1 - n) / kW * kW;
  for (; n < n1; ++n)
    for (int b = 0; b < Bt; ++b) {
      float a = first ? 0.0f : y[b * ldy + n];
      for (int64_t k = k0; k < k1; ++k) a = std::fma(x[b * ldx + k], load_w1<T>(W, k * N + n), a);
      y[b * ldy + n] = a;
    }
}

// y[b, n] = sum over k in [k0, k1) of x[b, k] W[k, n] for b < B and n in [n0, n1), one fma
// chain per output in k order. The rows go kLoraGroup at a time across all the tile's columns,
// so that the reads are kLoraGroup sequential streams: the D -> C matrices' rows are 4 KB and
// more apart, and a block of columns down all the rows read a new page per row, which the
// hardware prefetchers do not follow; the next group is prefetched into L2. Up to 4 rows of x
// share each weight load (the gains measured: docs/performance.md).
template <DType T>
void lora_tile(const void* W, int64_t N, const float* x, int64_t ldx, int64_t B, int64_t k0, int64_t k1, int64_t n0,
               int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t es = dtype_bytes(T);
  const int64_t group = N * es >= 1024 ? kLoraGroup : k1 - k0;
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const int64_t g1 = std::min(k1, g0 + group);
    const bool first = g0 == k0;
    if (group < k1 - k0)  // the next group's rows, into L2
      for (int64_t k = g1; k < std::min(k1, g1 + group); ++k)
        for (int64_t i = n0 * es; i < n1 * es; i += 64) simd::prefetch_l2(static_cast<const char*>(W) + k * N * es + i);
    int64_t b = 0;
    for (; b + 4 <= B; b += 4) lora_rows<T, 4>(W, N, x + b * ldx, ldx, g0, g1, n0, n1, y + b * ldy, ldy, first);
    for (; b + 2 <= B; b += 2) lora_rows<T, 2>(W, N, x + b * ldx, ldx, g0, g1, n0, n1, y + b * ldy, ldy, first);
    for (; b < B; ++b) lora_rows<T, 1>(W, N, x + b * ldx, ldx, g0, g1, n0, n1, y + b * ldy, ldy, first);
  }
}

// One product of lora_products: y [B, W.cols] (row stride ldy) = x [B, W.rows] (row stride ldx) @ W.
struct LoraCall {
  const LoraMatrix& W;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
};

// Several LoRA products (the same B) as one parallel job.
void lora_products(const LoraCall* calls, int n, int64_t B) {
  struct Job {
    const LoraCall* c;
    int64_t nk, nn, first;  // K tiles, N tiles, index of the job's first item
    std::unique_ptr<float[]> part;  // [nk, B, N] partial sums when nk > 1
  };
  std::vector<Job> jobs;
  int64_t items = 0;
  for (const LoraCall& c : std::span(calls, n)) {
    const int64_t K = c.W.rows, N = c.W.cols;
    Job j{&c, (K + kLoraRows - 1) / kLoraRows, (N + kLoraCols - 1) / kLoraCols, items, nullptr};
    if (j.nk > 1) j.part = std::make_unique_for_overwrite<float[]>(j.nk * B * N);
    items += j.nk * j.nn;
    jobs.push_back(std::move(j));
  }
  parallel_for(items, [&](int64_t i) {
    size_t ji = 0;
    while (ji + 1 < jobs.size() && jobs[ji + 1].first <= i) ++ji;
    const Job& j = jobs[ji];
    const LoraCall& c = *j.c;
    const int64_t K = c.W.rows, N = c.W.cols, t = i - j.first, kt = t / j.nn, nt = t % j.nn;
    const int64_t k0 = kt * kLoraRows, k1 = std::min(K, k0 + kLoraRows);
    const int64_t n0 = nt * kLoraCols, n1 = std::min(N, n0 + kLoraCols);
    float* y = j.part ? j.part.get() + kt * B * N : c.y;
    const int64_t ldy = j.part ? N : c.ldy;
    switch (c.W.t) {
      case DType::kF32: lora_tile<DType::kF32>(c.W.w, N, c.x, c.ldx, B, k0, k1, n0, n1, y, ldy); break;
      case DType::kBF16: lora_tile<DType::kBF16>(c.W.w, N, c.x, c.ldx, B, k0, k1, n0, n1, y, ldy); break;
      default: lora_tile<DType::kF16>(c.W.w, N, c.x, c.ldx, B, k0, k1, n0, n1, y, ldy); break;
    }
  });
  for (const Job& j : jobs) {  // the K tiles' partial sums, in order
    if (!j.part) continue;
    const int64_t N = j.c->W.cols;
    for (int64_t b = 0; b < B; ++b) {
      float* y = j.c->y + b * j.c->ldy;
      const float* p0 = j.part.get() + b * N;
      std::copy(p0, p0 + N, y);
      for (int64_t kt = 1; kt < j.nk; ++kt) {
        const float* p = j.part.get() + (kt * B + b) * N;
        for (int64_t i = 0; i < N; ++i) y[i] += p[i];
      }
    }
  }
}

void lora_products(std::initializer_list<LoraCall> calls, int64_t B) {
  lora_products(calls.begin(), static_cast<int>(calls.size()), B);
}

// Linears whose outputs the PyTorch path holds in dt (`self.key(kx)` with kx in dt), as one
// parallel job (gemv_many): y [B, N] = x [B, K] W^T, fp32 in and out, x holding values in dt
// (every caller rounds it, as the PyTorch path's `.to(dt)`). Absent ones are skipped.
struct LinCall {
  const Linear& l;
  const float* x;
  float* y;
};

void linears_dt(std::initializer_list<LinCall> calls, int64_t B, DType dt) {
  GemvCall gc[8];
  int n = 0;
  for (const LinCall& c : calls)
    if (c.l.kind != Linear::Kind::kNone) gc[n++] = GemvCall{&c.l, c.x, c.y, DType::kF32, dt};  // x is in dt
  gemv_many(gc, n, B);
  for (const LinCall& c : calls)
    if (c.l.kind != Linear::Kind::kNone) round_all(dt, c.y, B * c.l.N);
}

void linear_dt(const Linear& l, const float* x, int64_t B, DType dt, float* y) { linears_dt({{l, x, y}}, B, dt); }

// Runs fn(b, h) over all rows and heads, split across threads. Each item ends with a store
// fence: the WKVs write the new state with streaming stores, which the pool's atomics do not
// order, and the caller reads that state once the step returns.
template <class Fn>
void for_heads(int64_t B, int64_t H, const Fn& fn) {
  parallel_for(B * H, [&](int64_t i) {
    fn(i / H, i % H);
    simd::store_fence();
  });
}

// A state store. The new matrix state (H x N x N per row and layer: 100 MB a step at batch 8 on
// the 1.5B shape) goes far past the caches before it is read again, so where it is aligned it is
// streamed to memory instead of each line being read first to be written.
template <bool kStream>
inline void store_state(float* p, simd::F v) {
  if constexpr (kStream) simd::stream(p, v);
  else simd::store(p, v);
}

inline bool aligned(const float* p) { return reinterpret_cast<uintptr_t>(p) % simd::kBytes == 0; }

// RWKV-5/6 WKV, one token (kernels/wkv5.py, wkv5_naive): for key i and value j,
//   y[j] = sum_i r[i] (u[i] k[i] v[j] + S[i, j]);   S[i, j] <- w[i] S[i, j] + k[i] v[j],  w = exp(log_w).
// Vectorized over j for heads of 16, 32, 64 or 128 channels (NB = N / kW registers of y), the
// bonus term summed once: y[j] = v[j] * sum_i r[i] u[i] k[i] + sum_i r[i] S[i, j].
template <int NB, bool kStream>
void wkv5_head_simd(const float* r, const float* k, const float* v, const float* log_w, const float* u,
                    const float* S, float* So, float* y) {
  constexpr int N = simd::kW * NB;
  simd::F acc[NB];
  for (int jb = 0; jb < NB; ++jb) acc[jb] = simd::zero();
  float ruk = 0.0f;
  for (int i = 0; i < N; ++i) {
    ruk += r[i] * u[i] * k[i];
    const simd::F br = simd::set1(r[i]), bw = simd::set1(std::exp(log_w[i])), bk = simd::set1(k[i]);
    const float* Si = S + i * N;
    float* Soi = So + i * N;
#pragma GCC unroll 16
    for (int jb = 0; jb < NB; ++jb) {
      const simd::F s = simd::load(Si + kW * jb);
      acc[jb] = simd::fma(br, s, acc[jb]);
      store_state<kStream>(Soi + kW * jb, simd::fma(bw, s, simd::mul(bk, simd::load(v + kW * jb))));
    }
  }
  const simd::F bruk = simd::set1(ruk);
  for (int jb = 0; jb < NB; ++jb) simd::store(y + kW * jb, simd::fma(bruk, simd::load(v + kW * jb), acc[jb]));
}

void wkv5_head(const float* r, const float* k, const float* v, const float* log_w, const float* u, const float* S,
               float* So, float* y, int64_t N, bool stream) {
  auto simd = [&]<int NB>() {
    if (stream && aligned(So)) wkv5_head_simd<NB, true>(r, k, v, log_w, u, S, So, y);
    else wkv5_head_simd<NB, false>(r, k, v, log_w, u, S, So, y);
  };
  switch (N) {
    case 16: return simd.template operator()<16 / kW>();
    case 32: return simd.template operator()<32 / kW>();
    case 64: return simd.template operator()<64 / kW>();
    case 128: return simd.template operator()<128 / kW>();
    default: break;
  }
  std::vector<float> acc(N, 0.0f);
  for (int64_t i = 0; i < N; ++i) {
    const float ri = r[i], ki = k[i], rui = r[i] * u[i] * k[i], wi = std::exp(log_w[i]);
    const float* Si = S + i * N;
    float* Soi = So + i * N;
    for (int64_t j = 0; j < N; ++j) {
      const float s = Si[j];
      acc[j] += rui * v[j] + ri * s;
      Soi[j] = wi * s + ki * v[j];
    }
  }
  std::copy(acc.begin(), acc.end(), y);
}

// RWKV-7 WKV, one token (kernels/wkv7.py, wkv7_naive), a = -kk, b = kk * iclr:
//   read[j] = sum_i a[i] S[i, j];  S[i, j] <- w[i] S[i, j] + b[i] read[j] + k[i] v[j];
//   y[j] = sum_i r[i] S[i, j] (the updated state). Vectorized over j as wkv5_head_simd.
template <int NB, bool kStream>
void wkv7_head_simd(const float* r, const float* k, const float* v, const float* w, const float* a, const float* b,
                    const float* S, float* So, float* y) {
  constexpr int N = simd::kW * NB;
  simd::F acc[NB];
  for (int jb = 0; jb < NB; ++jb) acc[jb] = simd::zero();
  for (int i = 0; i < N; ++i) {
    const simd::F ba = simd::set1(a[i]);
#pragma GCC unroll 16
    for (int jb = 0; jb < NB; ++jb) acc[jb] = simd::fma(ba, simd::load(S + i * N + kW * jb), acc[jb]);
  }
  alignas(64) float read[N];
  for (int jb = 0; jb < NB; ++jb) {
    simd::store(read + kW * jb, acc[jb]);
    acc[jb] = simd::zero();
  }
  for (int i = 0; i < N; ++i) {
    const simd::F bw = simd::set1(w[i]), bb = simd::set1(b[i]), bk = simd::set1(k[i]), br = simd::set1(r[i]);
    const float* Si = S + i * N;
    float* Soi = So + i * N;
#pragma GCC unroll 16
    for (int jb = 0; jb < NB; ++jb) {
      simd::F s = simd::mul(bk, simd::load(v + kW * jb));
      s = simd::fma(bb, simd::load(read + kW * jb), s);
      s = simd::fma(bw, simd::load(Si + kW * jb), s);
      store_state<kStream>(Soi + kW * jb, s);
      acc[jb] = simd::fma(br, s, acc[jb]);
    }
  }
  for (int jb = 0; jb < NB; ++jb) simd::store(y + kW * jb, acc[jb]);
}

// stream: streaming stores for a new state that goes to memory (the decode step); false for one
// that is read again at once (wkv7_sequence updates a head's state in place, in the cache).
void wkv7_head(const float* r, const float* k, const float* v, const float* w, const float* a, const float* b,
               const float* S, float* So, float* y, int64_t N, bool stream = true) {
  auto simd = [&]<int NB>() {
    if (stream && aligned(So)) wkv7_head_simd<NB, true>(r, k, v, w, a, b, S, So, y);
    else wkv7_head_simd<NB, false>(r, k, v, w, a, b, S, So, y);
  };
  switch (N) {
    case 16: return simd.template operator()<16 / kW>();
    case 32: return simd.template operator()<32 / kW>();
    case 64: return simd.template operator()<64 / kW>();
    case 128: return simd.template operator()<128 / kW>();
    default: break;
  }
  std::vector<float> read(N, 0.0f), acc(N, 0.0f);
  for (int64_t i = 0; i < N; ++i) {
    const float ai = a[i];
    const float* Si = S + i * N;
    for (int64_t j = 0; j < N; ++j) read[j] += ai * Si[j];
  }
  for (int64_t i = 0; i < N; ++i) {
    const float wi = w[i], bi = b[i], ki = k[i], ri = r[i];
    const float* Si = S + i * N;
    float* Soi = So + i * N;
    for (int64_t j = 0; j < N; ++j) {
      const float s = wi * Si[j] + bi * read[j] + ki * v[j];
      Soi[j] = s;
      acc[j] += ri * s;
    }
  }
  std::copy(acc.begin(), acc.end(), y);
}

// One sequence's head through the T tokens of a pass: step(t, S, So, stream) runs token t from
// the state S to So. One token goes straight from `in` to `out` (which may alias it), streaming
// the new state; more go through a copy of the head's state in this thread's scratch (in the
// cache), updated in place, and only the last state is written out. The same arithmetic either
// way: each token's bits are those of a one-token step.
template <class Fn>
void head_tokens(int64_t T, int64_t NN, const float* in, float* out, const Fn& step) {
  if (T == 1) return step(0, in, out, true);
  thread_local std::vector<float> S;
  S.assign(in, in + NN);
  for (int64_t t = 0; t < T; ++t) step(t, S.data(), S.data(), false);
  std::copy(S.begin(), S.end(), out);
}

// Row-major scratch for B rows, not initialized: every value read is written first (zeroing
// a step's scratch was some 30 MB of stores at batch 8).
struct Rows {
  std::unique_ptr<float[]> buf;
  int64_t width;
  Rows(int64_t B, int64_t width) : buf(std::make_unique_for_overwrite<float[]>(B * width)), width(width) {}
  float* operator[](int64_t b) { return buf.get() + b * width; }
  float* data() { return buf.get(); }
};

// fn(b) for every sequence b of the batch, a sequence per work item.
template <class Fn>
void for_batch(int64_t B, const Fn& fn) {
  parallel_for(B, fn);
}

// The state of row b, layer i of a field [B, L, n].
inline const float* at(const float* base, int64_t b, int64_t i, int64_t L, int64_t n) { return base + (b * L + i) * n; }
inline float* at(float* base, int64_t b, int64_t i, int64_t L, int64_t n) { return base + (b * L + i) * n; }

// A pass: B sequences of T tokens each, as R = B T rows (row b T + t is token t of sequence b)
// for everything but the token shift and the recurrences, which go through a sequence's tokens
// in order. T = 1 is the decode step; T > 1 a verify pass (or a short prompt).
struct Pass {
  int64_t B, T;
  int64_t rows() const { return B * T; }
};

// The token shift of a block's sub-layer for every sequence: xx[r] = LayerNorm(x[r]) for its
// tokens in order, mix(r, prev) with prev the previous token's xx (the state's x_prev for the
// first), then the last token's xx becomes the new x_prev (field `f` of the state, [B, L, C]).
template <class Fn>
void token_shift(const Pass& ps, int64_t C, int64_t layer, int64_t L, const float* x, const float* ln_w,
                 const float* ln_b, Rows& xx, const StateRef& st, int f, const Fn& mix) {
  for_batch(ps.B, [&](int64_t b) {
    const float* prev = at(st.in[f], b, layer, L, C);
    for (int64_t t = 0; t < ps.T; ++t) {
      const int64_t r = b * ps.T + t;
      layer_norm(x + r * C, ln_w, ln_b, C, xx[r]);
      mix(r, prev);
      prev = xx[r];
    }
    std::copy(prev, prev + C, at(st.out[f], b, layer, L, C));  // after the last read of x_prev, which it may alias
  });
}

// The channel mix (layers.py ChannelMix): x += sigmoid(rx Wr) * (relu(kx Wk)^2 Wv), no gate in RWKV-7.
void channel_mix(const ModelParams& p, const BlockParams& q, const Pass& ps, int64_t layer, float* x,
                 const StateRef& st, int prev_field) {
  const int64_t C = p.C, F = p.F, L = static_cast<int64_t>(p.blocks.size()), R = ps.rows();
  const DType dt = p.dt;
  const bool gated = q.ffn_r.kind != Linear::Kind::kNone;
  Rows xx(R, C), kx(R, C), rx(R, C), k(R, F), v(R, C), r(R, C);
  token_shift(ps, C, layer, L, x, q.ln2_w, q.ln2_b, xx, st, prev_field, [&](int64_t i, const float* prev) {
    mix_to(xx[i], prev, q.ffn_mix_k, C, dt, kx[i]);
    if (gated) mix_to(xx[i], prev, q.ffn_mix_r, C, dt, rx[i]);
  });
  linears_dt({{q.ffn_k, kx.data(), k.data()}, {q.ffn_r, rx.data(), r.data()}}, R, dt);
  for (int64_t i = 0; i < R * F; ++i) {  // torch.relu(...).square() in dt
    const float h = std::max(k.data()[i], 0.0f);
    k.data()[i] = h * h;
  }
  round_all(dt, k.data(), R * F);
  linear_dt(q.ffn_v, k.data(), R, dt, v.data());
  for_batch(R, [&](int64_t i) {
    float *xi = x + i * C, *vi = v[i], *ri = r[i];
    if (gated) {
      for (int64_t c = 0; c < C; ++c) xi[c] += sigmoid(ri[c]) * vi[c];
    } else {
      for (int64_t c = 0; c < C; ++c) xi[c] += vi[c];
    }
  });
}

// RWKV-4 time mix (models/rwkv4.py) with the log-space WKV (kernels/wkv4.py).
void time_mix4(const ModelParams& p, const BlockParams& q, const Pass& ps, int64_t layer, float* x,
               const StateRef& st) {
  const int64_t C = p.C, A = p.A, L = static_cast<int64_t>(p.blocks.size()), R = ps.rows();
  const DType dt = p.dt;
  Rows xx(R, C), xk(R, C), xv(R, C), xr(R, C), k(R, A), v(R, A), r(R, A), y(R, A), out(R, C);
  token_shift(ps, C, layer, L, x, q.ln1_w, q.ln1_b, xx, st, 0, [&](int64_t i, const float* prev) {
    mix_to(xx[i], prev, q.mix_k, C, dt, xk[i]);
    mix_to(xx[i], prev, q.mix_v, C, dt, xv[i]);
    mix_to(xx[i], prev, q.mix_r, C, dt, xr[i]);
  });
  linears_dt({{q.att_k, xk.data(), k.data()}, {q.att_v, xv.data(), v.data()}, {q.att_r, xr.data(), r.data()}}, R, dt);
  for_batch(ps.B, [&](int64_t b) {
    float *num_o = at(st.out[1], b, layer, L, A), *den_o = at(st.out[2], b, layer, L, A);
    float* mx_o = at(st.out[3], b, layer, L, A);
    for (int64_t t = 0; t < ps.T; ++t) {  // the state from the one token to the next, through st.out
      const float *num = t ? num_o : at(st.in[1], b, layer, L, A), *den = t ? den_o : at(st.in[2], b, layer, L, A);
      const float* mx = t ? mx_o : at(st.in[3], b, layer, L, A);
      const int64_t i = b * ps.T + t;
      for (int64_t c = 0; c < A; ++c) {
        const float kt = k[i][c], vt = v[i][c], n0 = num[c], d0 = den[c], m0 = mx[c];
        float ww = q.bonus[c] + kt;
        float pm = std::max(m0, ww);
        float e1 = std::exp(m0 - pm), e2 = std::exp(ww - pm);
        const float wkv = (e1 * n0 + e2 * vt) / (e1 * d0 + e2);
        ww = q.decay[c] + m0;
        pm = std::max(ww, kt);
        e1 = std::exp(ww - pm);
        e2 = std::exp(kt - pm);
        num_o[c] = e1 * n0 + e2 * vt;
        den_o[c] = e1 * d0 + e2;
        mx_o[c] = pm;
        y[i][c] = round_to(dt, sigmoid(r[i][c]) * wkv);  // (r * y).to(dt)
      }
    }
  });
  linear_dt(q.att_o, y.data(), R, dt, out.data());
  for (int64_t i = 0; i < R * C; ++i) x[i] += out.data()[i];
}

// RWKV-5.x and 6.0 time mix (models/rwkv5.py, rwkv6.py): multi-head WKV with a matrix state.
void time_mix56(const ModelParams& p, const BlockParams& q, const Pass& ps, int64_t layer, float* x,
                const StateRef& st) {
  const int64_t C = p.C, A = p.A, H = p.H, N = p.N, L = static_cast<int64_t>(p.blocks.size()), R = ps.rows();
  const DType dt = p.dt;
  const bool v6 = p.family == 6;
  Rows xx(R, C), xr(R, C), xk(R, C), xv(R, C), xg(R, C), r(R, A), k(R, A), v(R, A), g(R, A), y(R, A), out(R, C);
  Rows log_w(v6 ? R : 0, A), sx(v6 ? R : 0, C), xxx(v6 ? R : 0, C);
  token_shift(ps, C, layer, L, x, q.ln1_w, q.ln1_b, xx, st, 0, [&](int64_t i, const float* prev) {
    if (!v6) {
      mix_to(xx[i], prev, q.mix_r, C, dt, xr[i]);
      mix_to(xx[i], prev, q.mix_k, C, dt, xk[i]);
      mix_to(xx[i], prev, q.mix_v, C, dt, xv[i]);
      if (p.gated) mix_to(xx[i], prev, q.mix_g, C, dt, xg[i]);
    } else {  // the LoRA below still needs prev: a copy
      std::copy(prev, prev + C, sx[i]);
      mix_to(xx[i], prev, q.mix_x, C, DType::kF32, xxx[i]);
    }
  });
  if (v6) {
    // RWKV-6: each mix coefficient gets a per-token offset from a LoRA of xxx = mix(xx, sx, mix_x):
    // offsets [5, C] = tanh(xxx @ maa_w1) (as [5, D]) @ maa_w2 (5 slabs [D, C]).
    const int64_t D = q.maa_w1.cols / 5, Dd = q.decay_w1.cols;
    Rows lora(R, 5 * D), off(R, 5 * C), wx(R, C), dec(R, Dd);
    lora_products({{q.maa_w1, xxx.data(), C, lora.data(), 5 * D}}, R);
    for (int64_t i = 0; i < R * 5 * D; ++i) lora.data()[i] = std::tanh(lora.data()[i]);
    const LoraMatrix w2[5] = {q.maa_w2.slab(0, D), q.maa_w2.slab(1, D), q.maa_w2.slab(2, D), q.maa_w2.slab(3, D),
                              q.maa_w2.slab(4, D)};
    lora_products({{w2[0], lora.data(), 5 * D, off.data(), 5 * C},
                   {w2[1], lora.data() + D, 5 * D, off.data() + C, 5 * C},
                   {w2[2], lora.data() + 2 * D, 5 * D, off.data() + 2 * C, 5 * C},
                   {w2[3], lora.data() + 3 * D, 5 * D, off.data() + 3 * C, 5 * C},
                   {w2[4], lora.data() + 4 * D, 5 * D, off.data() + 4 * C, 5 * C}}, R);
    const float* mixes[5] = {q.mix_w, q.mix_k, q.mix_v, q.mix_r, q.mix_g};  // the LoRA's output order
    for_batch(R, [&](int64_t i) {
      const float *prev = sx[i], *xi = xx[i];
      float* dests[5] = {wx[i], xk[i], xv[i], xr[i], xg[i]};
      for (int f = 0; f < 5; ++f) {
        const float* o = off[i] + f * C;
        for (int64_t c = 0; c < C; ++c) {
          const float m = prev[c] + (xi[c] - prev[c]) * (mixes[f][c] - o[c]);
          dests[f][c] = f == 0 ? m : round_to(dt, m);  // wx stays fp32 (it feeds the fp32 decay LoRA)
        }
      }
    });
    // log w = -exp(decay_base + tanh(wx @ decay_w1) @ decay_w2)
    lora_products({{q.decay_w1, wx.data(), C, dec.data(), Dd}}, R);
    for (int64_t i = 0; i < R * Dd; ++i) dec.data()[i] = std::tanh(dec.data()[i]);
    lora_products({{q.decay_w2, dec.data(), Dd, log_w.data(), A}}, R);  // + decay_base, per head below
  }
  linears_dt({{q.att_r, xr.data(), r.data()}, {q.att_k, xk.data(), k.data()}, {q.att_v, xv.data(), v.data()},
              {q.att_g, xg.data(), g.data()}}, R, dt);  // (att_g is absent in RWKV-5.0)
  // Per head, token by token: (RWKV-6) log w = -exp(decay_base + the decay LoRA), the WKV, the
  // head's GroupNorm, the gate y * silu(gate(xg)), rounded to dt.
  const int64_t NN = N * N;
  for_heads(ps.B, H, [&](int64_t b, int64_t h) {
    const int64_t o = h * N;
    head_tokens(ps.T, NN, at(st.in[1], b, layer, L, H * NN) + h * NN, at(st.out[1], b, layer, L, H * NN) + h * NN,
                [&](int64_t t, const float* S, float* So, bool stream) {
                  const int64_t i = b * ps.T + t;
                  if (v6)
                    for (int64_t c = o; c < o + N; ++c) log_w[i][c] = -std::exp(q.decay_base[c] + log_w[i][c]);
                  const float* wi = v6 ? log_w[i] + o : q.decay + o;
                  float* yh = y[i] + o;
                  wkv5_head(r[i] + o, k[i] + o, v[i] + o, wi, q.bonus + o, S, So, yh, N, stream);
                  normalize(yh, q.lnx_w + o, q.lnx_b + o, N, kGroupNormEps, yh);
                  if (p.gated) {
                    const float* gh = g[i] + o;
                    for (int64_t j = 0; j < N; ++j) yh[j] *= gh[j] * sigmoid(gh[j]);
                  }
                  round_all(dt, yh, N);
                });
  });
  linear_dt(q.att_o, y.data(), R, dt, out.data());
  for (int64_t i = 0; i < R * C; ++i) x[i] += out.data()[i];
}

// RWKV-7 time mix (models/rwkv7.py). v_first [R, C]: layer 0's values, read by the later layers.
void time_mix7(const ModelParams& p, const BlockParams& q, const Pass& ps, int64_t layer, float* x,
               const StateRef& st, float* v_first) {
  const int64_t C = p.C, H = p.H, N = p.N, L = static_cast<int64_t>(p.blocks.size()), R = ps.rows();
  const DType dt = p.dt;
  Rows xx(R, C), xr(R, C), xw(R, C), xk(R, C), xv(R, C), xa(R, C), xg(R, C);
  Rows r(R, C), k(R, C), v(R, C), w(R, C), iclr(R, C), g(R, C), kk(R, C), ka(R, C), y(R, C), out(R, C);
  Rows xv_dt(R, C);
  token_shift(ps, C, layer, L, x, q.ln1_w, q.ln1_b, xx, st, 0, [&](int64_t i, const float* prev) {
    // The LoRA inputs (xw, xa, xg, and xv for the value residual) stay fp32; r, k, v's are in dt.
    mix_to(xx[i], prev, q.mix_r, C, dt, xr[i]);
    mix_to(xx[i], prev, q.mix_w, C, DType::kF32, xw[i]);
    mix_to(xx[i], prev, q.mix_k, C, dt, xk[i]);
    mix_to(xx[i], prev, q.mix_v, C, DType::kF32, xv[i]);
    mix_to(xx[i], prev, q.mix_a, C, DType::kF32, xa[i]);
    mix_to(xx[i], prev, q.mix_g, C, DType::kF32, xg[i]);
    std::copy(xv[i], xv[i] + C, xv_dt[i]);
    round_all(dt, xv_dt[i], C);
  });
  linears_dt({{q.att_r, xr.data(), r.data()}, {q.att_k, xk.data(), k.data()}, {q.att_v, xv_dt.data(), v.data()}}, R,
             dt);
  // The LoRAs, each as a parallel job over all rows: the C -> D products, their activations,
  // the D -> C ones. lw = tanh(xw @ w1) @ w2, la = (xa @ a1) @ a2, g = sigmoid(xg @ g1) @ g2,
  // lv = (xv @ v1) @ v2 (not in layer 0).
  const bool residual = layer > 0;
  const int64_t Dw = q.w1.cols, Da = q.a1.cols, Dg = q.g1.cols, Dv = residual ? q.v1.cols : 0;
  Rows low_w(R, Dw), low_a(R, Da), low_g(R, Dg), low_v(R, Dv), lw(R, C), la(R, C), lv(residual ? R : 0, C);
  const LoraCall down[4] = {{q.w1, xw.data(), C, low_w.data(), Dw}, {q.a1, xa.data(), C, low_a.data(), Da},
                            {q.g1, xg.data(), C, low_g.data(), Dg}, {q.v1, xv.data(), C, low_v.data(), Dv}};
  lora_products(down, residual ? 4 : 3, R);
  for (int64_t i = 0; i < R * Dw; ++i) low_w.data()[i] = std::tanh(low_w.data()[i]);
  for (int64_t i = 0; i < R * Dg; ++i) low_g.data()[i] = sigmoid(low_g.data()[i]);
  const LoraCall up[4] = {{q.w2, low_w.data(), Dw, lw.data(), C}, {q.a2, low_a.data(), Da, la.data(), C},
                          {q.g2, low_g.data(), Dg, g.data(), C}, {q.v2, low_v.data(), Dv, lv.data(), C}};
  lora_products(up, residual ? 4 : 3, R);
  // Per head, token by token (everything from here to the output GEMV works on one head's
  // channels): the decay, iclr, kk, the value residual, the WKV, the head's GroupNorm,
  // + (r . (k * r_k)) v (the current token's own term), times the gate, rounded to dt.
  const int64_t NN = N * N;
  for_heads(ps.B, H, [&](int64_t b, int64_t h) {
    const int64_t o = h * N, e = o + N;
    head_tokens(ps.T, NN, at(st.in[1], b, layer, L, H * NN) + h * NN, at(st.out[1], b, layer, L, H * NN) + h * NN,
                [&](int64_t t, const float* S, float* So, bool stream) {
                  const int64_t i = b * ps.T + t;
                  // log w = -e^-0.5 sigmoid(w0 + lw); the WKV takes w = exp(log w). iclr = sigmoid(a0 + la).
                  for (int64_t c = o; c < e; ++c) w[i][c] = std::exp(-kDecayScale7 * sigmoid(q.w0[c] + lw[i][c]));
                  for (int64_t c = o; c < e; ++c) iclr[i][c] = sigmoid(q.a0[c] + la[i][c]);
                  // kk = normalize(k * k_k) over the head (F.normalize: / max(norm, 1e-12))
                  double ss = 0;
                  for (int64_t c = o; c < e; ++c) {
                    const float u = k[i][c] * q.k_k[c];
                    kk[i][c] = u;
                    ss += static_cast<double>(u) * u;
                  }
                  const float inv = 1.0f / std::max(static_cast<float>(std::sqrt(ss)), 1e-12f);
                  for (int64_t c = o; c < e; ++c) kk[i][c] *= inv;
                  // k = k * (1 + (iclr - 1) * k_a); a = -kk, b = kk * iclr
                  for (int64_t c = o; c < e; ++c) {
                    k[i][c] = k[i][c] * (1 + (iclr[i][c] - 1) * q.k_a[c]);
                    ka[i][c] = kk[i][c] * iclr[i][c];
                    kk[i][c] = -kk[i][c];
                  }
                  if (layer == 0) {
                    std::copy(v[i] + o, v[i] + e, v_first + i * C + o);
                  } else {  // v = v + (v_first - v) * sigmoid(v0 + lv)
                    for (int64_t c = o; c < e; ++c)
                      v[i][c] += (v_first[i * C + c] - v[i][c]) * sigmoid(q.v0[c] + lv[i][c]);
                  }
                  float* yh = y[i] + o;
                  const float *rh = r[i] + o, *kh = k[i] + o, *vh = v[i] + o, *gh = g[i] + o;
                  wkv7_head(rh, kh, vh, w[i] + o, kk[i] + o, ka[i] + o, S, So, yh, N, stream);
                  normalize(yh, q.lnx_w + o, q.lnx_b + o, N, kGroupNormEps, yh);
                  float dot = 0;
                  for (int64_t j = 0; j < N; ++j) dot += rh[j] * kh[j] * q.r_k[o + j];
                  for (int64_t j = 0; j < N; ++j) yh[j] = round_to(dt, (yh[j] + dot * vh[j]) * gh[j]);
                });
  });
  linear_dt(q.att_o, y.data(), R, dt, out.data());
  for (int64_t i = 0; i < R * C; ++i) x[i] += out.data()[i];
}

}  // namespace

void wkv7_sequence(int64_t B, int64_t T, int64_t H, int64_t N, const float* r, const float* k, const float* v,
                   const float* w, const float* a, const float* b, const float* state_in, float* state_out, float* y) {
  const int64_t NN = N * N;
  parallel_for(B * H, [&](int64_t item) {
    const int64_t bi = item / H, h = item % H;
    // The head's state lives in this scratch (in the cache) while its tokens go by.
    std::vector<float> S(state_in + item * NN, state_in + (item + 1) * NN);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t o = ((bi * T + t) * H + h) * N;
      wkv7_head(r + o, k + o, v + o, w + o, a + o, b + o, S.data(), S.data(), y + o, N, false);
    }
    std::copy(S.begin(), S.end(), state_out + item * NN);
  });
}

void lora_product(const LoraMatrix& W, const float* x, int64_t B, float* y) {
  lora_products({{W, x, W.rows, y, W.cols}}, B);
}

void decode_step(const ModelParams& p, int64_t B, int64_t T, float* x, const StateRef& st, float* logits,
                 bool all_logits) {
  const int64_t L = static_cast<int64_t>(p.blocks.size());
  const Pass ps{B, T};
  const int64_t R = ps.rows();
  const int ffn_field = p.family == 4 ? 4 : 2;
  std::vector<float> v_first(p.family == 7 ? R * p.C : 0);
  for (int64_t i = 0; i < L; ++i) {
    const BlockParams& q = p.blocks[i];
    switch (p.family) {
      case 4: time_mix4(p, q, ps, i, x, st); break;
      case 7: time_mix7(p, q, ps, i, x, st, v_first.data()); break;
      default: time_mix56(p, q, ps, i, x, st); break;
    }
    channel_mix(p, q, ps, i, x, st, ffn_field);
    if (p.rescale_every > 0 && (i + 1) % p.rescale_every == 0) {
      for (int64_t j = 0; j < R * p.C; ++j) x[j] *= 0.5f;
    }
  }
  // The head (RWKV._logits): head(ln_out(x).to(dt)).float(), of every row or of each sequence's last.
  const int64_t n = all_logits ? R : B;
  Rows xo(n, p.C);
  for_batch(n, [&](int64_t i) {
    const int64_t row = all_logits ? i : i * T + T - 1;
    layer_norm(x + row * p.C, p.ln_out_w, p.ln_out_b, p.C, xo[i]);
    round_all(p.dt, xo[i], p.C);
  });
  linear_dt(p.head, xo.data(), n, p.dt, logits);
}

}  // namespace rwkv_native
