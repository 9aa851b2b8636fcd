// Python bindings of the native kernels: check the tensors, allocate the output, call the kernels
// of the ISA level in use (a shared library built per level, loaded with use_kernels; api.h).
// Only light torch headers (the full torch/extension.h takes over a minute to compile).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "api.h"

namespace {

using rwkv_native::DType;

// The kernels in use: the table of the library that use_kernels loaded last.
const rwkv_native::Api* g_api = nullptr;

const rwkv_native::Api& api() {
  TORCH_CHECK(g_api != nullptr, "no native kernel library loaded (use_kernels)");
  return *g_api;
}

// Loads a kernel library (never unloaded: a DecodePlan or a helper thread may still use it) and
// makes its kernels the ones every call uses; returns its ISA level.
std::string use_kernels(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(h != nullptr, "cannot load ", path, ": ", dlerror());
  auto get = reinterpret_cast<const rwkv_native::Api* (*)()>(dlsym(h, "rwkv_native_api"));
  TORCH_CHECK(get != nullptr, path, " is not a kernel library (no rwkv_native_api)");
  const rwkv_native::Api* a = get();
  TORCH_CHECK(a->version == rwkv_native::kApiVersion && a->size == static_cast<int>(sizeof(rwkv_native::Api)),
              path, " was built for another version of the bindings");
  g_api = a;
  return a->level;
}

std::string isa() { return api().level; }

DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

DType dtype_of(at::ScalarType t) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "dtype must be float32, bfloat16 or float16");
  return t == at::kFloat ? DType::kF32 : t == at::kBFloat16 ? DType::kBF16 : DType::kF16;
}

void check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

void check_x(const at::Tensor& x, int64_t K) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.size(0) >= 1, "x must be [B, K] with B >= 1 and K = ", K,
              ", got ", x.sizes());
}

const uint16_t* u16(const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); }

// Optional fp16 column scales [K] -> pointer (nullptr when absent).
const uint16_t* col_scales_ptr(const std::optional<at::Tensor>& cs, int64_t K) {
  if (!cs.has_value()) return nullptr;
  check_cpu_contiguous(*cs, "col_scales");
  TORCH_CHECK(cs->dim() == 1 && cs->size(0) == K && cs->scalar_type() == at::kHalf, "col_scales must be float16 [", K,
              "]");
  return u16(*cs);
}

at::Tensor gemv_dense(const at::Tensor& x, const at::Tensor& w) {
  check_cpu_contiguous(w, "w");
  TORCH_CHECK(w.dim() == 2, "w must be [N, K]");
  const int64_t N = w.size(0), K = w.size(1), B = x.size(0);
  check_x(x, K);
  const DType wt = dtype_of(w, "w"), xt = dtype_of(x, "x");
  at::Tensor y = at::empty({B, N}, x.options());
  api().gemv_dense(w.data_ptr(), wt, N, K, x.data_ptr(), xt, B, y.data_ptr());
  return y;
}

at::Tensor gemv_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const std::optional<at::Tensor>& col_scales) {
  check_cpu_contiguous(q, "qweight");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "qweight must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), B = x.size(0);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.scalar_type() == at::kHalf,
              "scales must be float16 [N, G]");
  const int64_t G = scales.size(1);
  TORCH_CHECK(G >= 1 && K % G == 0, "the number of groups must divide K");
  TORCH_CHECK(G == 1 || (K / G) % 32 == 0, "gemv_q8: group size must be a multiple of 32 (or one group per row)");
  check_x(x, K);
  const DType xt = dtype_of(x, "x");
  at::Tensor y = at::empty({B, N}, x.options());
  api().gemv_q8(q.data_ptr<int8_t>(), u16(scales), col_scales_ptr(col_scales, K), N, K, G,
                       x.data_ptr(), xt, B, y.data_ptr());
  return y;
}

