"""Build script for the optional native extensions; all metadata lives in pyproject.toml.

`pip install .` and `pip install -e .` compile `rwkv_engine.tokenizer._native` (the byte trie of
the World tokenizer, plain CPython C API). The extension is optional: when there is no C compiler
the install still succeeds and the tokenizer uses its pure-Python twin, which gives the same ids,
only slower. Rebuild in place with `python setup.py build_ext --inplace`.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rwkv_engine.tokenizer._native",
            sources=["rwkv_engine/tokenizer/_native.c"],
            optional=True,
        ),
    ],
)
