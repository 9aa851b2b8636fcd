// The table of entry points that one build of the kernels (one ISA level, see simd.h) exports
// as a shared library: bindings.cpp loads the library of the level chosen at run time and calls
// through the table. No torch headers.
#pragma once

#include <cstdint>

#include "kernels.h"
#include "quantize.h"
#include "step.h"

namespace rwkv_native {

// Bumped whenever Api changes, so that a library and bindings of different versions never meet.
inline constexpr int kApiVersion = 7;

struct Api {
  int version;
  int size;           // sizeof(Api)
  const char* level;  // simd::kLevel
  decltype(&rwkv_native::gemv_dense) gemv_dense;
  decltype(&rwkv_native::gemv_q8) gemv_q8;
  decltype(&rwkv_native::gemv_q4) gemv_q4;
  decltype(&rwkv_native::gemv_many) gemv_many;
  decltype(&rwkv_native::dequant_q8) dequant_q8;
  decltype(&rwkv_native::dequant_q4) dequant_q4;
  decltype(&rwkv_native::quantize_q4) quantize_q4;
  decltype(&rwkv_native::decode_step) decode_step;
  decltype(&rwkv_native::quantize_q8) quantize_q8;
  decltype(&rwkv_native::column_scales) column_scales;
  decltype(&rwkv_native::wkv7_sequence) wkv7_sequence;
  decltype(&rwkv_native::gemv_kq) gemv_kq;
  decltype(&rwkv_native::dequant_kq) dequant_kq;
  decltype(&rwkv_native::kq_x_group) kq_x_group;
};

}  // namespace rwkv_native

// The library's table (the one symbol it exports).
extern "C" const rwkv_native::Api* rwkv_native_api();