void check_q4(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& biases) {
  check_cpu_contiguous(q, "qweight");
  check_cpu_contiguous(scales, "scales");
  check_cpu_contiguous(biases, "biases");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "qweight must be uint8 [N, K/2]");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == q.size(0) && scales.scalar_type() == at::kHalf,
              "scales must be float16 [N, G]");
  TORCH_CHECK(biases.sizes() == scales.sizes() && biases.scalar_type() == at::kHalf, "biases must be float16 [N, G]");
  const int64_t K = 2 * q.size(1), G = scales.size(1);
  TORCH_CHECK(G >= 1 && K % G == 0, "the number of groups must divide K");
  const int64_t gs = K / G;
  TORCH_CHECK(gs == 32 || gs == 64 || gs == 128, "group size must be 32, 64 or 128");
}

at::Tensor gemv_q4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& biases,
                   const std::optional<at::Tensor>& col_scales) {
  check_q4(q, scales, biases);
  const int64_t N = q.size(0), K = 2 * q.size(1), G = scales.size(1), B = x.size(0);
  check_x(x, K);
  const DType xt = dtype_of(x, "x");
  at::Tensor y = at::empty({B, N}, x.options());
  api().gemv_q4(q.data_ptr<uint8_t>(), u16(scales), u16(biases), col_scales_ptr(col_scales, K), N, K, G,
                       x.data_ptr(), xt, B, y.data_ptr());
  return y;
}

// K-quant blocks [N, K / 256 * bytes of type t] (uint8) of a weight [N, K] -> the type.
rwkv_native::KType check_kq(const at::Tensor& blocks, int64_t type, int64_t K) {
  check_cpu_contiguous(blocks, "blocks");
  TORCH_CHECK(rwkv_native::is_ktype(type), "ggml type must be 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K), got ", type);
  const auto t = static_cast<rwkv_native::KType>(type);
  TORCH_CHECK(K > 0 && K % 256 == 0, "K-quant rows are whole blocks of 256 columns, got K = ", K);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(1) == K / 256 * rwkv_native::ktype_bytes(t),
              "blocks must be uint8 [N, ", K / 256 * rwkv_native::ktype_bytes(t), "] for K = ", K, ", got ", blocks.sizes());
  return t;
}

at::Tensor gemv_kq(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t K,
                   const std::optional<at::Tensor>& col_scales) {
  const auto t = check_kq(blocks, type, K);
  check_x(x, K);
  const int64_t N = blocks.size(0), B = x.size(0);
  at::Tensor y = at::empty({B, N}, x.options());
  api().gemv_kq(t, blocks.data_ptr<uint8_t>(), col_scales_ptr(col_scales, K), N, K, x.data_ptr(), dtype_of(x, "x"), B,
                y.data_ptr());
  return y;
}

int64_t kq_x_group(int64_t type, int64_t B) {
  TORCH_CHECK(rwkv_native::is_ktype(type), "ggml type must be 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K), got ", type);
  return api().kq_x_group(static_cast<rwkv_native::KType>(type), B);
}

void check_rows(int64_t r0, int64_t r1, int64_t N) {
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= N, "bad row range [", r0, ", ", r1, ") for ", N, " rows");
}

// A caller-provided `out` (contiguous [r1 - r0, K] of `dtype`) avoids a fresh allocation per tile.
at::Tensor tile_out(const at::Tensor& q, int64_t rows, int64_t K, at::ScalarType dtype,
                    const std::optional<at::Tensor>& out) {
  if (!out.has_value()) return at::empty({rows, K}, q.options().dtype(dtype));
  const at::Tensor& o = *out;
  check_cpu_contiguous(o, "out");
  TORCH_CHECK(o.scalar_type() == dtype && o.dim() == 2 && o.size(0) == rows && o.size(1) == K,
              "out must be a [", rows, ", ", K, "] tensor of ", dtype, ", got ", o.sizes(), " ", o.scalar_type());
  return o;
}

at::Tensor dequant_q8(const at::Tensor& q, const at::Tensor& scales, int64_t r0, int64_t r1, at::ScalarType dtype,
                      const std::optional<at::Tensor>& out_opt) {
  check_cpu_contiguous(q, "qweight");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "qweight must be int8 [N, K]");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == q.size(0) && scales.scalar_type() == at::kHalf,
              "scales must be float16 [N, G]");
  const int64_t K = q.size(1), G = scales.size(1);
  TORCH_CHECK(G >= 1 && K % G == 0, "the number of groups must divide K");
  check_rows(r0, r1, q.size(0));
  at::Tensor out = tile_out(q, r1 - r0, K, dtype, out_opt);
  api().dequant_q8(q.data_ptr<int8_t>(), u16(scales), K, G, r0, r1, out.data_ptr(),
                          dtype_of(dtype));
  return out;
}

