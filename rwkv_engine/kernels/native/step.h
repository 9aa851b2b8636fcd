// One decode step of a whole RWKV model (every block, one token per sequence) in plain C++:
// the fused path behind rwkv_engine/models/native_step.py. No torch headers (see kernels.h).
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

// The parameters of one block (fp32 unless said otherwise; nullptr where the version has none).
// They point into the model's own tensors, so in-place changes of the model show.
struct BlockParams {
  const float *ln1_w = nullptr, *ln1_b = nullptr, *ln2_w = nullptr, *ln2_b = nullptr;
  // Time mix. Mixes use the shared convention mix(x, prev, m) = prev + (x - prev) * m.
  const float *mix_r = nullptr, *mix_k = nullptr, *mix_v = nullptr, *mix_g = nullptr;
  const float *mix_w = nullptr, *mix_a = nullptr, *mix_x = nullptr;
  const float* decay = nullptr;      // log_decay: v4 [A], v5 [H, N]
  const float* bonus = nullptr;      // v4 [A], v5/v6 [H, N] (u)
  const float *maa_w1 = nullptr, *maa_w2 = nullptr;  // v6 mix LoRA [C, 5 D], [5, D, C] (order w k v r g)
  const float *decay_base = nullptr, *decay_w1 = nullptr, *decay_w2 = nullptr;  // v6 [A], [C, Dd], [Dd, A]
  const float *w0 = nullptr, *w1 = nullptr, *w2 = nullptr;  // v7 decay LoRA
  const float *a0 = nullptr, *a1 = nullptr, *a2 = nullptr;  // v7 in-context learning rate LoRA
  const float *v0 = nullptr, *v1 = nullptr, *v2 = nullptr;  // v7 value residual LoRA (not in layer 0)
  const float *g1 = nullptr, *g2 = nullptr;                  // v7 gate LoRA
  const float *k_k = nullptr, *k_a = nullptr, *r_k = nullptr;
  const float *lnx_w = nullptr, *lnx_b = nullptr;  // per-head GroupNorm affine [A]
  int64_t d_mix = 0, d_decay = 0, d_iclr = 0, d_value = 0, d_gate = 0;  // LoRA ranks
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

// x [B, C] fp32: the embedded tokens in, the residual stream after the last block out;
// logits [B, V] fp32: head(ln_out(x)), rounded to the model dtype as the PyTorch path holds it.
void decode_step(const ModelParams& p, int64_t B, float* x, const StateRef& st, float* logits);

}  // namespace rwkv_native
