// Native int8 quantizer and column scales (see quantize.h). Portable C++: the fp16 / bf16
// conversions are written out here (round to nearest even, as torch rounds), and the build's
// -ffp-contract=off keeps every a * b + c as two roundings, as in the PyTorch reference.

#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "pool.h"

namespace rwkv_native {
namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000 | (man << 13));  // inf / nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  const float sub = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
  return sign ? -sub : sub;
}

// fp32 -> fp16, round to nearest even (overflow to inf, subnormals rounded, nan kept a nan).
uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a >= 0x7F800000) return sign | (a > 0x7F800000 ? 0x7E00 : 0x7C00);
  if (a >= 0x477FF000) return sign | 0x7C00;  // rounds to beyond 65504
  if (a < 0x38800000) {                        // below 2^-14: a subnormal (or zero) result
    const float mag = bits_to_float(a);
    // exact: mag * 2^24 < 2^10 fits fp32, and nearbyint rounds to nearest even
    return sign | static_cast<uint16_t>(std::nearbyint(mag * 16777216.0f));
  }
  const uint32_t lsb = (a >> 13) & 1;
  const uint32_t r = a + 0xFFF + lsb;  // round the 13 dropped bits to nearest even
  return sign | static_cast<uint16_t>((r - 0x38000000) >> 13);
}

float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Row n of a [N, K] weight, elements [k0, k0 + len), as fp32 (exact for every input type).
void load_row(const void* w, DType wt, int64_t K, int64_t n, int64_t k0, int64_t len, float* out) {
  const int64_t off = n * K + k0;
  switch (wt) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(w) + off, static_cast<size_t>(len) * 4);
      break;
    case DType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w) + off;
      for (int64_t k = 0; k < len; ++k) out[k] = bf16_to_float(p[k]);
      break;
    }
    case DType::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w) + off;
      for (int64_t k = 0; k < len; ++k) out[k] = f16_to_float(p[k]);
      break;
    }
  }
}

constexpr float kRound = 12582912.0f;  // 1.5 * 2^23

// max |x[k]| over k < n, as the max of the bit patterns of |x| (ordered as unsigned integers for
// every non-NaN float; the weights were checked finite), which vectorizes without fast-math.
float abs_max(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t k = 0; k < n; ++k) {
    uint32_t u;
    std::memcpy(&u, x + k, 4);
    m = std::max(m, u & 0x7FFFFFFFu);
  }
  return bits_to_float(m);
}

// Items of about `work` elements each, at least one per thread when there is enough to share.
int64_t items_for(int64_t units, int64_t elems_per_unit) {
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t by_size = std::max<int64_t>(1, units * elems_per_unit / (1 << 16));
  return std::max<int64_t>(1, std::min(units, std::max(threads * 4, by_size)));
}

}  // namespace

void column_scales(const void* w, DType wt, int64_t N, int64_t K, uint16_t* out) {
  std::vector<double> sq(static_cast<size_t>(K), 0.0);
  // Column blocks: each item sums its columns over every row, in row order.
  constexpr int64_t kCols = 256;
  const int64_t blocks = (K + kCols - 1) / kCols;
  parallel_for(blocks, [&](int64_t b) {
    const int64_t k0 = b * kCols, len = std::min(kCols, K - k0);
    std::vector<float> row(static_cast<size_t>(len));
    double* acc = sq.data() + k0;
    for (int64_t n = 0; n < N; ++n) {
      load_row(w, wt, K, n, k0, len, row.data());
      for (int64_t k = 0; k < len; ++k) {
        const double v = row[k];
        acc[k] += v * v;
      }
    }
  });
  double mean = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double rms = std::sqrt(sq[k] / static_cast<double>(N));
    sq[k] = rms > 0 ? rms : 1.0;
    mean += sq[k];
  }
  mean /= static_cast<double>(K);
  for (int64_t k = 0; k < K; ++k) {
    const double c = std::min(std::max(sq[k] / mean, 0x1p-14), 0x1p14);
    out[k] = float_to_f16(static_cast<float>(c));  // double -> float -> half, as torch's .to()
  }
}

void quantize_q8(const void* w, DType wt, const uint16_t* cs, int64_t N, int64_t K, int64_t gs, int8_t* q,
                 uint16_t* s) {
  std::vector<float> c;
  if (cs != nullptr) {
    c.resize(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) c[k] = f16_to_float(cs[k]);
  }
  const int64_t G = K / gs, items = items_for(N, K);
  parallel_for(items, [&](int64_t i) {
    const int64_t a = N * i / items, b = N * (i + 1) / items;
    const int64_t group = gs;  // a local: the compiler then knows the int8 stores cannot change it
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t n = a; n < b; ++n) {
      load_row(w, wt, K, n, 0, K, row.data());
      if (cs != nullptr)
        for (int64_t k = 0; k < K; ++k) row[k] /= c[k];
      for (int64_t g = 0; g < G; ++g) {
        const float* x = row.data() + g * group;
        const uint16_t s16 = float_to_f16(abs_max(x, group) / 127.0f);
        const float sf = f16_to_float(s16);
        const float inv = sf > 0 ? 1.0f / sf : 0.0f;
        int8_t* qr = q + n * K + g * group;
        for (int64_t k = 0; k < group; ++k) {
          // x * inv is within about +-190 (the scale is amax / 127 rounded to fp16), so adding and
          // removing 1.5 * 2^23 rounds it to the nearest integer, ties to even: torch.round.
          const float r = (x[k] * inv + kRound) - kRound;
          qr[k] = static_cast<int8_t>(static_cast<int>(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r)));
        }
        s[n * G + g] = s16;
      }
    }
  });
}

}  // namespace rwkv_native
