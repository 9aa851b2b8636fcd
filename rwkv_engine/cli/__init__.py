"""The `rwkv-engine` command: a thin dispatcher over one module per subcommand.

    rwkv-engine generate MODEL --prompt "Once upon a time"
    rwkv-engine chat MODEL

A subcommand lives in `rwkv_engine/cli/<name>.py` and defines

    HELP = "one line for the command list"     (optional; the table below has one too)
    def add_arguments(parser): ...              # an argparse parser, prog "rwkv-engine <name>"
    def run(args) -> int: ...                   # the exit status

Modules are imported only when their command runs, so `rwkv-engine --help` starts fast. Errors a
user can cause (RWKVEngineError, a missing or unreadable file, Ctrl-C) end the command with one
line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> one-line description; every name is a module rwkv_engine.cli.<name>.
COMMANDS = {
    "generate": "continue a prompt, streaming the text to stdout",
    "chat": "chat with a World model in the terminal",
    "convert": "convert a checkpoint to another format, dtype or quantization",
    "bench": "measure prefill and decode speed",
    "perplexity": "measure the perplexity of a model on a text file",
    "serve": "serve an OpenAI-compatible HTTP API",
    "eval": "run lm-evaluation-harness tasks on a model",
    "batch": "answer a JSONL file of OpenAI requests (resumable)",
    "embed": "embed a file of texts into JSONL or a .npy array",
    "export": "export to an ExecuTorch program (.pte) for phones and edge devices",
    "verify": "compare two configurations of a model layer by layer",
}

PROG = "rwkv-engine"


def _usage() -> str:
    from .. import __version__

    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help for a command's options)",
        "",
        f"rwkv-engine {__version__}: an inference engine for RWKV language models.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()),
    ]
    return "\n".join(lines) + "\n"


def _fail(prog: str, message, status: int = 1) -> int:
    from .common import one_line

    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    return status


def _file_error(e: OSError) -> str:
    name = e.filename if e.filename is not None else ""
    what = e.strerror or str(e)
    return f"{name}: {what}" if name else what


def main(argv: list[str] | None = None) -> int:
    from ..threads import configure_openmp

    configure_openmp()  # before torch loads (rwkv_engine/threads.py)
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        return _fail(PROG, f"no command given; one of: {', '.join(COMMANDS)} (see {PROG} --help)", 2)
    name = argv[0]
    if name in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0
    if name in ("-V", "--version"):
        from .. import __version__

        print(f"{PROG} {__version__}")
        return 0
    if name not in COMMANDS:
        return _fail(PROG, f"unknown command {name!r}; one of: {', '.join(COMMANDS)}", 2)

    prog = f"{PROG} {name}"
    module_name = f"{__name__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return _fail(prog, f"the {name!r} command is not available in this version", 2)
        return _fail(prog, f"the {name!r} command needs the Python package {e.name!r}, which is not installed")
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130)

    from .common import ArgumentParser

    parser = ArgumentParser(prog=prog, description=getattr(module, "HELP", COMMANDS[name]))
    module.add_arguments(parser)
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as e:  # --help (0) or a usage error (2, already printed on one line)
        return e.code if isinstance(e.code, int) else 2
    return _run(prog, module.run, args)


def _run(prog: str, run, args) -> int:
    from ..errors import RWKVEngineError, StateError

    try:
        if getattr(args, "threads", None) is not None:  # (every command that computes has --threads)
            import torch

            torch.set_num_threads(args.threads)
        return int(run(args) or 0)
    except StateError as e:  # a state file that does not fit the model: a usage error
        return _fail(prog, e, 2)
    except RWKVEngineError as e:
        return _fail(prog, e)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130)
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, and keep Python from complaining
        # again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except MemoryError:
        return _fail(prog, "out of memory")
    except OSError as e:
        return _fail(prog, _file_error(e))
