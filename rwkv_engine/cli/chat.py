"""`rwkv-engine chat MODEL`: chat with an RWKV World model in the terminal.

The terminal front end of rwkv_engine/chat.py, which documents the chat format and its rules:
--system TEXT replaces the default preamble ("System: TEXT\n\n"; '' for none), --stateless answers
every message from the system state alone, --load resumes a session saved with /save.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..sampling_params import CHAT_SESSION as DEFAULTS

if TYPE_CHECKING:  # (rwkv_engine.chat imports torch: only when the command runs)
    from ..chat import ChatSession
from ..chat_format import normalize_text as normalize_message
from ..errors import InputError, RWKVEngineError, StateError
from . import common

HELP = "Chat with an RWKV World model in the terminal (type /help once it runs)."

COMMANDS_HELP = """\
commands:
  /help                 this text
  /exit                 quit (or Ctrl-D)
  /reset                forget the conversation (back to the system prompt, instantly)
  /regen                a new answer to the last message
  /stats                speed of the last reply, conversation length, state size
  /set [KEY=VALUE ...]  show or change sampling: temperature top_p top_k presence_penalty
                        frequency_penalty penalty_decay max_tokens seed
  /save FILE            save the whole session (state, history, settings)
  /load FILE            resume a saved session
Ctrl-C stops a reply. End a line with \\ to continue the message on the next line.
Start a message with // to send a text that begins with /."""


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    common.add_state_arg(parser)
    parser.add_argument(
        "--system",
        metavar="TEXT",
        default=None,
        help='system prompt, sent as "System: TEXT" before the conversation and kept in effect '
        "every round ('' for none; default: the standard RWKV greeting exchange)",
    )
    parser.add_argument(
        "--stateless",
        action="store_true",
        help="answer every message from the system prompt alone (no memory of earlier turns)",
    )
    parser.add_argument("--load", metavar="FILE", help="resume a session saved with /save")
    common.add_sampling_args(parser, DEFAULTS)
    common.add_speculative_args(parser)


class _Terminal:
    def __init__(self, session: ChatSession, out=None, err=None):
        self.session = session
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def error(self, e) -> None:
        self.out.flush()
        self.err.write(f"error: {common.one_line(e)}\n")
        self.err.flush()

    def read_message(self) -> str:
        lines = [input("User: ")]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(input("... "))
        return "\n".join(lines)

    def stream(self, chunks: Iterator[str]) -> None:
        self.out.write("Assistant: ")
        self.out.flush()
        try:
            for chunk in chunks:
                self.out.write(chunk)
                self.out.flush()
        except KeyboardInterrupt:
            chunks.close()
            self.out.write(" [interrupted]")
        self.out.write("\n\n")
        self.out.flush()

    def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        s = self.session
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.say(COMMANDS_HELP)
        elif name == "/reset":
            s.reset()
            self.say("(conversation reset)")
        elif name == "/regen":
            self.stream(s.regen())
        elif name == "/stats":
            self.say(s.stats())
        elif name == "/set":
            if rest:
                s.set(rest.split())
            self.say(s.settings())
        elif name in ("/save", "/load"):
            if not rest:
                raise InputError(f"{name} needs a file name")
            if name == "/save":
                self.say(f"(saved to {s.save(rest)})")
            else:
                from ..chat import plural

                s.load(rest)
                self.say(f"(loaded {rest}: {plural(len(s.turns), 'turn')})")
        else:
            raise InputError(f"unknown command {name}; /help lists the commands")
        return True

    def loop(self) -> None:
        while True:
            try:
                line = self.read_message()
            except EOFError:
                self.say()
                return
            except KeyboardInterrupt:
                self.say("\n(Ctrl-C stops a reply; /exit or Ctrl-D quits)")
                continue
            try:
                if line.strip().startswith("/") and not line.strip().startswith("//"):
                    if not self.command(line):
                        return
                elif normalize_message(line):
                    msg = line.strip()
                    self.stream(self.session.ask(msg[1:] if msg.startswith("//") else msg))
            except (RWKVEngineError, OSError) as e:
                self.error(e)


def run(args) -> int:
    from ..chat import ChatSession, plural

    params = common.sampling_params(args, DEFAULTS)
    common.check_speculative_args(args)
    if args.load is not None and not Path(args.load).is_file():  # before the model loads
        raise StateError(f"{args.load}: no such file")
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    model, tokenizer = common.load_model(args, progress=True)
    t0 = time.perf_counter()
    drafter = common.load_drafter(args, model)
    session = ChatSession(
        model,
        tokenizer,
        params,
        system=args.system,
        stateless=args.stateless,
        speculative=drafter,
        max_draft=args.max_draft,
    )
    if args.load is not None:
        try:
            session.load(args.load)
        except InputError as e:  # a session file chat cannot use is a usage error, like a bad state file
            raise StateError(str(e)) from None
    c = model.config
    name = Path(model.path or args.model).name
    notes = [f"system prompt {len(session.system_ids)} tokens in {time.perf_counter() - t0:.2f}s"]
    if session.stateless:
        notes.append("stateless")
    if args.load is not None:
        notes.append(f"resumed {plural(len(session.turns), 'turn')}")
    print(f"rwkv-engine chat: {name} (RWKV-{c.version}, {c.n_layer} layers, {c.n_embd} wide); {'; '.join(notes)}.")
    print("Type /help for commands, /exit or Ctrl-D to quit.\n", flush=True)
    _Terminal(session).loop()
    return 0
