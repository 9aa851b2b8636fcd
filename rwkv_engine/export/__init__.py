"""Export to ExecuTorch (phones, edge devices) and run exported programs.

    from rwkv_engine.export import export_program
    model = rwkv_engine.load("model.pth")                       # fp32
    export_program(model, "model.pte", quantization="q4", prefill_len=32)
    pte = rwkv_engine.load("model.pte")                         # a ProgramModel: forward(tokens, state)

program.py builds the program (methods, state tensors, metadata, torchao quantization);
runtime.py runs one through `executorch.runtime` with the engine's model contract.
ExecuTorch and torchao are the optional extra `[export]`.
"""

from .program import BACKENDS, DEFAULT_PREFILL_LEN, QUANTIZATIONS, ExportReport, export_program
from .runtime import ProgramModel, is_program

__all__ = [
    "BACKENDS",
    "DEFAULT_PREFILL_LEN",
    "QUANTIZATIONS",
    "ExportReport",
    "ProgramModel",
    "export_program",
    "is_program",
]
