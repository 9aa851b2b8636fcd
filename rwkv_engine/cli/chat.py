"""`rwkv-engine chat MODEL`: chat with an RWKV model in the terminal.

The terminal front end of rwkv_engine/chat.py, which documents the chat format and its rules:
--system TEXT replaces the default preamble ("System: TEXT\n\n"; '' for none), --stateless answers
every message from the system state alone, --load resumes a session saved with /save.
--chat-template picks the format (auto: g1 for a model named as a G1 one, else world); with a
reasoning model /think on|off|bit|lot (or --think) chooses whether and how long it thinks, and
its thought is shown dimmed before the answer (--hide-thoughts: not shown).
"""

from __future__ import annotations

import os
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
from ..settings import ChatSettings
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
  /think [on|off|bit|lot]  show or change thinking (reasoning models such as G1: think,
                        not, think a bit, think a lot)
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
    common.add_template_arg(parser)
    parser.add_argument(
        "--think",
        choices=["on", "off", "bit", "lot"],
        default=common.on_off(ChatSettings.think),
        help="whether a reasoning model (G1) thinks before it answers: on, off, bit (think a bit), "
        "lot (think a lot); /think changes it (default: %(default)s)",
    )
    parser.add_argument(
        "--hide-thoughts", action="store_true", help="do not show a reasoning model's thought, only its answer"
    )
    common.add_sampling_args(parser, DEFAULTS)
    common.add_speculative_args(parser)


DIM, UNDIM = "\x1b[2m", "\x1b[22m"


class _Terminal:
    def __init__(self, session: ChatSession, out=None, err=None, hide_thoughts: bool = False):
        self.session = session
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.hide_thoughts = hide_thoughts
        # Thoughts are dimmed on a terminal (NO_COLOR, https://no-color.org, turns that off).
        self.dim = self.out.isatty() and not os.environ.get("NO_COLOR")

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
        """The reply as it comes: its thought (dimmed, or not shown), a line break, the answer."""
        from ..chat import Thought

        self.out.write("Assistant: ")
        self.out.flush()
        thinking = False
        try:
            for chunk in chunks:
                if isinstance(chunk, Thought):
                    if self.hide_thoughts:
                        continue
                    if not thinking:
                        self.out.write(DIM if self.dim else "")
                        thinking = True
                elif thinking:
                    self.out.write((UNDIM if self.dim else "") + "\n")
                    thinking = False
                self.out.write(chunk)
                self.out.flush()
        except KeyboardInterrupt:
            chunks.close()
            self.out.write(" [interrupted]")
        if thinking and self.dim:
            self.out.write(UNDIM)
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
        elif name == "/think":
            if rest:
                s.set_think(rest.lower())
            self.say(
                f"think={s.think}" + ("" if s.template.thinks else f" (the {s.template.name} template has no thinking)")
            )
        elif name in ("/save", "/load"):
            if not rest:
                raise InputError(f"{name} needs a file name")
            if name == "/save":
                self.say(f"(saved to {s.save(rest)})")
            else:
                from ..chat import plural

                s.load(rest)
                self.say(
                    f"(loaded {rest}: {plural(len(s.turns), 'turn')}; template {s.template.name}, think={s.think})"
                )
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
    template = ChatSettings(args.chat_template).resolve(model, args.model)
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
        template=template,
        think=args.think,
    )
    if args.load is not None:
        try:
            session.load(args.load)
        except InputError as e:  # a session file chat cannot use is a usage error, like a bad state file
            raise StateError(str(e)) from None
    c = model.config
    name = Path(model.path or args.model).name
    template = session.template  # (a resumed session keeps the template it was saved with)
    notes = [
        f"chat template {template.name} ({template.source})",
        f"system prompt {len(session.system_ids)} tokens in {time.perf_counter() - t0:.2f}s",
    ]
    if template.thinks:
        notes.append(f"think {session.think}")
    if session.stateless:
        notes.append("stateless")
    if args.load is not None:
        notes.append(f"resumed {plural(len(session.turns), 'turn')}")
    print(f"rwkv-engine chat: {name} (RWKV-{c.version}, {c.n_layer} layers, {c.n_embd} wide); {'; '.join(notes)}.")
    print("Type /help for commands, /exit or Ctrl-D to quit.\n", flush=True)
    _Terminal(session, hide_thoughts=args.hide_thoughts).loop()
    return 0
