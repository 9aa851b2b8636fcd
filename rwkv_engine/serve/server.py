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
    """(engine, app): the model loaded, and the engine and app over it."""
    from .app import create_app
    from .engine import Engine

    model, tokenizer = config.model.load(progress)
    engine = Engine(model, tokenizer, config.engine)
    return engine, create_app(engine, config)
