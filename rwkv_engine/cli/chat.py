"""`rwkv-engine chat MODEL`: chat with an RWKV World model in the terminal.

The conversation is the World chat format (FORMATS.md D), fed to the model as one growing text:

    {system}User: {message 1}\n\nAssistant:{reply 1}\n\nUser: {message 2}\n\nAssistant:{reply 2}\n\n...

* The system preamble is by default the exchange every RWKV front end seeds ("User: hi\n\n
  Assistant: Hi. I am your assistant ...\n\n"); `--system TEXT` replaces it with
  "System: TEXT\n\n", `--system ''` removes it. Its state is computed once and kept: the
  conversation state always continues from it, and /reset goes back to it without any prefill.
  With `--stateless` every message starts from the system state again.
* A message is normalised so that it never contains "\n\n", the turn separator: CRLF -> LF,
  stripped, runs of newlines folded to one.
* A reply ends at "\n\n" (not shown) or after --max-tokens; token 0 (end of text) is banned.
  The space the model puts after "Assistant:" is part of the conversation but not shown.
* Whatever the model generated past the end of the reply (a token like "\n\n\n" or ".\n\n")
  is not kept: the conversation holds exactly reply + "\n\n", re-read from the state before the
  reply when needed. So the state after any number of turns is the state of prefilling the
  conversation's token ids (`ChatSession.conversation_ids()`) in one go.

Sampling defaults are ChatRWKV's API_DEMO_CHAT.py (the RWKV-7 chat demo): temperature 1.0,
top-p 0.3, presence 0.5, frequency 0.5, decay 0.996; at most 500 tokens a reply.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import InputError, RWKVEngineError, StateError
from ..generation import GenerationStats, generate
from ..sampling import SamplingParams
from . import common

HELP = "Chat with an RWKV World model in the terminal (type /help once it runs)."

DEFAULT_SYSTEM = (
    "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full details. "
    "Please feel free to ask any question and I will always answer it.\n\n"
)
TURN_SEPARATOR = "\n\n"
EOS_TOKEN_ID = 0

DEFAULTS = SamplingParams(
    temperature=1.0, top_p=0.3, top_k=0, presence_penalty=0.5, frequency_penalty=0.5,
    penalty_decay=0.996, max_tokens=500, stop=(TURN_SEPARATOR,), stop_token_ids=(), banned_token_ids=(EOS_TOKEN_ID,),
)

SESSION_FORMAT = "rwkv-engine-chat/1"

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

# /set names (and short aliases) -> SamplingParams fields
SETTABLE = {
    "temperature": "temperature", "temp": "temperature",
    "top_p": "top_p", "top_k": "top_k",
    "presence_penalty": "presence_penalty", "presence": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "frequency": "frequency_penalty",
    "penalty_decay": "penalty_decay", "decay": "penalty_decay",
    "max_tokens": "max_tokens", "seed": "seed",
}


def normalize_message(text: str) -> str:
    """User text as it goes into the conversation: never contains the turn separator."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    return re.sub(r"\n{2,}", "\n", text)


def system_preamble(system: str | None) -> str:
    """The text before the first turn: the default exchange, "System: ...\\n\\n", or nothing."""
    if system is None:
        return DEFAULT_SYSTEM
    system = normalize_message(system)
    return f"System: {system}{TURN_SEPARATOR}" if system else ""


def turn_prompt(message: str) -> str:
    return f"User: {message}{TURN_SEPARATOR}Assistant:"


def chat_params(params: SamplingParams) -> SamplingParams:
    """`params` with what chat needs on top: stop at "\\n\\n", token 0 banned, no stop tokens."""
    return params.replace(
        stop=tuple(dict.fromkeys((TURN_SEPARATOR, *params.stop))),
        banned_token_ids=tuple(dict.fromkeys((EOS_TOKEN_ID, *params.banned_token_ids))),
        stop_token_ids=(),
    )


@dataclass
class Turn:
    user: str              # the normalised message
    reply: str             # the reply as generated (leading space kept), without the separator
    prompt_ids: list[int]  # "User: {user}\n\nAssistant:"
    reply_ids: list[int]   # reply + "\n\n", as the state has read it
    finish_reason: str     # "stop" | "length" | "interrupted"


