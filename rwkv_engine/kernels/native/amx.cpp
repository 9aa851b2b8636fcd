// AMX tiles for the batched GEMVs of bf16 weights (amx.h).
//
// The weights are the tiles' A operand as they lie in memory: a tile is 16 weight rows x 32
// columns (16 rows of 64 bytes, the row stride K * 2 bytes), so nothing is repacked; x is the B
// operand, packed once per call (pack_x: 16 rows of column pairs x B words). TDPBF16PS then adds
// to C (16 weight rows x B fp32) A . B; a panel of up to 4 row blocks keeps 4 C tiles (tmm4-7)
// while each 32-column step loads x once (tmm2) and the 4 blocks' A tiles (tmm0 / tmm1 in turn).
// A last block of fewer than 16 rows runs under its own tile configuration (rows = the rest).
// The order of a value's additions depends on neither B nor the panel: batch invariant.
//
// Hardware: needs the tile data state granted by Linux (arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA)) before the first tile instruction, asked once per process. The tile
// instructions come from intrinsics in functions with a target attribute only (no -mamx-* flags
// on the file), so no AMX instruction reaches code that runs on a CPU without it, and the tile
// configuration is an explicit 64-byte struct loaded with LDTILECFG (GCC 12 has no tile register
// allocation: every tile number is a constant here), released (TILERELEASE) after each call.
//
// RWKV_AMX_EMULATE replaces the five tile operations by scalar loops over 8 tile registers with
// the same configuration checks the hardware makes (rows <= 16, bytes per row <= 64, the shapes
// of TDPBF16PS agreeing; a violation aborts, as the hardware's #UD would): the packing, tiling and
// edge handling are then tested on any x86 CPU (tests/test_native_amx.py). The products are exact
// in fp32 (bf16 significands), each addition rounded, denormal inputs and results flushed to zero,
// in the order of the SDM's pseudo-code; the hardware's own rounding is tested only where AMX exists.

#include "amx.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace rwkv_native::amx {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// The configuration of a pass of B rows of x whose weight row blocks have `rows` rows: tmm0-1 A
// (rows x 64 bytes), tmm2 B (16 x 4B bytes), tmm4-7 C (rows x 4B bytes).
TileConfig config(int rows, int B) {
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;
  c.rows[2] = 16, c.colsb[2] = static_cast<uint16_t>(4 * B);
  for (int t = 4; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = static_cast<uint16_t>(4 * B);
  return c;
}

inline float bf16f(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(RWKV_AMX_EMULATE)
#define RWKV_AMX_TARGET
struct Emu {
  TileConfig cfg;
  bool on = false;
  alignas(64) uint8_t t[8][16][64];
};
thread_local Emu emu;

[[noreturn]] void fault() { std::abort(); }  // where the hardware raises #UD
void need(bool ok) {
  if (!ok) fault();
}
void need_tile(int t) { need(emu.on && emu.cfg.rows[t] >= 1 && emu.cfg.rows[t] <= 16 && emu.cfg.colsb[t] <= 64); }
inline float daz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? 0.f * v : v; }
inline float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; }

