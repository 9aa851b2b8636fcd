// Conversions between fp32 and the 16-bit float formats, shared by the kernels (x86-64: F16C;
// ARM64: the __fp16 type). torch's rounding: round to nearest even; a NaN stays a NaN.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace rwkv_native {

#if defined(__x86_64__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
inline float half_to_float(uint16_t h) {
  __fp16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
inline uint16_t float_to_half(float f) {
  const __fp16 v = static_cast<__fp16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
#endif
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace rwkv_native
