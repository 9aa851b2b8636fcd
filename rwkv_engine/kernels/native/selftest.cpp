// A standalone driver of the kernels (no Python, no torch), for levels that cannot run on the
// build machine: tests/test_native_isa.py cross-compiles it with kernels.cpp and step.cpp (for
// ARM64 with aarch64-linux-gnu-g++) and runs it under an emulator (qemu-aarch64) on cases whose
// expected results come from the PyTorch reference.
//
//   selftest CASES OUT     runs every case of the file CASES, appending each result to OUT
//
// A case: int64 op, int64 p[6], then its input arrays, raw little-endian:
//   op 0 gemv_dense   p = N K B wt xt -     in: w [N, K] (wt), x [B, K] (xt)      out: y [B, N] (xt)
//   op 1 gemv_q8      p = N K B G xt -      in: q int8 [N, K], s fp16 [N, G], x  out: y
//   op 2 gemv_q4      p = N K B G xt -      in: q [N, K/2], s, z fp16 [N, G], x  out: y
//   op 3 dequant_q4   p = N K G ot -  -     in: q, s, z                          out: [N, K] (ot)
//   op 4 quantize_q4  p = N K gs nshrink -  in: w fp32 [N, K], shrinks fp32      out: q, s, z
//   op 5 lora_product p = K N B wt -  -     in: W [K, N] (wt), x fp32 [B, K]       out: y fp32 [B, N]
//   op 6 wkv7_sequence p = B T H N -  -     in: r k v w a b fp32 [B, T, H, N], state [B, H, N, N]
//                                                                       out: y [B, T, H, N], new state
//   op 7 gemv_kq      p = N K B type xt -   in: blocks [N, K / 256 * bytes], x   out: y [B, N] (xt)
//   op 8 dequant_kq   p = N K type ot -  -  in: blocks                         out: [N, K] (ot)
// dtypes as kernels.h DType (0 fp32, 1 bf16, 2 fp16). Prints the ISA level.

#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "step.h"

using namespace rwkv_native;

