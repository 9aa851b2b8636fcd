// One decode step of a whole RWKV model (every block; one token per sequence, or a few for a
// speculative verify pass) in plain C++: the fused path behind rwkv_engine/models/native_step.py.
// No torch headers (see kernels.h).
//
// The math is that of rwkv_engine/models (the PyTorch modules are the specification and the
// tests compare the two): fp32 residual stream, LayerNorms, mixes and recurrent state; each
// big matrix through the GEMVs of kernels.h, its input and output rounded to the model dtype
// exactly where the PyTorch path converts (`.to(dtype)`, the dtype of a linear's output).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace rwkv_native {

// A small LoRA matrix W [rows, cols], row-major, in the type the model stores it in: fp32, or
// the checkpoint's bf16 / fp16 (models/model.py RWKV.lora_names). Products with it are fp32.
struct LoraMatrix {
  const void* w = nullptr;
  DType t = DType::kF32;
  int64_t rows = 0, cols = 0;
  // Rows [i * n, (i + 1) * n) as a matrix of their own (RWKV-6's maa_w2 [5, D, C]: n = D).
  LoraMatrix slab(int64_t i, int64_t n) const {
    return {static_cast<const char*>(w) + i * n * cols * dtype_bytes(t), t, n, cols};
  }
};

// The parameters of one block (fp32 unless said otherwise; nullptr where the version has none).
// They point into the model's own tensors, so in-place changes of the model show.
struct BlockParams {
  const float *ln1_w = nullptr, *ln1_b = nullptr, *ln2_w = nullptr, *ln2_b = nullptr;
  // Time mix. Mixes use the shared convention mix(x, prev, m) = prev + (x - prev) * m.
  const float *mix_r = nullptr, *mix_k = nullptr, *mix_v = nullptr, *mix_g = nullptr;
  const float *mix_w = nullptr, *mix_a = nullptr, *mix_x = nullptr;
  const float* decay = nullptr;      // log_decay: v4 [A], v5 [H, N]
  const float* bonus = nullptr;      // v4 [A], v5/v6 [H, N] (u)
  LoraMatrix maa_w1, maa_w2;  // v6 mix LoRA [C, 5 D], [5 D, C] (5 slabs of D rows, order w k v r g)
  const float* decay_base = nullptr;  // v6 [A]
  LoraMatrix decay_w1, decay_w2;      // v6 [C, Dd], [Dd, A]
  const float *w0 = nullptr, *a0 = nullptr, *v0 = nullptr;  // v7 LoRA biases [C]
  LoraMatrix w1, w2;  // v7 decay LoRA [C, Dw], [Dw, C]
  LoraMatrix a1, a2;  // v7 in-context learning rate LoRA
  LoraMatrix v1, v2;  // v7 value residual LoRA (not in layer 0)
  LoraMatrix g1, g2;  // v7 gate LoRA
  const float *k_k = nullptr, *k_a = nullptr, *r_k = nullptr;
  const float *lnx_w = nullptr, *lnx_b = nullptr;  // per-head GroupNorm affine [A]
  Linear att_r, att_k, att_v, att_g, att_o;
  // Channel mix.
  const float *ffn_mix_k = nullptr, *ffn_mix_r = nullptr;
  Linear ffn_k, ffn_v, ffn_r;  // ffn_r absent (kNone) in RWKV-7
};

struct ModelParams {
  int family = 5;        // 4, 5, 6 or 7
  bool gated = true;     // RWKV-5.0 has no output gate
  int64_t C = 0, A = 0, H = 0, N = 0, F = 0;
  DType dt = DType::kF32;  // the model dtype: where the PyTorch path rounds
  int rescale_every = 0;   // fp16: halve the residual after every rescale_every blocks
  std::vector<BlockParams> blocks;
  const float *ln_out_w = nullptr, *ln_out_b = nullptr;  // the final LayerNorm [C] and the head [V, C]
  Linear head;
};

// The recurrent state of B rows, each field [B, L, ...] fp32 contiguous, in the State's field
// order: RWKV-4 (att_x_prev, att_num, att_den, att_max, ffn_x_prev), RWKV-5/6/7 (att_x_prev,
// att_kv, ffn_x_prev). `out` may alias `in`.
struct StateRef {
  const float* in[5] = {};
  float* out[5] = {};
};

// y [B, W.cols] = x [B, W.rows] @ W, x and y fp32: the LoRA product of decode_step, on all threads,
// each row's bits independent of B and of the thread count (for the standalone selftest).
void lora_product(const LoraMatrix& W, const float* x, int64_t B, float* y);

// The RWKV-7 WKV over T tokens (kernels/wkv7.py, wkv7_naive; w = exp(log_w) the decays): r, k, v,
// w, a, b, y [B, T, H, N] and the states [B, H, N, N] ([key][value]) fp32 contiguous; state_out may
// alias state_in. Token by token with the decode step's per-token arithmetic, each head one work
// item: a prompt gives the same bits in one call or in pieces, and each row those of its own call.
void wkv7_sequence(int64_t B, int64_t T, int64_t H, int64_t N, const float* r, const float* k, const float* v,
                   const float* w, const float* a, const float* b, const float* state_in, float* state_out, float* y);

// B sequences of T tokens each from the state `st.in` to the state after their last tokens
// (`st.out`). x [B, T, C] fp32: the embedded tokens in, the residual stream after the last block
// out; logits fp32, head(ln_out(x)) rounded to the model dtype as the PyTorch path holds it:
// [B, T, V] with all_logits, else [B, V] of each sequence's last token.
// T = 1 is the decode step. T > 1 (a speculative verify pass) runs every linear as B T rows of
// one GEMV, so the weights are read once for all of them, and steps each sequence's recurrence
// through its tokens; each token gets the bits it gets in a one-token step from the state before it.
void decode_step(const ModelParams& p, int64_t B, int64_t T, float* x, const StateRef& st, float* logits,
                 bool all_logits);

}  // namespace rwkv_native
