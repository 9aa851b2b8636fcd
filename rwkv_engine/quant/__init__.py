"""Weight quantization: primitives -> quantized linear modules -> scheme registry.

    from rwkv_engine.quant import quantize_model
    quantize_model(model, "q4")          # every big nn.Linear -> Int4Linear (head -> Int8Linear)

* `primitives`: quantize / dequantize / pack / unpack for int8 and int4 (the plain reference).
* `linear`: `Int8Linear`, `Int4Linear`, `DenseLinear` (drop-in for `nn.Linear(bias=False)`, with
  native CPU GEMV kernels for decode and dequantized-tile GEMMs for prefill).
* `ggml_quants`: ggml's block types (the GGUF / rwkv.cpp layouts) and their dequantization.
* `kquant_linear`: `KQuantLinear`, a weight in ggml's K-quant blocks (Q4_K / Q5_K / Q6_K) run
  from those bytes (a GGUF's tensors as they are, or our own quantizer's).
* `schemes`: `q0f32`, `q0bf16`, `q0f16`, `q8`, `q4` (+ MLC-LLM names) and `quantize_model`.
"""

from rwkv_engine.quant.kquant_linear import KQuantLinear
from rwkv_engine.quant.linear import DenseLinear, Int4Linear, Int8Linear
from rwkv_engine.quant.schemes import SCHEMES, Scheme, get_scheme, quantize_model, scheme_names

__all__ = [
    "DenseLinear",
    "Int4Linear",
    "Int8Linear",
    "KQuantLinear",
    "SCHEMES",
    "Scheme",
    "get_scheme",
    "quantize_model",
    "scheme_names",
]
