// Weight quantizers in plain C++ (no ISA intrinsics: any CPU, baseline compiler flags), the native
// twins of rwkv_engine.quant.primitives: the same fp32 steps in the same order, so the bytes equal
// the reference's. Work is split over rows (columns for column_scales) on the kernels' thread pool.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace rwkv_native {

// primitives.column_scales: fp16 [K] = column RMS over the N rows / mean of those RMS, clamped to
// [2^-14, 2^14] (all-zero columns count as RMS 1). Sums in fp64, rows in order.
void column_scales(const void* w, DType wt, int64_t N, int64_t K, uint16_t* out);

// primitives.quantize_int8: q int8 [N, K], fp16 scales [N, K / gs] of w / cs (cs: fp16 [K] or null).
void quantize_q8(const void* w, DType wt, const uint16_t* cs, int64_t N, int64_t K, int64_t gs, int8_t* q,
                 uint16_t* s);

}  // namespace rwkv_native
