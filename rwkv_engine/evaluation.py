"""lm-evaluation-harness on the engine: an `lm_eval` model class, and `evaluate()` behind `rwkv-engine eval`.

    from rwkv_engine.evaluation import RWKVEngineLM, evaluate
    lm = RWKVEngineLM(model, tokenizer)
    results = evaluate(lm, ["lambada_openai"], limit=100)     # lm_eval's result dict

`lm_eval` is an optional extra (`pip install "rwkv-engine[eval]"`); importing this module without it
raises an InputError that says so. The class is also registered with lm_eval as "rwkv-engine"
(`lm_eval.simple_evaluate(model="rwkv-engine", model_args="pretrained=PATH,dtype=bf16")` after
importing this module).

How each request type runs on an RNN:

* loglikelihood (multiple choice, LAMBADA, ...): requests are grouped by context. Each distinct
  context is prefilled once; its last logits score the first continuation token, and its state is
  forked for the continuations, which run as one batch per continuation length
  (`forward(..., all_logits=True)`). Scores are sums of `log_softmax` of the raw fp32 logits.
* loglikelihood_rolling (perplexity): the whole document is scored with its full history (an RNN
  has no context window), end-of-text (id 0) in front, in pieces of ROLLING_PIECE tokens with the
  state carried, so memory stays bounded for any length (`scoring.sequence_nll`, as `perplexity`).
* generate_until: the requests run through the serving engine (`serve.engine.Engine`), decoded
  together in batches of `batch_size`; greedy unless the task asks for sampling.

Chat templates (`rwkv-engine eval --chat-template NAME|FILE`, lm_eval's `apply_chat_template`):
`chat_template=` a `templates.ChatTemplate`; lm_eval then renders each few-shot history with it
(thinking off: a G1 model answers at once), and a generated answer is what follows the
template's generation prompt, less the ">" that closes G1's "<think></think" and any thought.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

from .errors import InputError
from .scoring import continuation_scores, sequence_nll
from .tokenizer import EOS_TOKEN_ID

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise InputError(
        f'evaluation needs lm-evaluation-harness: pip install "rwkv-engine[eval]" (could not import lm_eval: {e})'
    ) from None

ROLLING_PIECE = 512  # tokens per forward when scoring a whole document


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=disable, unit="req")


@register_model("rwkv-engine")
class RWKVEngineLM(TemplateLM):
    """An lm_eval model over a loaded rwkv-engine model and its tokenizer."""

    def __init__(
        self,
        model=None,
        tokenizer=None,
        batch_size: int = 8,
        *,
        pretrained: str | None = None,
        dtype: str | None = None,
        quantization: str | None = None,
        device: str = "cpu",
        chat_template=None,
        **_ignored,
    ):
        super().__init__()
        if model is None:
            if pretrained is None:
                raise InputError("RWKVEngineLM needs a model, or pretrained=PATH")
            import rwkv_engine

            model = rwkv_engine.load(pretrained, device=device, dtype=dtype, quantization=quantization)
        if tokenizer is None:
            import rwkv_engine

            tokenizer = rwkv_engine.load_tokenizer(model)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise InputError(f"batch_size must be at least 1, got {batch_size!r}")
        if isinstance(chat_template, str):  # (model_args="...,chat_template=g1")
            from .templates import resolve

            chat_template = resolve(
                chat_template, getattr(model, "path", None) and str(model.path), model.config.version
            )
        self.template = chat_template

    # --- chat templates (lm_eval's apply_chat_template) -------------------------------------------

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template.text if self.template is not None else ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise InputError("apply_chat_template needs a chat template (rwkv-engine eval --chat-template NAME|FILE)")
        return self.template.render(
            chat_history, add_generation_prompt=add_generation_prompt, thinking=False, enable_thinking=False
        )

    def _answer(self, context: str, text: str) -> str:
        """A generated text as the task reads it: with a chat template, the answer after any thought."""
        if self.template is None:
            return text
        from .reasoning import reply_start, split

        return split(text, reply_start(context, self.template.thinks))[1]

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v is not None}
        return cls(**{**args, **extra})

    # --- what TemplateLM asks for -----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return EOS_TOKEN_ID

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # --- loglikelihood ----------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids) -> (sum log p, all greedy)."""
        by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (_, ctx, cont) in enumerate(requests):
            if not ctx or not cont:
                raise InputError("a loglikelihood request needs a non-empty context and continuation")
            by_context[tuple(ctx)].append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = _progress(len(requests), "loglikelihood", disable_tqdm)
        for ctx, members in by_context.items():
            conts = [requests[i][2] for i in members]
            for i, score in zip(members, continuation_scores(self.model, ctx, conts)):
                results[i] = score
            bar.update(len(members))
        bar.close()
        return results  # type: ignore[return-value]

    # --- loglikelihood_rolling --------------------------------------------------------------------

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in _progress_iter(requests, "loglikelihood_rolling", disable_tqdm):
            tokens = self.tok_encode(text)
            out.append(-sequence_nll(self.model, [EOS_TOKEN_ID] + tokens, ROLLING_PIECE)[0] if tokens else 0.0)
        return out

    # --- generate_until ---------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request through the serving engine, `batch_size` decoded at a time."""
        from .sampling import SamplingParams
        from .serve.engine import Delta, Engine, EngineConfig, Finished, Request

        jobs = []
        for req in requests:
            context, kwargs = req.args
            jobs.append((self.tok_encode(context) or [EOS_TOKEN_ID], _sampling(dict(kwargs or {}), SamplingParams)))
        texts: list[list[str]] = [[] for _ in jobs]
        ends: list[Finished | None] = [None] * len(jobs)
        done = threading.Semaphore(0)
        bar = _progress(len(jobs), "generate_until", disable_tqdm)

        def sink_for(i: int):
            def sink(event) -> None:
                if isinstance(event, Delta):
                    texts[i].append(event.text)
                elif isinstance(event, Finished):
                    ends[i] = event
                    done.release()

            return sink

        # prefill_share 0: whole prefill chunks between decode steps (no stream waits for its tokens).
        config = EngineConfig(
            max_batch=self.batch_size, max_queue=max(1, len(jobs)), state_cache_bytes=0, prefill_share=0
        )
        engine = Engine(self.model, self.tokenizer, config)
        engine.start()
        try:
            for i, (ids, params) in enumerate(jobs):
                engine.submit(Request(prompt_ids=ids, params=params), sink_for(i))
            for _ in jobs:
                done.acquire()
                bar.update(1)
        finally:
            engine.stop()
            bar.close()
        failed = [e for e in ends if e is None or e.reason in ("error", "cancelled")]
        if failed:
            raise RuntimeError(f"generation failed: {failed[0].message if failed[0] else 'no answer'}")
        return [self._answer(req.args[0], "".join(t)) for req, t in zip(requests, texts)]


