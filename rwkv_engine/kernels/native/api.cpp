// The exported table of a kernel library (see api.h).

#include "api.h"

#include "simd.h"

extern "C" __attribute__((visibility("default"))) const rwkv_native::Api* rwkv_native_api() {
  using namespace rwkv_native;
  static const Api api{kApiVersion, sizeof(Api), simd::kLevel, gemv_dense, gemv_q8, gemv_q4, gemv_many,
                       dequant_q8,  dequant_q4,  quantize_q4,  decode_step, quantize_q8, column_scales,
                       wkv7_sequence, gemv_kq,     dequant_kq,  kq_x_group};
  return &api;
}
