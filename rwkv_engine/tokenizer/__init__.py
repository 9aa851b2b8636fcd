"""Tokenizers for RWKV models.

* `WorldTokenizer`: the RWKV World vocab (every World model: RWKV-4 World, 5, 6, 7), ids identical
  to the reference `rwkv` package; a C extension with a pure-Python twin.
* `HFTokenizer`: a Hugging Face tokenizer.json (RWKV-4 Pile / Raven use GPT-NeoX-20B's).
* `IncrementalDetokenizer`: streaming text that never splits a UTF-8 character.
* `load_tokenizer`: picks the right one for a model and refuses one that does not fit.

All raise `TokenizerError` (an `RWKVEngineError`) for bad input.
"""

from rwkv_engine.errors import TokenizerError
from rwkv_engine.tokenizer.auto import check_fit, load_tokenizer
from rwkv_engine.tokenizer.detokenizer import IncrementalDetokenizer
from rwkv_engine.tokenizer.hf import HFTokenizer
from rwkv_engine.tokenizer.world import EOS_TOKEN_ID, VOCAB_ROWS, WorldTokenizer, native_available

__all__ = [
    "EOS_TOKEN_ID",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "TokenizerError",
    "VOCAB_ROWS",
    "WorldTokenizer",
    "check_fit",
    "load_tokenizer",
    "native_available",
]