def _progress_iter(requests, desc: str, disable: bool):
    bar = _progress(len(requests), desc, disable)
    for req in requests:
        yield req.args
        bar.update(1)
    bar.close()


def _sampling(kwargs: dict, SamplingParams):
    """SamplingParams from an lm_eval gen_kwargs dict (until, max_gen_toks, do_sample, temperature, top_p, top_k)."""
    until = kwargs.pop("until", None) or []
    if isinstance(until, str):
        until = [until]
    max_tokens = int(kwargs.pop("max_gen_toks", kwargs.pop("max_tokens", 256)))
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
    if not do_sample:
        temperature = 0.0
    return SamplingParams(
        temperature=temperature,
        top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
        top_k=int(kwargs.pop("top_k", 0) or 0),
        max_tokens=max_tokens,
        stop=tuple(s for s in until if s),
        seed=kwargs.pop("seed", None),
    )


def evaluate(
    lm: RWKVEngineLM,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    seed: int = 0,
    log_samples: bool = False,
) -> dict:
    """lm_eval's `simple_evaluate` on `lm`: the result dict (`results`, `versions`, `n-shot`, ...)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Indexing lm_eval's own ~15k task configs takes tens of seconds: skip it when the tasks asked
    # for are all in include_path.
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise InputError(
            f"unknown lm_eval task(s): {', '.join(unknown)}"
            + ("" if include_path else " (add --include-path DIR for task YAMLs of your own)")
        )
    return simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        batch_size=lm.batch_size,
        apply_chat_template=lm.template is not None,
    )
