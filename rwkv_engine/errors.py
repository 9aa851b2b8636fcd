"""Errors raised by rwkv-engine.

Every error a user can cause (a bad file, a bad argument, a state from another model) is a
subclass of `RWKVEngineError`, itself a `ValueError`, with a message that names the file or the
argument and says what is wrong. The CLI prints the message alone, never a traceback.
"""


class RWKVEngineError(ValueError):
    """Base class of every user-facing error of rwkv-engine."""


class CheckpointError(RWKVEngineError):
    """A model file or directory is missing, unreadable, truncated or not an RWKV checkpoint."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is a valid RWKV model of a version or variant this engine does not run."""


class InputError(RWKVEngineError):
    """A call got a bad argument: token ids out of range, an empty prompt, an unknown option."""


class ModelOutputError(RWKVEngineError):
    """The model computed logits that are NaN or infinite (weights or a state that are not
    finite, or values so large that the forward overflowed): no token can be chosen from them."""


class StateError(RWKVEngineError):
    """A recurrent state does not belong to the model it is used with, or its file is bad."""


class TokenizerError(RWKVEngineError):
    """A tokenizer file is bad or does not fit the model, or token ids / bytes cannot be converted."""