at::Tensor dequant_q4(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& biases, int64_t r0, int64_t r1,
                      at::ScalarType dtype, const std::optional<at::Tensor>& out_opt) {
  check_q4(q, scales, biases);
  const int64_t K = 2 * q.size(1), G = scales.size(1);
  check_rows(r0, r1, q.size(0));
  at::Tensor out = tile_out(q, r1 - r0, K, dtype, out_opt);
  api().dequant_q4(q.data_ptr<uint8_t>(), u16(scales), u16(biases), K, G, r0, r1, out.data_ptr(),
                          dtype_of(dtype));
  return out;
}

at::Tensor dequant_kq(const at::Tensor& blocks, int64_t type, int64_t K, int64_t r0, int64_t r1, at::ScalarType dtype,
                      const std::optional<at::Tensor>& out_opt) {
  const auto t = check_kq(blocks, type, K);
  check_rows(r0, r1, blocks.size(0));
  at::Tensor out = tile_out(blocks, r1 - r0, K, dtype, out_opt);
  api().dequant_kq(t, blocks.data_ptr<uint8_t>(), K, r0, r1, out.data_ptr(), dtype_of(dtype));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q4(const at::Tensor& w, int64_t group_size,
                                                          const std::vector<double>& shrinks,
                                                          const std::optional<at::Tensor>& col_scales) {
  check_cpu_contiguous(w, "weight");
  TORCH_CHECK(w.dim() == 2, "weight must be [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128, "group size must be 32, 64 or 128");
  TORCH_CHECK(K % group_size == 0, "group size must divide K");
  TORCH_CHECK(!shrinks.empty(), "at least one shrink factor");
  const DType wt = dtype_of(w, "weight");
  std::vector<float> sh(shrinks.begin(), shrinks.end());
  at::Tensor q = at::empty({N, K / 2}, w.options().dtype(at::kByte));
  at::Tensor s = at::empty({N, K / group_size}, w.options().dtype(at::kHalf));
  at::Tensor z = at::empty({N, K / group_size}, w.options().dtype(at::kHalf));
  api().quantize_q4(w.data_ptr(), wt, col_scales_ptr(col_scales, K), N, K, group_size, sh.data(), static_cast<int>(sh.size()),
                           q.data_ptr<uint8_t>(), static_cast<uint16_t*>(s.data_ptr()),
                           static_cast<uint16_t*>(z.data_ptr()));
  return {q, s, z};
}

// quantize.h: the int8 quantizer and column scales.
at::Tensor column_scales(const at::Tensor& w) {
  check_cpu_contiguous(w, "weight");
  TORCH_CHECK(w.dim() == 2 && w.numel() > 0, "weight must be a non-empty [N, K]");
  at::Tensor out = at::empty({w.size(1)}, w.options().dtype(at::kHalf));
  api().column_scales(w.data_ptr(), dtype_of(w, "weight"), w.size(0), w.size(1),
                             static_cast<uint16_t*>(out.data_ptr()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_q8(const at::Tensor& w, std::optional<int64_t> group_size,
                                               const std::optional<at::Tensor>& col_scales) {
  check_cpu_contiguous(w, "weight");
  TORCH_CHECK(w.dim() == 2, "weight must be [N, K]");
  const int64_t N = w.size(0), K = w.size(1), gs = group_size.value_or(K);
  TORCH_CHECK(gs > 0 && K % gs == 0, "group size must divide K");
  at::Tensor q = at::empty({N, K}, w.options().dtype(at::kChar));
  at::Tensor s = at::empty({N, K / gs}, w.options().dtype(at::kHalf));
  api().quantize_q8(w.data_ptr(), dtype_of(w, "weight"), col_scales_ptr(col_scales, K), N, K, gs,
                           q.data_ptr<int8_t>(), static_cast<uint16_t*>(s.data_ptr()));
  return {q, s};
}

// step.h: the RWKV-7 WKV over a sequence. r, k, v, w (the decays), a, b [B, T, H, N], state [B, H, N, N],
// all fp32 contiguous on the CPU -> (y [B, T, H, N], new state); the inputs are not modified.
std::tuple<at::Tensor, at::Tensor> wkv7(const at::Tensor& r, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& w, const at::Tensor& a, const at::Tensor& b,
                                        const at::Tensor& state) {
  TORCH_CHECK(r.dim() == 4 && r.size(0) >= 1 && r.size(1) >= 1, "wkv7: r must be [B, T, H, N] with B, T >= 1");
  const int64_t B = r.size(0), T = r.size(1), H = r.size(2), N = r.size(3);
  const char* names[] = {"r", "k", "v", "w", "a", "b"};
  const at::Tensor* ts[] = {&r, &k, &v, &w, &a, &b};
  for (int i = 0; i < 6; ++i) {
    check_cpu_contiguous(*ts[i], names[i]);
    TORCH_CHECK(ts[i]->sizes() == r.sizes() && ts[i]->scalar_type() == at::kFloat, "wkv7: ", names[i],
                " must be float32 of r's shape ", r.sizes());
  }
  check_cpu_contiguous(state, "state");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.size(0) == B && state.size(1) == H &&
                  state.size(2) == N && state.size(3) == N,
              "wkv7: state must be float32 [B, H, N, N] = [", B, ", ", H, ", ", N, ", ", N, "]");
  at::Tensor y = at::empty(r.sizes(), r.options());
  at::Tensor out = at::empty(state.sizes(), state.options());
  api().wkv7_sequence(B, T, H, N, r.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                      w.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), state.data_ptr<float>(),
                      out.data_ptr<float>(), y.data_ptr<float>());
  return {y, out};
}

// --- the fused decode step (step.h) ---------------------------------------------------------

// A model's parameters for rwkv_native::decode_step, built once from Python (models/native_step.py)
// and holding references to the tensors it points into.
class DecodePlan {
 public:
  // blocks: one dict per block, name -> fp32 tensor (a LoRA matrix: fp32, bf16 or fp16), or
  // name -> tuple for a linear: (weight,) dense;
  // (qweight int8, scales, None, col_scales) int8; (qweight uint8, scales, biases, col_scales) int4;
  // (blocks uint8, ggml type id, None, col_scales) K-quant (gemv_kq).
  DecodePlan(int64_t family, bool gated, int64_t C, int64_t A, int64_t H, int64_t N, int64_t F, int64_t V,
             at::ScalarType dtype, int64_t rescale_every, const std::vector<py::dict>& blocks, const py::dict& out) {
    TORCH_CHECK(family == 4 || family == 5 || family == 6 || family == 7, "family must be 4, 5, 6 or 7");
    TORCH_CHECK(!blocks.empty(), "a model has at least one block");
    TORCH_CHECK(family == 4 || (H > 0 && H * N == A), "heads of size N must make A");
    TORCH_CHECK(family != 7 || A == C, "RWKV-7 needs A == C");
    p_.family = static_cast<int>(family);
    p_.gated = gated;
    p_.C = C, p_.A = A, p_.H = H, p_.N = N, p_.F = F;
    p_.dt = dtype_of(dtype);
    p_.rescale_every = static_cast<int>(rescale_every);
    for (const py::dict& d : blocks) p_.blocks.push_back(parse_block(d, static_cast<int64_t>(p_.blocks.size())));
    p_.ln_out_w = vec(out, "ln_out_w", C), p_.ln_out_b = vec(out, "ln_out_b", C);
    p_.head = linear(out, "head", V, C);
  }

  int64_t n_layer() const { return static_cast<int64_t>(p_.blocks.size()); }

  // x [B, C] (one token per sequence) or [B, T, C] (T tokens per sequence) fp32, in: the embedded
  // tokens; out: the residual stream after the last block. state_in / state_out: the State's
  // fields in order, each [B, L, ...] fp32 contiguous (the state before the first token / after
  // the last). Returns the logits fp32: [B, T, V] with all_logits (x 3-D), else [B, V] of each
  // sequence's last token.
  at::Tensor step(const at::Tensor& x, const std::vector<at::Tensor>& state_in,
                  const std::vector<at::Tensor>& state_out, bool all_logits) {
    check_cpu_contiguous(x, "x");
    TORCH_CHECK(x.scalar_type() == at::kFloat && (x.dim() == 2 || x.dim() == 3) && x.size(-1) == p_.C,
                "x must be float32 [B, ", p_.C, "] or [B, T, ", p_.C, "]");
    const int64_t B = x.size(0), T = x.dim() == 3 ? x.size(1) : 1, L = n_layer();
    TORCH_CHECK(B > 0 && T > 0, "x has no tokens");
    const std::vector<int64_t> widths = p_.family == 4 ? std::vector<int64_t>{p_.C, p_.A, p_.A, p_.A, p_.C}
                                                       : std::vector<int64_t>{p_.C, p_.H * p_.N * p_.N, p_.C};
    TORCH_CHECK(state_in.size() == widths.size() && state_out.size() == widths.size(), "the state has ",
                widths.size(), " fields");
    rwkv_native::StateRef st;
    for (size_t f = 0; f < widths.size(); ++f) {
      for (const at::Tensor* t : {&state_in[f], &state_out[f]}) {
        check_cpu_contiguous(*t, "state");
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() >= 2 && t->size(0) == B && t->size(1) == L &&
                        t->numel() == B * L * widths[f],
                    "state field ", f, " must be float32 [B, L, ...] with ", widths[f], " values per layer");
      }
      st.in[f] = state_in[f].data_ptr<float>();
      st.out[f] = state_out[f].data_ptr<float>();
    }
    float* xp = x.data_ptr<float>();
    at::Tensor logits = all_logits && x.dim() == 3 ? at::empty({B, T, p_.head.N}, x.options())
                                                   : at::empty({B, p_.head.N}, x.options());
    float* lp = logits.data_ptr<float>();
    {
      py::gil_scoped_release nogil;
      api().decode_step(p_, B, T, xp, st, lp, all_logits && x.dim() == 3);
    }
    return logits;
  }

 private:
  rwkv_native::ModelParams p_;
  std::vector<at::Tensor> keep_;  // every tensor the plan points into

  const at::Tensor& hold(const at::Tensor& t, const std::string& what) {
    check_cpu_contiguous(t, what.c_str());
    keep_.push_back(t);
    return keep_.back();
  }

  // An fp32 parameter of `numel` values (0: any), or nullptr when absent and not required.
  const float* vec(const py::dict& d, const char* key, int64_t numel, bool required = true) {
    if (!d.contains(key) || d[key].is_none()) {
      TORCH_CHECK(!required, "decode plan: block parameter '", key, "' is missing");
      return nullptr;
    }
    const at::Tensor t = hold(d[key].cast<at::Tensor>(), key);
    TORCH_CHECK(t.scalar_type() == at::kFloat, "decode plan: '", key, "' must be float32");
    TORCH_CHECK(numel == 0 || t.numel() == numel, "decode plan: '", key, "' has ", t.numel(), " values, expected ",
                numel);
    return t.data_ptr<float>();
  }

  // A LoRA matrix [rows, cols] (any leading shape of that many values) in fp32, bf16 or fp16, as the model holds it.
  rwkv_native::LoraMatrix lora(const py::dict& d, const char* key, int64_t rows, int64_t cols) {
    TORCH_CHECK(d.contains(key) && !d[key].is_none(), "decode plan: block parameter '", key, "' is missing");
    const at::Tensor t = hold(d[key].cast<at::Tensor>(), key);
    TORCH_CHECK(t.numel() == rows * cols, "decode plan: '", key, "' has ", t.numel(), " values, expected ", rows * cols);
    return {t.data_ptr(), dtype_of(t, key), rows, cols};
  }

  rwkv_native::Linear linear(const py::dict& d, const char* key, int64_t N, int64_t K, bool required = true) {
    using rwkv_native::Linear;
    Linear l;
    if (!d.contains(key) || d[key].is_none()) {
      TORCH_CHECK(!required, "decode plan: linear '", key, "' is missing");
      return l;
    }
    const py::tuple parts = d[key].cast<py::tuple>();
    TORCH_CHECK(parts.size() >= 1, "decode plan: linear '", key, "' is empty");
    const at::Tensor w = hold(parts[0].cast<at::Tensor>(), key);
    auto part = [&](size_t i) -> std::optional<at::Tensor> {
      if (parts.size() <= i || parts[i].is_none()) return std::nullopt;
      return hold(parts[i].cast<at::Tensor>(), key);
    };
    l.N = N, l.K = K;
    if (parts.size() >= 2 && py::isinstance<py::int_>(parts[1])) {
      l.kind = Linear::Kind::kKQuant;
      l.kt = check_kq(w, parts[1].cast<int64_t>(), K);
      TORCH_CHECK(w.size(0) == N, "decode plan: '", key, "' must have ", N, " rows of blocks");
      l.kq = w.data_ptr<uint8_t>();
    } else if (w.scalar_type() == at::kChar) {
      const auto s = part(1);
      TORCH_CHECK(s && s->scalar_type() == at::kHalf && s->dim() == 2 && s->size(0) == N, "decode plan: '", key,
                  "' int8 scales must be float16 [N, G]");
      TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == K, "decode plan: '", key, "' must be [", N, ", ", K, "]");
      l.kind = Linear::Kind::kQ8;
      l.q8 = w.data_ptr<int8_t>();
      l.s8 = u16(*s);
      l.G = s->size(1);
      TORCH_CHECK(K % l.G == 0 && (l.G == 1 || (K / l.G) % 32 == 0), "decode plan: '", key, "' group size unsupported");
    } else if (w.scalar_type() == at::kByte) {
      const auto s = part(1), z = part(2);
      TORCH_CHECK(s && z && s->scalar_type() == at::kHalf && z->sizes() == s->sizes() && s->size(0) == N,
                  "decode plan: '", key, "' int4 scales and biases must be float16 [N, G]");
      TORCH_CHECK(w.dim() == 2 && w.size(0) == N && 2 * w.size(1) == K, "decode plan: '", key, "' must be [", N,
                  ", ", K / 2, "] packed");
      l.kind = Linear::Kind::kQ4;
      l.q4 = w.data_ptr<uint8_t>();
      l.s4 = u16(*s), l.z4 = u16(*z);
      l.G = s->size(1);
      const int64_t gs = K % l.G == 0 ? K / l.G : 0;
      TORCH_CHECK(gs == 32 || gs == 64 || gs == 128, "decode plan: '", key, "' group size must be 32, 64 or 128");
    } else {
      TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == K, "decode plan: '", key, "' must be [", N, ", ", K, "]");
      l.kind = Linear::Kind::kDense;
      l.w = w.data_ptr();
      l.wt = dtype_of(w, key);
    }
    if (l.kind != Linear::Kind::kDense) {
      const auto cs = part(3);
      l.cs = cs ? col_scales_ptr(cs, K) : nullptr;
    }
    return l;
  }

  rwkv_native::BlockParams parse_block(const py::dict& d, int64_t layer) {
    const int64_t C = p_.C, A = p_.A, F = p_.F, H = p_.H, N = p_.N;
    rwkv_native::BlockParams q;
    q.ln1_w = vec(d, "ln1_w", C), q.ln1_b = vec(d, "ln1_b", C);
    q.ln2_w = vec(d, "ln2_w", C), q.ln2_b = vec(d, "ln2_b", C);
    q.ffn_mix_k = vec(d, "ffn_mix_k", C);
    q.ffn_k = linear(d, "ffn_k", F, C);
    q.ffn_v = linear(d, "ffn_v", C, F);
    if (p_.family != 7) {
      q.ffn_mix_r = vec(d, "ffn_mix_r", C);
      q.ffn_r = linear(d, "ffn_r", C, C);
    }
    q.att_r = linear(d, "att_r", A, C);
    q.att_k = linear(d, "att_k", A, C);
    q.att_v = linear(d, "att_v", A, C);
    q.att_o = linear(d, "att_o", C, A);
    if (p_.family == 4) {
      for (auto [dst, key] : {std::pair{&q.mix_k, "mix_k"}, {&q.mix_v, "mix_v"}, {&q.mix_r, "mix_r"}}) *dst = vec(d, key, C);
      q.decay = vec(d, "decay", A), q.bonus = vec(d, "bonus", A);
      return q;
    }
    q.lnx_w = vec(d, "lnx_w", A), q.lnx_b = vec(d, "lnx_b", A);
    const bool gated = p_.family == 6 || (p_.family == 5 && p_.gated);
    if (gated) q.att_g = linear(d, "att_g", A, C);
    for (auto [dst, key] : {std::pair{&q.mix_r, "mix_r"}, {&q.mix_k, "mix_k"}, {&q.mix_v, "mix_v"}}) *dst = vec(d, key, C);
    if (gated || p_.family == 7) q.mix_g = vec(d, "mix_g", C);
    if (p_.family == 5) {
      q.decay = vec(d, "decay", H * N), q.bonus = vec(d, "bonus", H * N);
    } else if (p_.family == 6) {
      q.mix_x = vec(d, "mix_x", C), q.mix_w = vec(d, "mix_w", C);
      q.bonus = vec(d, "bonus", H * N);
      q.decay_base = vec(d, "decay_base", A);
      const int64_t d_mix = rank(d, "maa_w1", C), d_decay = rank(d, "decay_w1", C);
      TORCH_CHECK(d_mix % 5 == 0, "decode plan: 'maa_w1' must be [C, 5 D]");
      q.maa_w1 = lora(d, "maa_w1", C, d_mix), q.maa_w2 = lora(d, "maa_w2", d_mix, C);
      q.decay_w1 = lora(d, "decay_w1", C, d_decay), q.decay_w2 = lora(d, "decay_w2", d_decay, A);
    } else {
      q.mix_w = vec(d, "mix_w", C), q.mix_a = vec(d, "mix_a", C);
      const int64_t d_decay = rank(d, "w1", C), d_iclr = rank(d, "a1", C), d_gate = rank(d, "g1", C);
      q.w0 = vec(d, "w0", C), q.w1 = lora(d, "w1", C, d_decay), q.w2 = lora(d, "w2", d_decay, C);
      q.a0 = vec(d, "a0", C), q.a1 = lora(d, "a1", C, d_iclr), q.a2 = lora(d, "a2", d_iclr, C);
      q.g1 = lora(d, "g1", C, d_gate), q.g2 = lora(d, "g2", d_gate, C);
      if (layer > 0) {
        const int64_t d_value = rank(d, "v1", C);
        q.v0 = vec(d, "v0", C), q.v1 = lora(d, "v1", C, d_value), q.v2 = lora(d, "v2", d_value, C);
      }
      q.k_k = vec(d, "k_k", C), q.k_a = vec(d, "k_a", C), q.r_k = vec(d, "r_k", C);
    }
    return q;
  }

  // The rank D of a LoRA matrix [rows, D].
  static int64_t rank(const py::dict& d, const char* key, int64_t rows) {
    TORCH_CHECK(d.contains(key), "decode plan: block parameter '", key, "' is missing");
    const at::Tensor t = d[key].cast<at::Tensor>();
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) > 0, "decode plan: '", key, "' must be [", rows, ", D]");
    return t.size(1);
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL (arguments are converted before, results after): the
  // serving engine reads prompt pieces on one thread while another decodes, and a K-quant
  // prefill GEMV of a 256-token piece runs for tens of milliseconds.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "rwkv_engine native CPU kernels (AVX2/FMA/F16C GEMV and dequantization)";
  m.def("use_kernels", &use_kernels, py::arg("path"),
        "load the kernel library at `path` (built for one ISA level) and use it from now on; returns its level");
  m.def("isa", &isa, "the ISA level of the kernels in use");
  m.def("gemv_dense", &gemv_dense, nogil, "y[B,N] = x[B,K] @ w[N,K]^T, w fp32/bf16/fp16; y in x's dtype");
  m.def("gemv_q8", &gemv_q8, nogil,
        "y = x @ (qweight * scales * col_scales)^T; qweight int8 [N,K], scales fp16 [N,G], col_scales fp16 [K] or None",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("col_scales") = py::none());
  m.def("gemv_q4", &gemv_q4, nogil,
        "y = x @ ((codes * scales + biases) * col_scales)^T; qweight uint8 [N,K/2], scales/biases fp16 [N,G]",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("biases"), py::arg("col_scales") = py::none());
  m.def("dequant_q8", &dequant_q8, nogil, "rows [r0, r1) of an int8 weight as a dense tile of `dtype` (into `out` if given)",
        py::arg("qweight"), py::arg("scales"), py::arg("r0"), py::arg("r1"), py::arg("dtype"), py::arg("out") = py::none());
  m.def("dequant_q4", &dequant_q4, nogil, "rows [r0, r1) of an int4 weight as a dense tile of `dtype` (into `out` if given)",
        py::arg("qweight"), py::arg("scales"), py::arg("biases"), py::arg("r0"), py::arg("r1"), py::arg("dtype"),
        py::arg("out") = py::none());
  m.def("gemv_kq", &gemv_kq, nogil,
        "y = x @ (W * col_scales)^T for W [N, K] in ggml K-quant blocks uint8 [N, K/256*bytes] of type 12 / 13 / 14 "
        "(Q4_K / Q5_K / Q6_K)",
        py::arg("x"), py::arg("blocks"), py::arg("type"), py::arg("K"), py::arg("col_scales") = py::none());
  m.def("kq_x_group", &kq_x_group,
        "columns per int8 step of x in gemv_kq of B rows of ggml type `type` (32, or 256 for prefill on the AVX2 level)",
        py::arg("type"), py::arg("B"));
  m.def("dequant_kq", &dequant_kq, nogil,
        "rows [r0, r1) of a K-quant weight [N, K] as a dense tile of `dtype` (into `out` if given): ggml's values",
        py::arg("blocks"), py::arg("type"), py::arg("K"), py::arg("r0"), py::arg("r1"), py::arg("dtype"),
        py::arg("out") = py::none());
  m.def("quantize_q4", &quantize_q4, nogil,
        "(qweight, scales, biases) of primitives.quantize_int4(w, group_size) with the given range shrink factors",
        py::arg("weight"), py::arg("group_size"), py::arg("shrinks"), py::arg("col_scales") = py::none());
  m.def("column_scales", &column_scales, nogil, "fp16 [K] of primitives.column_scales(w)", py::arg("weight"));
  m.def("quantize_q8", &quantize_q8, nogil, "(qweight, scales) of primitives.quantize_int8(w, group_size, col_scales)",
        py::arg("weight"), py::arg("group_size") = py::none(), py::arg("col_scales") = py::none());
  m.def("wkv7", &wkv7, nogil,
        "RWKV-7 WKV over a sequence, token by token: (y [B,T,H,N], new state [B,H,N,N]) from r, k, v, w = exp(log_w), "
        "a, b [B,T,H,N] and state, all fp32 (kernels/wkv7.py wkv7_naive)",
        py::arg("r"), py::arg("k"), py::arg("v"), py::arg("w"), py::arg("a"), py::arg("b"), py::arg("state"));
  py::class_<DecodePlan>(m, "DecodePlan", "a forward of a few tokens per sequence through every block of a model (see models/native_step.py)")
      .def(py::init<int64_t, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, at::ScalarType, int64_t,
                    const std::vector<py::dict>&, const py::dict&>(),
           py::arg("family"), py::arg("gated"), py::arg("C"), py::arg("A"), py::arg("H"), py::arg("N"), py::arg("F"),
           py::arg("V"), py::arg("dtype"), py::arg("rescale_every"), py::arg("blocks"), py::arg("out"))
      .def_property_readonly("n_layer", &DecodePlan::n_layer)
      .def("step", &DecodePlan::step,
           "x [B, C] or [B, T, C] fp32 in place; state_in -> state_out (field lists); returns logits [B, V] "
           "(each sequence's last token) or, all_logits with x [B, T, C], [B, T, V]",
           py::arg("x"), py::arg("state_in"), py::arg("state_out"), py::arg("all_logits") = false);
}
