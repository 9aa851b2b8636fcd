"""`rwkv-engine serve`: an OpenAI-compatible HTTP server over one model.

Three layers, each usable without the ones above it:

* `engine`   : the scheduler. One thread owns the model; requests are prefilled chunk by chunk
               between batched decode steps of the running ones; a prompt-state cache lets a
               prompt resume from the state of a cached prefix. Knows token ids, `SamplingParams`
               and `State`, nothing of HTTP or JSON.
* `protocol` : the OpenAI wire format as pydantic models (requests, responses, stream chunks,
               error bodies). Knows nothing of the engine.
* `app`      : the FastAPI router: validates a request with `protocol`, renders chat messages
               with `chat_format`, turns it into token ids and `SamplingParams`, submits it to
               the engine and streams the answer back (SSE).

`metrics` renders the engine's counters in the Prometheus text format. The command line is
`rwkv_engine/cli/serve.py`; docs/server.md is the user guide.
"""