inline void load_config(const TileConfig* c) {
  need(c->palette == 1);
  emu.cfg = *c, emu.on = true;
  std::memset(emu.t, 0, sizeof emu.t);
}
inline void release() { emu.on = false; }
template <int T>
inline void zero() {
  need_tile(T);
  std::memset(emu.t[T], 0, sizeof emu.t[T]);
}
template <int T>
inline void load(const void* p, int64_t stride) {
  need_tile(T);
  std::memset(emu.t[T], 0, sizeof emu.t[T]);
  for (int r = 0; r < emu.cfg.rows[T]; ++r) std::memcpy(emu.t[T][r], static_cast<const char*>(p) + r * stride, emu.cfg.colsb[T]);
}
template <int T>
inline void store(void* p, int64_t stride) {
  need_tile(T);
  for (int r = 0; r < emu.cfg.rows[T]; ++r) std::memcpy(static_cast<char*>(p) + r * stride, emu.t[T][r], emu.cfg.colsb[T]);
}
template <int C, int A, int B>
inline void dpbf16() {
  need_tile(C), need_tile(A), need_tile(B);
  const TileConfig& g = emu.cfg;
  need(g.rows[C] == g.rows[A] && g.colsb[C] == g.colsb[B] && g.rows[B] == g.colsb[A] / 4 && g.colsb[A] % 4 == 0);
  for (int m = 0; m < g.rows[A]; ++m)
    for (int k = 0; k < g.colsb[A] / 4; ++k)
      for (int n = 0; n < g.colsb[C] / 4; ++n) {
        uint16_t a[2], b[2];
        std::memcpy(a, &emu.t[A][m][4 * k], 4);
        std::memcpy(b, &emu.t[B][k][4 * n], 4);
        float c;
        std::memcpy(&c, &emu.t[C][m][4 * n], 4);
        c = ftz(c + daz(bf16f(a[0])) * daz(bf16f(b[0])));
        c = ftz(c + daz(bf16f(a[1])) * daz(bf16f(b[1])));
        std::memcpy(&emu.t[C][m][4 * n], &c, 4);
      }
}
#elif defined(__x86_64__) && !defined(RWKV_NO_AMX)
#define RWKV_AMX_HW 1
#define RWKV_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
// GCC 12's <amxtileintrin.h> declares that ldtilecfg reads 8 of the configuration's 64 bytes and
// that tileloadd reads no memory (GCC 13 fixed it): the compiler barriers keep every store to the
// configuration and to a tile's memory before the instruction that reads it.
RWKV_AMX_TARGET inline void load_config(const TileConfig* c) {
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(c);
}
RWKV_AMX_TARGET inline void release() { _tile_release(); }
// GCC's tile intrinsics are macros that paste the tile number into the instruction: one
// specialization per tile in use.
template <int T> void zero();
template <int T> void load(const void* p, int64_t stride);
template <int T> void store(void* p, int64_t stride);
template <int C, int A, int B> void dpbf16();
#define RWKV_AMX_TILE(T)                                                                                      \
  template <> RWKV_AMX_TARGET inline void zero<T>() { _tile_zero(T); }                                       \
  template <> RWKV_AMX_TARGET inline void load<T>(const void* p, int64_t stride) {                              \
    __asm__ volatile("" ::: "memory");                                                                        \
    _tile_loadd(T, p, stride);                                                                                \
  }                                                                                                           \
  template <> RWKV_AMX_TARGET inline void store<T>(void* p, int64_t stride) { _tile_stored(T, p, stride); }
RWKV_AMX_TILE(0)
RWKV_AMX_TILE(1)
RWKV_AMX_TILE(2)
RWKV_AMX_TILE(4)
RWKV_AMX_TILE(5)
RWKV_AMX_TILE(6)
RWKV_AMX_TILE(7)
#undef RWKV_AMX_TILE
template <> RWKV_AMX_TARGET inline void dpbf16<4, 0, 2>() { _tile_dpbf16ps(4, 0, 2); }
template <> RWKV_AMX_TARGET inline void dpbf16<5, 1, 2>() { _tile_dpbf16ps(5, 1, 2); }
template <> RWKV_AMX_TARGET inline void dpbf16<6, 0, 2>() { _tile_dpbf16ps(6, 0, 2); }
template <> RWKV_AMX_TARGET inline void dpbf16<7, 1, 2>() { _tile_dpbf16ps(7, 1, 2); }
#endif

#if defined(RWKV_AMX_EMULATE) || defined(RWKV_AMX_HW)
#define RWKV_AMX_ANY 1

