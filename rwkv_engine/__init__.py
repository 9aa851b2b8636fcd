"""rwkv-engine: an inference engine for RWKV language models.

    import rwkv_engine
    model = rwkv_engine.load("model.pth", dtype="bf16")
    logits, state = model.forward([1, 2, 3])
    vectors = rwkv_engine.embed(model, ["some text", "another"])   # [2, D]: docs/models.md

Names are imported lazily so that `rwkv-engine --help` and small tools start fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "RWKVEngineError": "rwkv_engine.errors",
    "CheckpointError": "rwkv_engine.errors",
    "UnsupportedModelError": "rwkv_engine.errors",
    "InputError": "rwkv_engine.errors",
    "StateError": "rwkv_engine.errors",
    "ModelOutputError": "rwkv_engine.errors",
    "ModelConfig": "rwkv_engine.config",
    "State": "rwkv_engine.state",
    "load_state": "rwkv_engine.state",
    "load": "rwkv_engine.loading",
    "RWKV": "rwkv_engine.models",
    "WorldTokenizer": "rwkv_engine.tokenizer",
    "load_tokenizer": "rwkv_engine.tokenizer",
    "IncrementalDetokenizer": "rwkv_engine.tokenizer",
    "SamplingParams": "rwkv_engine.sampling",
    "generate": "rwkv_engine.generation",
    "embed": "rwkv_engine.embedding",
    "load_reranker": "rwkv_engine.embedding",
    "Reranker": "rwkv_engine.embedding",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rwkv_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
