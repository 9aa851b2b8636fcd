"""What the subcommands share: the one-line-error argument parser, the model flags, the sampling flags."""

from __future__ import annotations

import argparse

from ..errors import InputError
from ..settings import (
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_MAX_DRAFT,
    MAX_PASS_TOKENS,
    SPECULATIVE_KINDS,
    ChatSettings,
    ModelSpec,
    check_max_draft,
)

# Nothing here imports torch: `--help` and flag errors stay instant. Sampling defaults are
# plain dicts of SamplingParams fields, turned into a SamplingParams by `sampling_params`.


def one_line(message) -> str:
    """An error message folded onto one line."""
    return " ".join(str(message).split()) or type(message).__name__


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), not usage + message."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, with a one-line message otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """--threads, which cli.main applies (torch.set_num_threads) before the command runs."""
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads torch computes with (default: torch's choice, one per core, or OMP_NUM_THREADS)",
    )


def add_model_args(parser: argparse.ArgumentParser, device: bool = True) -> None:
    """The model flags; device=False for a command that runs on the CPU whatever (convert)."""
    parser.add_argument(
        "model",
        help="model: a .pth / .safetensors file, a Hugging Face model directory, or a Hugging Face Hub id (org/name)",
    )
    add_threads_arg(parser)
    if device:
        parser.add_argument(
            "--device",
            default="auto",
            type=device_arg,
            metavar="{auto,cpu,cuda,cuda:N}",
            help="device to run on: auto (default) picks CUDA when torch sees a GPU, else the CPU",
        )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="model dtype: weights (unless quantized) and the activations entering the matrices; "
        "the recurrent state is always fp32. auto (default): a bf16/fp16 checkpoint keeps its "
        "16-bit type, an fp32 one fp32 (on CUDA: bf16, fp16 on GPUs without it); each matmul runs in that 16-bit type where the device "
        "has fast units for it (CUDA; AVX512-BF16/AMX CPUs), else in fp32, and a quantized "
        "model's activations follow the same rule"
        + _auto_here()
        + "; a --quantization name with a dtype (q4f16_1) implies it",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        metavar="SCHEME",
        help="quantize the weights on load: q8, q4, q4k, q6k (ggml K-quant blocks of our own), "
        "q0bf16, q0f16, q0f32, or an MLC-LLM "
        "name such as q4f16_1 (default: none; a converted model keeps its own; a GGUF file's "
        "K-quant (Q4_K, Q5_K, Q6_K) and Q8_0 matrices run as they are stored, the scheme 'gguf')",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="N",
        help="columns per quantization scale (q4: 32, 64 or 128; q8: a divisor of the width, "
        "a multiple of 32 for the fast kernels, or -1 for one scale per row; default 32)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer to use instead of the one the model implies (a World vocab .txt or a tokenizer.json)",
    )


def device_arg(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N; a CUDA device is checked here (torch is imported only
    then), so asking for one on a machine without it is a usage error, before the model loads."""
    name = text.strip().lower()
    kind, _, index = name.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: one of auto, cpu, cuda, cuda:N")
    if kind == "cuda":
        from ..device import resolve_device

        try:
            resolve_device(name)
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _auto_here() -> str:
    """What `--dtype auto` does with bf16 on this machine's CPU (from /proc/cpuinfo: no torch import)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ""
    if not flags:
        return ""
    fast = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    if fast:
        return f" (this CPU has {'/'.join(fast)}: bf16 matmuls)"
    return " (this CPU has no avx512_bf16/amx_bf16: fp32 matmuls, bf16 weights converted tile by tile)"


def unescape(text: str) -> str:
    r"""Backslash escapes \n \t \r \\ in a command-line string (so `--stop '\n\n'` works)."""
    out, i = [], 0
    table = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in table:
            out.append(table[text[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _logit_bias(text: str) -> tuple[int, float]:
    tok, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(tok), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=VALUE (e.g. 261=-inf), got {text!r}") from None


class _Defaults:
    def __init__(self, values: dict):
        self.__dict__.update(values)


# The flags of the distribution sampled from: `generate` and `chat` sample with them, `serve` and
# `batch` give them to requests that leave the fields out (SamplingParams fields, as flags).
DISTRIBUTION_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "penalty_decay")


def add_sampling_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """The sampling flags, with `defaults` (SamplingParams fields) shown in --help and used for flags not given."""
    d = _Defaults(
        {
            "top_k": 0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "penalty_decay": 0.996,
            "seed": None,
            **defaults,
        }
    )
    g = parser.add_argument_group("sampling (RWKV order: penalties, softmax, top-p, top-k, then temperature)")
    add_distribution_args(g, d)
    g.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="most tokens to generate (default: %(default)s)"
    )
    g.add_argument("--seed", type=int, default=d.seed, help="random seed; same seed, same text (default: random)")
    g.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help=r"stop when this text appears; it is not printed; repeatable; \n and \t are understood",
    )
    g.add_argument(
        "--logit-bias",
        action="append",
        default=None,
        type=_logit_bias,
        metavar="ID=VALUE",
        help="add VALUE to the logit of token ID (-inf bans it); repeatable",
    )


def add_distribution_args(g, d) -> None:
    """The DISTRIBUTION_FIELDS flags in the argument group `g`, their defaults the attributes of `d`."""
    g.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="applied after the top-p/top-k cut; 0 = greedy (default: %(default)s)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=d.top_p,
        help="keep the most probable tokens up to this cumulative probability (default: %(default)s)",
    )
    g.add_argument(
        "--top-k", type=int, default=d.top_k, help="keep at most this many tokens; 0 = off (default: %(default)s)"
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=d.presence_penalty,
        help="subtracted from the logit of every token already generated (default: %(default)s)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=d.frequency_penalty,
        help="subtracted per (decayed) occurrence of a generated token (default: %(default)s)",
    )
    g.add_argument(
        "--penalty-decay",
        type=float,
        default=d.penalty_decay,
        help="occurrence counts are multiplied by this every token (default: %(default)s)",
    )


def sampling_params(args: argparse.Namespace, defaults: dict):
    """SamplingParams: `defaults` with the sampling flags of `args` applied (InputError on bad values)."""
    changes = {f: getattr(args, f) for f in DISTRIBUTION_FIELDS}
    changes.update(max_tokens=args.max_tokens, seed=args.seed)
    if args.stop:
        changes["stop"] = tuple(defaults.get("stop", ())) + tuple(unescape(s) for s in args.stop)
    if args.logit_bias:
        changes["logit_bias"] = {**defaults.get("logit_bias", {}), **dict(args.logit_bias)}
    return _from_flags(defaults, changes)


def distribution_params(args: argparse.Namespace):
    """SamplingParams of the DISTRIBUTION_FIELDS flags, the rest its defaults (InputError on bad values)."""
    return _from_flags({}, {f: getattr(args, f) for f in DISTRIBUTION_FIELDS})


def _from_flags(defaults: dict, changes: dict):
    from ..sampling_params import SamplingParams

    try:
        return SamplingParams(**{**defaults, **changes})
    except InputError as e:
        # Name the flag, not the field: "--top-p must be ..." reads better on a command line.
        msg = str(e)
        for field in changes:
            if msg.startswith(field + " "):
                msg = "--" + field.replace("_", "-") + msg[len(field) :]
                break
        raise InputError(msg) from None


def model_spec(args: argparse.Namespace, huge_pages: str | None = None) -> ModelSpec:
    """The model flags as a `settings.ModelSpec` (what to load, for every command)."""
    return ModelSpec(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        group_size=args.group_size,
        tokenizer=args.tokenizer,
        huge_pages=huge_pages,
    )


def load_model(args: argparse.Namespace, progress: bool = True):
    """(model, tokenizer) from the model flags. progress: for a big model, a loading bar on stderr
    when it is a terminal, else one summary line there."""
    import rwkv_engine

    model, tokenizer = model_spec(args).load(progress)
    if getattr(args, "state", None) is not None:  # every sequence starts from it
        state = rwkv_engine.load_state(model, args.state)
        model.initial_state = {k: v[0] for k, v in state.items()}
    return model, tokenizer


def template_arg(text: str) -> str:
    """--chat-template: auto, a built-in template's name, or a .jinja file that exists (checked
    here, before the model loads)."""
    from pathlib import Path

    from ..templates import AUTO, BUILTIN

    if text in (AUTO, *BUILTIN) or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither {', '.join((AUTO, *BUILTIN))} nor a template file")


def on_off(value: bool) -> str:
    """A --think flag's spelling of a boolean setting (its default, read from `ChatSettings.think`)."""
    return "on" if value else "off"


