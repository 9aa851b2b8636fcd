// Python bindings of the native kernels: check the tensors, allocate the output, call kernels.cpp.
// Only light torch headers (the full torch/extension.h takes over a minute to compile).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

using rwkv_native::DType;

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
  rwkv_native::gemv_dense(w.data_ptr(), wt, N, K, x.data_ptr(), xt, B, y.data_ptr());
  return y;
}

at::Tensor gemv_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const std::optional<at::Tensor>& col_scales) {
  check_cpu_contiguous(q, "qweight");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "qweight must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), B = x.size(0);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.scalar_type() == at::kFloat,
              "scales must be float32 [N, G]");
  const int64_t G = scales.size(1);
  TORCH_CHECK(G >= 1 && K % G == 0, "the number of groups must divide K");
  TORCH_CHECK(G == 1 || (K / G) % 64 == 0, "gemv_q8: group size must be a multiple of 64 (or one group per row)");
  check_x(x, K);
  const DType xt = dtype_of(x, "x");
  at::Tensor y = at::empty({B, N}, x.options());
  rwkv_native::gemv_q8(q.data_ptr<int8_t>(), scales.data_ptr<float>(), col_scales_ptr(col_scales, K), N, K, G,
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
  rwkv_native::gemv_q4(q.data_ptr<uint8_t>(), u16(scales), u16(biases), col_scales_ptr(col_scales, K), N, K, G,
                       x.data_ptr(), xt, B, y.data_ptr());
  return y;
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
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == q.size(0) && scales.scalar_type() == at::kFloat,
              "scales must be float32 [N, G]");
  const int64_t K = q.size(1), G = scales.size(1);
  TORCH_CHECK(G >= 1 && K % G == 0, "the number of groups must divide K");
  check_rows(r0, r1, q.size(0));
  at::Tensor out = tile_out(q, r1 - r0, K, dtype, out_opt);
  rwkv_native::dequant_q8(q.data_ptr<int8_t>(), scales.data_ptr<float>(), K, G, r0, r1, out.data_ptr(),
                          dtype_of(dtype));
  return out;
}

at::Tensor dequant_q4(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& biases, int64_t r0, int64_t r1,
                      at::ScalarType dtype, const std::optional<at::Tensor>& out_opt) {
  check_q4(q, scales, biases);
  const int64_t K = 2 * q.size(1), G = scales.size(1);
  check_rows(r0, r1, q.size(0));
  at::Tensor out = tile_out(q, r1 - r0, K, dtype, out_opt);
  rwkv_native::dequant_q4(q.data_ptr<uint8_t>(), u16(scales), u16(biases), K, G, r0, r1, out.data_ptr(),
                          dtype_of(dtype));
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
  rwkv_native::quantize_q4(w.data_ptr(), wt, col_scales_ptr(col_scales, K), N, K, group_size, sh.data(), static_cast<int>(sh.size()),
                           q.data_ptr<uint8_t>(), static_cast<uint16_t*>(s.data_ptr()),
                           static_cast<uint16_t*>(z.data_ptr()));
  return {q, s, z};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rwkv_engine native CPU kernels (AVX2/FMA/F16C GEMV and dequantization)";
  m.def("gemv_dense", &gemv_dense, "y[B,N] = x[B,K] @ w[N,K]^T, w fp32/bf16/fp16; y in x's dtype");
  m.def("gemv_q8", &gemv_q8,
        "y = x @ (qweight * scales * col_scales)^T; qweight int8 [N,K], scales fp32 [N,G], col_scales fp16 [K] or None",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("col_scales") = py::none());
  m.def("gemv_q4", &gemv_q4,
        "y = x @ ((codes * scales + biases) * col_scales)^T; qweight uint8 [N,K/2], scales/biases fp16 [N,G]",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("biases"), py::arg("col_scales") = py::none());
  m.def("dequant_q8", &dequant_q8, "rows [r0, r1) of an int8 weight as a dense tile of `dtype` (into `out` if given)",
        py::arg("qweight"), py::arg("scales"), py::arg("r0"), py::arg("r1"), py::arg("dtype"), py::arg("out") = py::none());
  m.def("dequant_q4", &dequant_q4, "rows [r0, r1) of an int4 weight as a dense tile of `dtype` (into `out` if given)",
        py::arg("qweight"), py::arg("scales"), py::arg("biases"), py::arg("r0"), py::arg("r1"), py::arg("dtype"),
        py::arg("out") = py::none());
  m.def("quantize_q4", &quantize_q4,
        "(qweight, scales, biases) of primitives.quantize_int4(w, group_size) with the given range shrink factors",
        py::arg("weight"), py::arg("group_size"), py::arg("shrinks"), py::arg("col_scales") = py::none());
}
