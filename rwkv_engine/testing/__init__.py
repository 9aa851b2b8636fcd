"""Test support: what the tests and benchmarks build their inputs from and compare with.

Nothing here is used by the engine at run time, and nothing downloads anything:

* `checkpoints`: random-weight RWKV checkpoints in the real file formats (`random_state_dict`,
  `save_pth`, `save_safetensors`, `save_hf_dir`, ...), EmbeddingRWKV embedders and rerankers in
  rwkv_emb's layout (`random_embedder_state_dict`, `random_reranker_state_dict`);
* `ggml_writers`: GGUF and rwkv.cpp files written the way their own converters write them;
* `corpus`: a deterministic mixed-text corpus for the tokenizer;
* `drafters`: `KnownContinuation`, the drafter whose every draft is accepted.

The comparison metrics (`rel_rms`, `greedy_tokens`, `logits_along`) live in `rwkv_engine.verify`,
which `rwkv-engine verify` runs; they are re-exported here for the tests.
"""

from ..verify import greedy_tokens, logits_along, rel_rms
from . import checkpoints
from .checkpoints import (
    SUPPORTED_RANDOM_VERSIONS,
    cast,
    fla_config,
    hf_config,
    lora_ranks,
    random_embedder_state_dict,
    random_reranker_state_dict,
    random_state_dict,
    reranker_lora_ranks,
    save_hf_dir,
    save_pth,
    save_safetensors,
    to_fla,
    to_hf,
)
from .drafters import KnownContinuation

__all__ = [
    "SUPPORTED_RANDOM_VERSIONS",
    "KnownContinuation",
    "cast",
    "checkpoints",
    "fla_config",
    "greedy_tokens",
    "hf_config",
    "logits_along",
    "lora_ranks",
    "random_embedder_state_dict",
    "random_reranker_state_dict",
    "random_state_dict",
    "rel_rms",
    "reranker_lora_ranks",
    "save_hf_dir",
    "save_pth",
    "save_safetensors",
    "to_fla",
    "to_hf",
]
