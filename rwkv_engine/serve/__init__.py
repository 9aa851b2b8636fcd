"""`rwkv-engine serve`: an OpenAI-compatible HTTP server over one model.

Three layers, each usable without the ones above it:

* `engine`   : the scheduler. One thread owns the model; requests are prefilled chunk by chunk
               between batched decode steps of the running ones; a prompt-state cache lets a
               prompt resume from the state of a cached prefix. Knows token ids, `SamplingParams`
               and `State`, nothing of HTTP or JSON.
* `protocol` : the OpenAI wire format as pydantic models (requests, responses, stream chunks,
               error bodies). Knows nothing of the engine.
* `app`      : the FastAPI application, assembled from the routes (`serving_completion`,
               `serving_chat`, `serving_tokenize`) over a shared `context.ServingContext`:
               a request is parsed (`parsing`), submitted to the engine and answered whole or
               streamed (SSE) (`jobs`).

`server` builds the whole from its settings (`rwkv_engine.settings.Config`: `ModelSpec`,
`EngineConfig`, `Limits`, `RequestDefaults`, `ServerSettings`), `launch` serves it with uvicorn,
`ray` scales it out; `security` and `connections` guard it; `metrics` renders the engine's
counters in the Prometheus text format. The command line (`rwkv_engine/cli/serve.py`) only turns
its flags into those settings; docs/server.md is the user guide.
"""