class ChatSession:
    """The conversation, its states and settings; the terminal loop is `run`.

    ask(message) / regen() return an iterator of display text; the turn is recorded when the
    iterator ends, also when it ends early (Ctrl-C): then the partial reply is kept and closed
    with the separator.
    """

    def __init__(self, model, tokenizer, params: SamplingParams = DEFAULTS, system: str | None = None,
                 stateless: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.params = chat_params(params)
        self.stateless = stateless
        self.last_stats: GenerationStats | None = None
        self.system = system_preamble(system)
        self.system_ids = tokenizer.encode(self.system) if self.system else []
        if self.system_ids:
            _, self.system_state = model.forward(self.system_ids)
        else:
            self.system_state = model.new_state()
        self.generator = torch.Generator(device=self.system_state.device)
        self._seed(self.params.seed)
        self.reset()

    # --- conversation ---------------------------------------------------------------------------

    def reset(self) -> None:
        self.state = self.system_state
        self.turns: list[Turn] = []
        self._regen_state = None  # the state the last turn's message was read from

    def conversation_ids(self) -> list[int]:
        """The token ids the current state has read, from a fresh state."""
        turns = self.turns[-1:] if self.stateless else self.turns
        return self.system_ids + [t for turn in turns for t in turn.prompt_ids + turn.reply_ids]

    def ask(self, message: str) -> Iterator[str]:
        message = normalize_message(message)
        if not message:
            raise InputError("empty message")
        return self._reply(message, self.system_state if self.stateless else self.state)

    def regen(self) -> Iterator[str]:
        if not self.turns or self._regen_state is None:
            raise InputError("nothing to regenerate yet")
        last = self.turns.pop()
        self.state = self._regen_state
        return self._reply(last.user, self._regen_state)

    def _reply(self, message: str, before) -> Iterator[str]:
        prompt_ids = self.tokenizer.encode(turn_prompt(message))
        gen = generate(self.model, self.tokenizer, prompt_ids, self.params, state=before, generator=self.generator)
        first = True
        try:
            for chunk in gen:
                if first:
                    first = False
                    chunk = chunk[1:] if chunk.startswith(" ") else chunk
                if chunk:
                    yield chunk
        finally:
            self._close_turn(message, before, prompt_ids, gen)

    def _close_turn(self, message: str, before, prompt_ids: list[int], gen) -> None:
        if gen.prompt_state is None:
            return  # stopped before the message was read: the conversation is unchanged
        # The conversation keeps exactly reply + separator: the generated tokens that spell a
        # prefix of it, then the rest encoded. Tokens past it (a stop inside a token, text held
        # back when interrupted) are dropped and the state re-read from the prompt state.
        target = (gen.text + TURN_SEPARATOR).encode("utf-8")
        kept, n = [], 0
        for t in gen.tokens:
            b = self.tokenizer.decode_bytes([t])
            if target[n:n + len(b)] != b:
                break
            kept.append(t)
            n += len(b)
        rest = self.tokenizer.encode_bytes(target[n:]) if n < len(target) else []
        if len(kept) == len(gen.tokens):
            state = self.model.forward(rest, state=gen.state)[1] if rest else gen.state
        else:
            state = self.model.forward(kept + rest, state=gen.prompt_state)[1]
        self.turns.append(Turn(message, gen.text, list(prompt_ids), kept + rest, gen.finish_reason or "interrupted"))
        self.state = state
        self._regen_state = before
        self.last_stats = gen.stats

    # --- settings -------------------------------------------------------------------------------

    def _seed(self, seed: int | None) -> None:
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def set(self, assignments: list[str]) -> None:
        """Apply "key=value" settings (all or none)."""
        changes = {}
        for item in assignments:
            key, sep, value = item.partition("=")
            field = SETTABLE.get(key.strip().lower().replace("-", "_"))
            if not sep or field is None:
                raise InputError(f"/set takes KEY=VALUE with KEY one of {', '.join(sorted(set(SETTABLE.values())))}; "
                                 f"got {item!r}")
            changes[field] = _parse_value(field, value.strip())
        self.params = chat_params(self.params.replace(**changes))
        if "seed" in changes:
            self._seed(self.params.seed)

    def settings(self) -> str:
        p = self.params
        return " ".join(f"{f}={getattr(p, f)}" for f in dict.fromkeys(SETTABLE.values()))

    def stats(self) -> str:
        lines = []
        s = self.last_stats
        if s is None:
            lines.append("last reply: none yet")
        else:
            lines.append(
                f"last reply: prefill {s.prompt_tokens} tokens at {s.prefill_tokens_per_second:.1f} tok/s, "
                f"decode {s.generated_tokens} tokens at {s.decode_tokens_per_second:.1f} tok/s ({s.finish_reason or 'interrupted'})"
            )
        lines.append(
            f"conversation: {len(self.conversation_ids())} tokens (system {len(self.system_ids)}), "
            f"{_plural(len(self.turns), 'turn')}{' (stateless)' if self.stateless else ''}; state: {self.state.nbytes} bytes"
        )
        return "\n".join(lines)

    # --- files ----------------------------------------------------------------------------------

    def _model_config(self) -> dict:
        return dataclasses.asdict(self.model.config)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the session as one zip file: session.json plus the states (safetensors)."""
        path = Path(path)
        params = dataclasses.asdict(self.params)
        params["logit_bias"] = {str(k): v for k, v in self.params.logit_bias.items()}
        meta = {
            "format": SESSION_FORMAT,
            "model": {"name": Path(getattr(self.model, "path", "") or "").name, "config": self._model_config()},
            "system": self.system,
            "system_ids": self.system_ids,
            "stateless": self.stateless,
            "params": params,
            "turns": [dataclasses.asdict(t) for t in self.turns],
            "generator": base64.b64encode(self.generator.get_state().numpy().tobytes()).decode("ascii"),
        }
        states = {"state": self.state, "system_state": self.system_state, "regen_state": self._regen_state}
        tmp_zip = path.with_name(path.name + ".tmp")
        with tempfile.TemporaryDirectory() as tmp:
            with zipfile.ZipFile(tmp_zip, "w") as z:
                z.writestr("session.json", json.dumps(meta, ensure_ascii=False))
                for name, st in states.items():
                    if st is not None:
                        z.write(st.save(Path(tmp) / f"{name}.safetensors"), f"{name}.safetensors")
        os.replace(tmp_zip, path)
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Replace this session by the one saved in `path` (same model required)."""
        from ..state import State

        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        bad = StateError(f"{path}: not an rwkv-engine chat session file")
        try:
            with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory() as tmp:
                meta = json.loads(z.read("session.json").decode("utf-8"))
                if not isinstance(meta, dict) or meta.get("format") != SESSION_FORMAT:
                    raise bad
                saved = meta["model"]["config"]
                if saved != self._model_config():
                    raise StateError(f"{path}: the session was saved with another model "
                                     f"({meta['model'].get('name') or 'unknown'}: {saved})")
                states = {}
                for name in ("state", "system_state", "regen_state"):
                    if f"{name}.safetensors" in z.namelist():
                        z.extract(f"{name}.safetensors", tmp)
                        st = State.load(Path(tmp) / f"{name}.safetensors", device=self.system_state.device)
                        if st.signature != self.system_state.signature:
                            raise StateError(f"{path}: its state belongs to another model ({st.signature})")
                        states[name] = st
                p = dict(meta["params"])
                p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
                params = chat_params(SamplingParams(**p))
                turns = [Turn(**t) for t in meta["turns"]]
                system, system_ids, stateless = str(meta["system"]), list(meta["system_ids"]), bool(meta["stateless"])
                rng = torch.frombuffer(bytearray(base64.b64decode(meta["generator"])), dtype=torch.uint8)
                if "state" not in states or "system_state" not in states:
                    raise bad
        except (zipfile.BadZipFile, KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
            if isinstance(e, RWKVEngineError):
                raise
            raise bad from None
        self.system, self.system_ids, self.system_state = system, system_ids, states["system_state"]
        self.stateless, self.params, self.turns = stateless, params, turns
        self.state, self._regen_state = states["state"], states.get("regen_state")
        self.last_stats = None
        try:
            self.generator.set_state(rng)
        except RuntimeError:  # saved on another kind of device: keep going with a fresh seed
            self._seed(self.params.seed)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _parse_value(field: str, text: str):
    if field in ("max_tokens", "seed") and text.lower() in ("none", "null", ""):
        return None
    try:
        return int(text) if field in ("top_k", "max_tokens", "seed") else float(text)
    except ValueError:
        raise InputError(f"{field}: not a number: {text!r}") from None


# --- the terminal loop ----------------------------------------------------------------------------


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    parser.add_argument("--system", metavar="TEXT", default=None,
                        help='system prompt, sent as "System: TEXT" before the conversation and kept in effect '
                             "every round ('' for none; default: the standard RWKV greeting exchange)")
    parser.add_argument("--stateless", action="store_true",
                        help="answer every message from the system prompt alone (no memory of earlier turns)")
    parser.add_argument("--load", metavar="FILE", help="resume a session saved with /save")
    common.add_sampling_args(parser, DEFAULTS)


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
                s.load(rest)
                self.say(f"(loaded {rest}: {_plural(len(s.turns), 'turn')})")
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
    params = common.sampling_params(args, DEFAULTS)
    if args.load is not None and not Path(args.load).is_file():
        raise InputError(f"{args.load}: no such file")
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    model, tokenizer = common.load_model(args, progress=True)
    t0 = time.perf_counter()
    session = ChatSession(model, tokenizer, params, system=args.system, stateless=args.stateless)
    if args.load is not None:
        session.load(args.load)
    c = model.config
    name = Path(getattr(model, "path", "") or args.model).name
    notes = [f"system prompt {len(session.system_ids)} tokens in {time.perf_counter() - t0:.2f}s"]
    if session.stateless:
        notes.append("stateless")
    if args.load is not None:
        notes.append(f"resumed {_plural(len(session.turns), 'turn')}")
    print(f"rwkv-engine chat: {name} (RWKV-{c.version}, {c.n_layer} layers, {c.n_embd} wide); {'; '.join(notes)}.")
    print("Type /help for commands, /exit or Ctrl-D to quit.\n", flush=True)
    _Terminal(session).loop()
    return 0
