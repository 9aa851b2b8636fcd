// AMX (Advanced Matrix Extensions: Sapphire Rapids and later Xeons) for the batched GEMVs of bf16
// weights: y [B, N] = x [B, K] W^T with B of 4 to 8 rows per pass (kernels.cpp gemv_many), the
// weights read once per pass by tile loads. See amx.cpp for the tiling, and for what has run where.
#pragma once

#include <cstdint>

namespace rwkv_native::amx {

// Rows of x from which a pass of a bf16-dot GEMV (kernels.cpp bf16_dot) takes the AMX path where
// available(): below it the vector kernel, whose results differ in the last bits (another
// summation order). "Batched = alone, bit for bit" holds within each path: any row of a pass of
// kMinRows or more rows gives the bits it gives in any other such pass.
inline constexpr int kMinRows = 4;

// Whether the AMX path runs: the CPU has AMX-TILE and AMX-BF16 (cpuid leaf 7) and Linux granted
// this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM); always in a build with
// RWKV_AMX_EMULATE (the tile instructions as scalar loops, for tests on any x86 CPU); never with
// RWKV_NO_AMX or off x86-64.
bool available();

// The x of a pass, [B, K] bf16 (row stride xs elements, B <= 16), as the tiles take it: xp
// [K / 32][16][B] 32-bit words, word (s, p, b) = x[b, 32 s + 2 p .. 32 s + 2 p + 1].
void pack_x(const uint16_t* x, int64_t xs, int B, int64_t K, uint32_t* xp);

// y[b * ldy + (n - r0)] = sum_k W[n, k] x[b, k] in fp32 for weight rows n in [r0, r1): W [N, K]
// bf16, xp from pack_x, x its bf16 rows (for the K % 32 columns past the tiles: summed after them,
// in order). Each value: the tiles' sums over 32-column steps in order, then the tail.
void gemm_bf16(const uint16_t* W, int64_t K, const uint32_t* xp, const uint16_t* x, int64_t xs, int B, int64_t r0,
               int64_t r1, float* y, int64_t ldy);

}  // namespace rwkv_native::amx
