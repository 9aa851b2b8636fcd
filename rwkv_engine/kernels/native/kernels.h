// Plain C++ interface of the native kernels (no torch headers, so kernels.cpp compiles fast).
// bindings.cpp checks tensors and calls these with raw pointers.
#pragma once

#include <cstdint>

namespace rwkv_native {

// Element type of x, y and dense weights.
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
constexpr int64_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// y[b, n] = sum_k x[b, k] * w[n, k].  x [B, K] and y [B, N] have dtype xt; w [N, K] has dtype wt.
void gemv_dense(const void* w, DType wt, int64_t N, int64_t K, const void* x, DType xt, int64_t B, void* y);

// The int8 / int4 GEMVs take optional column scales cs (fp16 bits [K], or nullptr): the weight
// is then w[n, k] * cs[k], computed as x[b, k] * cs[k] (fp32) before anything else.

// w[n, k] = q[n, k] * s[n, k / (K / G)]; q int8 [N, K], s fp32 [N, G].
void gemv_q8(const int8_t* q, const uint16_t* s, const uint16_t* cs, int64_t N, int64_t K, int64_t G, const void* x,
             DType xt, int64_t B, void* y);

// w[n, k] = code(n, k) * s[n, g] + z[n, g], g = k / (K / G); q uint8 [N, K / 2] (column 2i in the
// low nibble of byte i), s and z fp16 bits [N, G]; K / G in {32, 64, 128}.
void gemv_q4(const uint8_t* q, const uint16_t* s, const uint16_t* z, const uint16_t* cs, int64_t N, int64_t K,
             int64_t G, const void* x, DType xt, int64_t B, void* y);

// ggml's K-quant block types (ids as ggml / GGUF number them): rows of 256-column blocks in the
// GGUF's own bytes (loading/ggml_quants.py has the layouts); the formats of quant/kquant_linear.py.
enum class KType : int { kQ4K = 12, kQ5K = 13, kQ6K = 14 };
constexpr int64_t ktype_bytes(KType t) { return t == KType::kQ4K ? 144 : t == KType::kQ5K ? 176 : 210; }
inline bool is_ktype(int64_t t) { return t == 12 || t == 13 || t == 14; }

// w[n, k] = the value ggml decodes for column k of row n, times cs[k]; blocks [N, K / 256 *
// ktype_bytes(t)], K a multiple of 256. x is rounded to int8 per kq_x_group(t, B) columns (32, as
// for gemv_q4: the products summed exactly per 16 columns; or 256, as ggml's Q8_K: per block).
void gemv_kq(KType t, const uint8_t* blocks, const uint16_t* cs, int64_t N, int64_t K, const void* x, DType xt,
             int64_t B, void* y);
// Columns per int8 step of x in gemv_kq of B rows of type t: 256 for prefill (more than 16 rows)
// on the AVX2 level, else 32.
int kq_x_group(KType t, int64_t B);

// A linear layer y = x W^T in one of the formats above.
struct Linear {
  enum class Kind : int { kNone = 0, kDense, kQ8, kQ4, kKQuant } kind = Kind::kNone;
  int64_t N = 0, K = 0, G = 1;
  const void* w = nullptr;  // dense [N, K] of dtype wt
  DType wt = DType::kF32;
  const int8_t* q8 = nullptr;  // int8 [N, K], scales fp16 [N, G]
  const uint16_t* s8 = nullptr;
  const uint8_t* q4 = nullptr;  // packed int4 [N, K / 2], scales / biases fp16 [N, G]
  const uint16_t* s4 = nullptr;
  const uint16_t* z4 = nullptr;
  const uint8_t* kq = nullptr;  // K-quant blocks [N, K / 256 * ktype_bytes(kt)]
  KType kt = KType::kQ4K;
  const uint16_t* cs = nullptr;  // optional fp16 column scales [K]
};

// One GEMV of gemv_many: y [B, l.N] = x [B, l.K] W^T, x and y of dtype xt. `exact`: a type in
// which every value of x is exact (xt itself, or bf16 where x is fp32 holding bf16 values, as the
// decode step's activations of a bf16 model); with bf16 and bf16 weights, a CPU's bf16 dot
// products may be used (the avx512_bf16 level).
struct GemvCall {
  const Linear* l;
  const void* x;
  void* y;
  DType xt;
  DType exact = xt;
};

// Several GEMVs (the same B) as one parallel job: their row blocks are shared out together, so
// the threads stream from one matrix into the next without a join in between. The three
// functions above are gemv_many of one call.
void gemv_many(const GemvCall* calls, int n, int64_t B);

// Rows [r0, r1) of the dequantized weight into out [r1 - r0, K] of dtype ot.
void dequant_q8(const int8_t* q, const uint16_t* s, int64_t K, int64_t G, int64_t r0, int64_t r1, void* out, DType ot);
void dequant_q4(const uint8_t* q, const uint16_t* s, const uint16_t* z, int64_t K, int64_t G, int64_t r0, int64_t r1,
                void* out, DType ot);
// ggml's values exactly (gguf.quants' fp32 operations), then rounded to ot.
void dequant_kq(KType t, const uint8_t* blocks, int64_t K, int64_t r0, int64_t r1, void* out, DType ot);

// Asymmetric int4 quantization of w [N, K] (fp32 / bf16 / fp16) with group size gs in
// {32, 64, 128}, trying each range shrink factor (the first is used alone when nshrink == 1),
// of w / cs when column scales cs (fp16 bits [K]) are given: q uint8 [N, K / 2], s and z fp16
// bits [N, K / gs]. Same bytes as primitives.quantize_int4.
void quantize_q4(const void* w, DType wt, const uint16_t* cs, int64_t N, int64_t K, int64_t gs, const float* shrinks,
                 int nshrink, uint8_t* q, uint16_t* s, uint16_t* z);

}  // namespace rwkv_native