namespace {

size_t esize(int64_t t) { return static_cast<size_t>(dtype_bytes(DType(t))); }

struct Reader {
  FILE* f;
  bool ok = true;
  std::vector<char> read(size_t n) {
    std::vector<char> v(n);
    if (n && std::fread(v.data(), 1, n, f) != n) ok = false;
    return v;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CASES OUT\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) {
    std::fprintf(stderr, "cannot open the files\n");
    return 2;
  }
  std::printf("level %s\n", simd::kLevel);
  Reader r{in};
  int cases = 0;
  for (;;) {
    int64_t head[7];
    if (std::fread(head, 8, 7, in) != 7) break;
    const int64_t op = head[0], *p = head + 1;
    std::vector<char> y;
    if (op == 0) {
      const int64_t N = p[0], K = p[1], B = p[2], wt = p[3], xt = p[4];
      auto w = r.read(N * K * esize(wt)), x = r.read(B * K * esize(xt));
      y.resize(B * N * esize(xt));
      gemv_dense(w.data(), DType(wt), N, K, x.data(), DType(xt), B, y.data());
    } else if (op == 1 || op == 2) {
      const int64_t N = p[0], K = p[1], B = p[2], G = p[3], xt = p[4];
      auto q = r.read(op == 1 ? N * K : N * K / 2), s = r.read(N * G * 2);
      auto z = op == 2 ? r.read(N * G * 2) : std::vector<char>();
      auto x = r.read(B * K * esize(xt));
      y.resize(B * N * esize(xt));
      if (op == 1)
        gemv_q8(reinterpret_cast<const int8_t*>(q.data()), reinterpret_cast<const uint16_t*>(s.data()), nullptr, N, K,
                G, x.data(), DType(xt), B, y.data());
      else
        gemv_q4(reinterpret_cast<const uint8_t*>(q.data()), reinterpret_cast<const uint16_t*>(s.data()),
                reinterpret_cast<const uint16_t*>(z.data()), nullptr, N, K, G, x.data(), DType(xt), B, y.data());
    } else if (op == 3) {
      const int64_t N = p[0], K = p[1], G = p[2], ot = p[3];
      auto q = r.read(N * K / 2), s = r.read(N * G * 2), z = r.read(N * G * 2);
      y.resize(N * K * esize(ot));
      dequant_q4(reinterpret_cast<const uint8_t*>(q.data()), reinterpret_cast<const uint16_t*>(s.data()),
                 reinterpret_cast<const uint16_t*>(z.data()), K, G, 0, N, y.data(), DType(ot));
    } else if (op == 4) {
      const int64_t N = p[0], K = p[1], gs = p[2], ns = p[3];
      auto w = r.read(N * K * 4), sh = r.read(ns * 4);
      y.resize(N * K / 2 + 2 * (N * K / gs) * 2);
      uint8_t* q = reinterpret_cast<uint8_t*>(y.data());
      uint16_t* s = reinterpret_cast<uint16_t*>(y.data() + N * K / 2);
      quantize_q4(w.data(), DType::kF32, nullptr, N, K, gs, reinterpret_cast<const float*>(sh.data()),
                  static_cast<int>(ns), q, s, s + N * K / gs);
    } else if (op == 5) {
      const int64_t K = p[0], N = p[1], B = p[2], wt = p[3];
      auto w = r.read(K * N * esize(wt)), x = r.read(B * K * 4);
      y.resize(B * N * 4);
      lora_product(LoraMatrix{w.data(), DType(wt), K, N}, reinterpret_cast<const float*>(x.data()), B,
                   reinterpret_cast<float*>(y.data()));
    } else if (op == 6) {
      const int64_t B = p[0], T = p[1], H = p[2], N = p[3], n = B * T * H * N, ns = B * H * N * N;
      std::vector<std::vector<char>> in6;
      for (int i = 0; i < 6; ++i) in6.push_back(r.read(n * 4));
      auto st = r.read(ns * 4);
      y.resize((n + ns) * 4);
      auto f = [](const std::vector<char>& v) { return reinterpret_cast<const float*>(v.data()); };
      float* yo = reinterpret_cast<float*>(y.data());
      if (r.ok)
        wkv7_sequence(B, T, H, N, f(in6[0]), f(in6[1]), f(in6[2]), f(in6[3]), f(in6[4]), f(in6[5]), f(st), yo + n, yo);
    } else if (op == 7 || op == 8) {
      const int64_t N = p[0], K = p[1], B = op == 7 ? p[2] : 0, type = op == 7 ? p[3] : p[2], dt = op == 7 ? p[4] : p[3];
      if (!is_ktype(type)) {
        std::fprintf(stderr, "case %d: bad K-quant type\n", cases);
        return 2;
      }
      const KType t = static_cast<KType>(type);
      auto w = r.read(N * (K / 256) * ktype_bytes(t));
      const uint8_t* blocks = reinterpret_cast<const uint8_t*>(w.data());
      if (op == 7) {
        auto x = r.read(B * K * esize(dt));
        y.resize(B * N * esize(dt));
        if (r.ok) gemv_kq(t, blocks, nullptr, N, K, x.data(), DType(dt), B, y.data());
      } else {
        y.resize(N * K * esize(dt));
        if (r.ok) dequant_kq(t, blocks, K, 0, N, y.data(), DType(dt));
      }
    } else {
      std::fprintf(stderr, "unknown op %lld\n", static_cast<long long>(op));
      return 2;
    }
    if (!r.ok) {
      std::fprintf(stderr, "case %d: truncated input\n", cases);
      return 2;
    }
    std::fwrite(y.data(), 1, y.size(), out);
    ++cases;
  }
  std::fclose(out);
  std::printf("%d cases\n", cases);
  return 0;
}