def add_template_arg(parser) -> None:
    parser.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        type=template_arg,
        default=ChatSettings.template,
        help="how a conversation becomes the prompt: world (the RWKV World format), g1 (RWKV-7 G1: "
        "thinking, ```json tool calls), or a Jinja chat template file; auto (default) takes the "
        "model's own template (tokenizer_config.json, a .jinja beside the weights, a GGUF's), else "
        "g1 for a model named as a G-series one (rwkv7-g1...), else world",
    )


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (the same output, fewer passes over the weights)")
    g.add_argument(
        "--speculative",
        choices=SPECULATIVE_KINDS,
        default=None,
        help="draft tokens by prompt lookup (n-gram match over the prompt and the text so far) or with a "
        "draft model, and verify them in one pass of the model",
    )
    g.add_argument(
        "--draft",
        metavar="MODEL",
        default=None,
        help="the draft model for --speculative draft: a smaller RWKV sharing the vocabulary "
        "(default: the model's own quantized twin, see --draft-quantization)",
    )
    g.add_argument(
        "--draft-quantization",
        default=DEFAULT_DRAFT_QUANTIZATION,
        metavar="SCHEME",
        help="quantization of the twin draft when no --draft is given (default: %(default)s)",
    )
    g.add_argument(
        "--max-draft",
        type=int,
        default=DEFAULT_MAX_DRAFT,
        metavar="N",
        help=f"most tokens drafted per pass, 1-{MAX_PASS_TOKENS - 1} (default: %(default)s: with the last token, "
        "8 rows, one read of each weight)",
    )


def check_speculative_args(args: argparse.Namespace) -> None:
    """InputError on bad speculative flags (before the model load)."""
    check_max_draft(args.max_draft, "--max-draft")
    if args.speculative != "draft" and args.draft is not None:
        raise InputError("--draft needs --speculative draft")


def load_drafter(args: argparse.Namespace, model):
    """The drafter the speculative flags ask for, or None."""
    from ..speculative import make_drafter

    if args.speculative is None:
        return None
    return make_drafter(args.speculative, model, args.draft, args.draft_quantization)


def speculative_line(s) -> str:
    """The --stats line of a speculative generation."""
    return (
        f"speculative: {s.passes} passes, {s.tokens_per_pass:.2f} tokens per pass; "
        f"drafted {s.drafted}, accepted {s.accepted} ({100 * s.acceptance_rate:.0f}%)"
    )


def add_state_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state",
        metavar="FILE",
        help="start from this state: a State.save file, or a state-tuning file (RWKV-PEFT's "
        "blocks.N.att.time_state tensors, .pth or .safetensors) of this model",
    )
