"""The server assembled from its settings: the model, the engine, the app over them.

    from rwkv_engine.settings import Config, ModelSpec
    from rwkv_engine.serve.server import build
    engine, app = build(Config(ModelSpec("out-q8")))

What `rwkv-engine serve` runs (with `launch.serve` around it), what every Ray replica and Ray
batch worker runs (serve/ray.py), and what `rwkv-engine batch` runs in its own process. The
command lines only turn their flags into a `Config` (rwkv_engine/settings.py).
"""

from __future__ import annotations

from ..settings import Config

__all__ = ["Config", "build"]


def build(config: Config, progress: bool | None = None):
    """(engine, app): the model (and its reranker, if any) loaded, and the engine and app over it."""
    from .app import create_app
    from .engine import Engine

    model, tokenizer = config.model.load(progress)
    template = config.chat.resolve(model, config.model.model, log=_log(config.engine.name))
    if template is not None:
        from ..templates import check

        check(template)  # compiled now (tens of ms), not in the first chat request's time
    reranker = None
    if config.engine.reranker is not None:
        from ..embedding import DEFAULT_INSTRUCTION, load_reranker

        instruction = config.engine.rerank_instruction or DEFAULT_INSTRUCTION
        reranker = load_reranker(model, config.engine.reranker, instruction, progress=bool(progress))
    engine = Engine(model, tokenizer, config.engine, reranker=reranker)
    return engine, create_app(engine, config, template)


def _log(name: str):
    import sys

    return lambda line: print(f"{name}: {line}", file=sys.stderr, flush=True)