// A panel of NB blocks of `rows` rows from weight row n0: C tiles 4 .. 4 + NB - 1.
template <int NB>
RWKV_AMX_TARGET void panel(const uint16_t* W, int64_t K, const uint32_t* xp, int B, int64_t n0, int rows, float* c) {
  const int64_t S = K / 32;
  if constexpr (NB > 0) zero<4>();
  if constexpr (NB > 1) zero<5>();
  if constexpr (NB > 2) zero<6>();
  if constexpr (NB > 3) zero<7>();
  for (int64_t s = 0; s < S; ++s) {
    load<2>(xp + s * 16 * B, 4 * B);
    const uint16_t* w = W + n0 * K + 32 * s;
    const int64_t ws = 2 * K;  // bytes between weight rows
    if constexpr (NB > 0) load<0>(w, ws), dpbf16<4, 0, 2>();
    if constexpr (NB > 1) load<1>(w + 16 * K, ws), dpbf16<5, 1, 2>();
    if constexpr (NB > 2) load<0>(w + 32 * K, ws), dpbf16<6, 0, 2>();
    if constexpr (NB > 3) load<1>(w + 48 * K, ws), dpbf16<7, 1, 2>();
  }
  // C tile j to c [NB * 16 rows][B]
  if constexpr (NB > 0) store<4>(c, 4 * B);
  if constexpr (NB > 1) store<5>(c + 16 * B, 4 * B);
  if constexpr (NB > 2) store<6>(c + 32 * B, 4 * B);
  if constexpr (NB > 3) store<7>(c + 48 * B, 4 * B);
  (void)rows;
}
#endif

}  // namespace

bool available() {
#if defined(RWKV_AMX_EMULATE)
  return true;
#elif defined(RWKV_AMX_HW)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !bf16) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

void pack_x(const uint16_t* x, int64_t xs, int B, int64_t K, uint32_t* xp) {
  for (int64_t s = 0; s < K / 32; ++s)
    for (int p = 0; p < 16; ++p)
      for (int b = 0; b < B; ++b) std::memcpy(xp + (s * 16 + p) * B + b, x + b * xs + 32 * s + 2 * p, 4);
}

#if defined(RWKV_AMX_ANY)
RWKV_AMX_TARGET void gemm_bf16(const uint16_t* W, int64_t K, const uint32_t* xp, const uint16_t* x, int64_t xs, int B,
                               int64_t r0, int64_t r1, float* y, int64_t ldy) {
  alignas(64) float c[64 * 16];
  auto finish = [&](int64_t n0, int rows) {  // the tiles' sums + the columns past them, to y
    for (int m = 0; m < rows; ++m) {
      const uint16_t* wr = W + (n0 + m) * K;
      for (int b = 0; b < B; ++b) {
        float v = c[m * B + b];
        for (int64_t k = K / 32 * 32; k < K; ++k) v += bf16f(wr[k]) * bf16f(x[b * xs + k]);
        y[b * ldy + (n0 - r0 + m)] = v;
      }
    }
  };
  if (K < 32) {  // no tile step: the tail alone
    std::fill(c, c + 64 * 16, 0.f);
    for (int64_t n0 = r0; n0 < r1; n0 += 16) finish(n0, static_cast<int>(std::min<int64_t>(16, r1 - n0)));
    return;
  }
  const int64_t full = r0 + (r1 - r0) / 16 * 16;
  if (full > r0) {
    const TileConfig cfg = config(16, B);
    load_config(&cfg);
    int64_t n0 = r0;
    for (; n0 + 64 <= full; n0 += 64) panel<4>(W, K, xp, B, n0, 16, c), finish(n0, 64);
    switch ((full - n0) / 16) {
      case 3: panel<3>(W, K, xp, B, n0, 16, c), finish(n0, 48); break;
      case 2: panel<2>(W, K, xp, B, n0, 16, c), finish(n0, 32); break;
      case 1: panel<1>(W, K, xp, B, n0, 16, c), finish(n0, 16); break;
      default: break;
    }
    release();
  }
  if (full < r1) {  // the last rows: a block of fewer than 16
    const int rows = static_cast<int>(r1 - full);
    const TileConfig cfg = config(rows, B);
    load_config(&cfg);
    panel<1>(W, K, xp, B, full, rows, c);
    release();
    finish(full, rows);
  }
}
#else
void gemm_bf16(const uint16_t*, int64_t, const uint32_t*, const uint16_t*, int64_t, int, int64_t, int64_t, float*,
               int64_t) {
  std::abort();  // never called: available() is false
}
#endif

}  // namespace rwkv_native::amx
