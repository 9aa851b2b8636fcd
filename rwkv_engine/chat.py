"""A chat with an RWKV World model: the conversation, its recurrent states, settings and session files.

The conversation is the World chat format (docs/formats.md D), fed to the model as one growing text:

    {system}User: {message 1}\n\nAssistant:{reply 1}\n\nUser: {message 2}\n\nAssistant:{reply 2}\n\n...

* The system preamble is by default the exchange every RWKV front end seeds ("User: hi\n\n
  Assistant: Hi. I am your assistant ...\n\n"); a system text replaces it with
  "System: TEXT\n\n", an empty one removes it. Its state is computed once and kept: the
  conversation state always continues from it, and /reset goes back to it without any prefill.
  Stateless, every message starts from the system state again.
* A message is normalised so that it never contains "\n\n", the turn separator: CRLF -> LF,
  stripped, runs of newlines folded to one.
* A reply ends at "\n\n" (not shown) or after max_tokens; token 0 (end of text) is banned.
  The space the model puts after "Assistant:" is part of the conversation but not shown.
* Whatever the model generated past the end of the reply (a token like "\n\n\n" or ".\n\n")
  is not kept: the conversation holds exactly reply + "\n\n", re-read from the state before the
  reply when needed. So the state after any number of turns is the state of prefilling the
  conversation's token ids (`ChatSession.conversation_ids()`) in one go.

Sampling defaults are `sampling.CHAT` (ChatRWKV's chat demo); at most 500 tokens a reply.
The terminal front end is rwkv_engine/cli/chat.py; tests and other front ends drive `ChatSession` directly.

Other chat templates (rwkv_engine/templates; `g1` for RWKV-7 G1 models) render the system text
and each message the same way, one turn at a time: "System: TEXT\n\n" (no default preamble
but World's), then the template's turn for each message with its generation prompt. With `g1`
the generation prompt chooses thinking (`think`: off, on, bit, lot -> "Assistant: <think></think"
or "Assistant: <think", with " think a bit" / " think a lot" after the message). A reply's
thought is yielded as `Thought` pieces (str), its answer as plain str. Unlike the server, which
renders the history anew for every request (without old thoughts, as the template says), the
conversation keeps what the model read and wrote, thoughts included: its state is never
recomputed, and `conversation_ids()` still equals one prefill of the whole conversation.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .chat_format import TURN_SEPARATOR
from .chat_format import normalize_text as normalize_message
from .config import ModelConfig
from .errors import InputError, RWKVEngineError, StateError
from .generation import GenerationStats, generate
from .reasoning import ReasoningSplitter, reply_start
from .sampling import SamplingParams
from .sampling_params import CHAT_SESSION
from .speculative import DEFAULT_MAX_DRAFT
from .templates import ChatTemplate, builtin, check
from .tokenizer import EOS_TOKEN_ID

DEFAULT_SYSTEM = (
    "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full details. "
    "Please feel free to ask any question and I will always answer it.\n\n"
)

# SamplingParams fields: the chat preset; `chat_params` adds the chat rules on top.
DEFAULTS = CHAT_SESSION  # (defined with the other presets, where the CLI reads it without torch)

SESSION_FORMAT = "rwkv-engine-chat/1"
# Largest session.json a session file may inflate to (a long chat's text and token ids are far
# less); a state entry may be at most twice the model's state (plus its header).
MAX_SESSION_JSON = 64 << 20

# /set names (and short aliases) -> SamplingParams fields
SETTABLE = {
    "temperature": "temperature",
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "presence_penalty": "presence_penalty",
    "presence": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "frequency": "frequency_penalty",
    "penalty_decay": "penalty_decay",
    "decay": "penalty_decay",
    "max_tokens": "max_tokens",
    "seed": "seed",
}


# /think modes -> the template's keyword arguments (the same mapping as the server's reasoning_effort)
THINK = {"off": "none", "on": "medium", "bit": "low", "lot": "high"}


def system_preamble(system: str | None, template: ChatTemplate | None = None) -> str:
    """The text before the first turn: the default exchange (World's), the template's system
    turn ("System: ...\\n\\n"), or nothing."""
    template = template or builtin("world")
    if system is None:
        return DEFAULT_SYSTEM if template.name == "world" else ""
    if not normalize_message(system):
        return ""
    return template.render([{"role": "system", "content": system}], add_generation_prompt=False)


def turn_prompt(message: str, template: ChatTemplate | None = None, think: str = "off") -> str:
    """One message and the generation prompt after it, as the template renders them."""
    effort = THINK[think]
    thinking = effort != "none"
    return (template or builtin("world")).render(
        [{"role": "user", "content": message}], thinking=thinking, enable_thinking=thinking, reasoning_effort=effort
    )


class Thought(str):
    """A piece of a reply's thought (the rest of a reply's pieces are plain str)."""


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def chat_params(params: SamplingParams) -> SamplingParams:
    """`params` with what chat needs on top: stop at "\\n\\n", token 0 banned, no stop tokens."""
    return params.replace(
        stop=tuple(dict.fromkeys((TURN_SEPARATOR, *params.stop))),
        banned_token_ids=tuple(dict.fromkeys((EOS_TOKEN_ID, *params.banned_token_ids))),
        stop_token_ids=(),
    )


@dataclass
class Turn:
    user: str  # the normalised message
    reply: str  # the reply as generated (leading space kept), without the separator
    prompt_ids: list[int]  # "User: {user}\n\nAssistant:"
    reply_ids: list[int]  # reply + "\n\n", as the state has read it
    finish_reason: str  # "stop" | "length" | "interrupted"


class ChatSession:
    """The conversation, its states and settings (what `rwkv-engine chat` drives).

    ask(message) / regen() return an iterator of display text; the turn is recorded when the
    iterator ends, also when it ends early (Ctrl-C): then the partial reply is kept and closed
    with the separator.
    """

    def __init__(
        self,
        model,
        tokenizer,
        params: SamplingParams | None = None,
        system: str | None = None,
        stateless: bool = False,
        speculative=None,
        max_draft: int = DEFAULT_MAX_DRAFT,
        template: ChatTemplate | None = None,
        think: str = "off",
    ):
        self.model = model
        self.template = template or builtin("world")
        self.think = think
        # generate()'s speculative decoding for every reply ("lookup", "draft", a Drafter; None: off)
        self.speculative, self.max_draft = speculative, max_draft
        self.tokenizer = tokenizer
        self.params = chat_params(params if params is not None else SamplingParams(**DEFAULTS))
        self.stateless = stateless
        self.last_stats: GenerationStats | None = None
        self.system = system_preamble(system, self.template)
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
        return self._reply(self.turns[-1].user, self._regen_state, replace=True)

    def _reply(self, message: str, before, replace: bool = False) -> Iterator[str]:
        prompt = turn_prompt(message, self.template, self.think)
        prompt_ids = self.tokenizer.encode(prompt)
        gen = generate(
            self.model,
            self.tokenizer,
            prompt_ids,
            self.params,
            state=before,
            generator=self.generator,
            speculative=self.speculative,
            max_draft=self.max_draft,
        )
        split = ReasoningSplitter(reply_start(prompt, self.template.thinks))
        try:
            for chunk in gen:
                yield from _pieces(split.push(chunk))
            yield from _pieces(split.finish())
        finally:
            self._close_turn(message, before, prompt_ids, gen, replace)

    def _close_turn(self, message: str, before, prompt_ids: list[int], gen, replace: bool) -> None:
        if gen.prompt_state is None:
            return  # stopped before the message was read: the conversation is unchanged
        # The conversation keeps exactly reply + separator: the generated tokens that spell a
        # prefix of it, then the rest encoded. Tokens past it (a stop inside a token, text held
        # back when interrupted) are dropped and the state re-read from the prompt state.
        target = (gen.text + TURN_SEPARATOR).encode("utf-8")
        kept, n = [], 0
        for t in gen.tokens:
            b = self.tokenizer.decode_bytes([t])
            if target[n : n + len(b)] != b:
                break
            kept.append(t)
            n += len(b)
        rest = self.tokenizer.encode_bytes(target[n:]) if n < len(target) else []
        if len(kept) == len(gen.tokens):
            state = self.model.forward(rest, state=gen.state)[1] if rest else gen.state
        else:
            state = self.model.forward(kept + rest, state=gen.prompt_state)[1]
        if replace:
            self.turns.pop()
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
                raise InputError(
                    f"/set takes KEY=VALUE with KEY one of {', '.join(sorted(set(SETTABLE.values())))}; got {item!r}"
                )
            changes[field] = _parse_value(field, value.strip())
        self.params = chat_params(self.params.replace(**changes))
        if "seed" in changes:
            self._seed(self.params.seed)

    def set_think(self, mode: str) -> None:
        if mode not in THINK:
            raise InputError(f"/think takes one of {', '.join(THINK)}; got {mode!r}")
        self.think = mode

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
            sp = s.speculative
            if sp is not None:
                lines.append(
                    f"speculative: {sp.tokens_per_pass:.2f} tokens per pass, "
                    f"{100 * sp.acceptance_rate:.0f}% of {sp.drafted} drafted accepted"
                )
        lines.append(
            f"conversation: {len(self.conversation_ids())} tokens (system {len(self.system_ids)}), "
            f"{plural(len(self.turns), 'turn')}{' (stateless)' if self.stateless else ''}; state: {self.state.nbytes} bytes"
        )
        return "\n".join(lines)

    # --- files ----------------------------------------------------------------------------------

    def _model_config(self) -> dict:
        return dataclasses.asdict(self.model.config)

    def _saved_with_this_model(self, saved: dict) -> bool:
        """Whether a session's saved model config is this model's: compared as ModelConfigs, so
        a field added since it was saved takes its default and JSON's lists are tuples again."""
        try:
            return ModelConfig(**saved) == self.model.config
        except (TypeError, RWKVEngineError):  # unknown fields, impossible values
            return False

    def save(self, path: str | os.PathLike) -> Path:
        """Write the session as one zip file: session.json plus the states (safetensors)."""
        path = Path(path)
        params = dataclasses.asdict(self.params)
        params["logit_bias"] = {str(k): v for k, v in self.params.logit_bias.items()}
        meta = {
            "format": SESSION_FORMAT,
            "model": {"name": Path(self.model.path or "").name, "config": self._model_config()},
            "system": self.system,
            "system_ids": self.system_ids,
            "stateless": self.stateless,
            # the conversation's format: a resumed session renders its next turns as these did
            "template": {"name": self.template.name, "source": self.template.source, "text": self.template.text},
            "think": self.think,
            "params": params,
            "turns": [dataclasses.asdict(t) for t in self.turns],
            "generator": base64.b64encode(self.generator.get_state().numpy().tobytes()).decode("ascii"),
        }
        states = {"state": self.state, "system_state": self.system_state, "regen_state": self._regen_state}
        tmp_zip = path.with_name(path.name + ".tmp")
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(tmp_zip, "w") as z:
            z.writestr("session.json", json.dumps(meta, ensure_ascii=False))
            for name, st in states.items():
                if st is not None:
                    z.write(st.save(Path(tmp) / f"{name}.safetensors"), f"{name}.safetensors")
        os.replace(tmp_zip, path)
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Replace this session by the one saved in `path` (same model required)."""
        from .state import State

        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        bad = StateError(f"{path}: not an rwkv-engine chat session file")
        state_limit = 2 * self.system_state.nbytes + (1 << 20)

        def entry_size(z: zipfile.ZipFile, name: str, limit: int) -> None:
            # Checked before reading: zipfile inflates at most the declared size (and checks the CRC).
            size = z.getinfo(name).file_size
            if size > limit:
                raise StateError(f"{path}: its {name} would inflate to {size} bytes; at most {limit} fit this model")

        try:
            with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory() as tmp:
                entry_size(z, "session.json", MAX_SESSION_JSON)
                meta = json.loads(z.read("session.json").decode("utf-8"))
                if not isinstance(meta, dict) or meta.get("format") != SESSION_FORMAT:
                    raise bad
                _check_session(meta, path, self.model.config.vocab_size)
                saved = meta["model"]["config"]
                if not self._saved_with_this_model(saved):
                    raise StateError(
                        f"{path}: the session was saved with another model "
                        f"({meta['model'].get('name') or 'unknown'}: {saved})"
                    )
                states = {}
                for name in ("state", "system_state", "regen_state"):
                    if f"{name}.safetensors" in z.namelist():
                        entry_size(z, f"{name}.safetensors", state_limit)
                        z.extract(f"{name}.safetensors", tmp)
                        st = State.load(Path(tmp) / f"{name}.safetensors", device=self.system_state.device)
                        try:  # as the server checks a saved state: a bad one fails the first message
                            st.check_usable(self.model)
                        except StateError as e:
                            raise StateError(f"{path}: its {name}: {e}") from None
                        states[name] = st
                p = dict(meta["params"])
                p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
                try:
                    params = chat_params(SamplingParams(**p))
                except InputError as e:
                    raise StateError(f"{path}: session.json: params: {e}") from None
                turns = [Turn(**t) for t in meta["turns"]]
                system, system_ids, stateless = str(meta["system"]), list(meta["system_ids"]), bool(meta["stateless"])
                rng = torch.frombuffer(bytearray(base64.b64decode(meta["generator"])), dtype=torch.uint8)
                template, think = _saved_template(meta, path, self.template, self.think)
                if "state" not in states or "system_state" not in states:
                    raise bad
        except (
            zipfile.BadZipFile,
            zlib.error,
            EOFError,
            KeyError,
            TypeError,
            ValueError,  # UnicodeDecodeError, JSONDecodeError, binascii.Error included
            OverflowError,
            RecursionError,
            NotImplementedError,  # a compression method zipfile does not have
            RuntimeError,  # an encrypted entry
        ) as e:
            if isinstance(e, RWKVEngineError):
                raise
            raise bad from None
        self.system, self.system_ids, self.system_state = system, system_ids, states["system_state"]
        self.stateless, self.params, self.turns = stateless, params, turns
        self.template, self.think = template, think
        self.state, self._regen_state = states["state"], states.get("regen_state")
        self.last_stats = None
        try:
            self.generator.set_state(rng)
        except RuntimeError:  # saved on another kind of device: keep going with a fresh seed
            self._seed(self.params.seed)


def _saved_template(meta: dict, path: Path, template: ChatTemplate, think: str) -> tuple[ChatTemplate, str]:
    """The chat template and /think mode a session was saved with (files written before they
    were recorded: the current ones). The template's text is checked as a template file is."""
    saved = meta.get("template")
    if saved is not None:
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k), str) for k in ("name", "source", "text")):
            raise StateError(f"{path}: session.json: template is not a name, source and text")
        template = ChatTemplate(saved["name"], saved["text"], saved["source"])
        try:
            check(template)
        except InputError as e:
            raise StateError(f"{path}: session.json: {e}") from None
    think = meta.get("think", think)
    if think not in THINK:
        raise StateError(f"{path}: session.json: think is not one of {', '.join(THINK)}")
    return template, think


def _check_session(meta: dict, path: Path, vocab_size: int) -> None:
    """StateError unless session.json's fields have the types `ChatSession.save` writes."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise StateError(f"{path}: session.json: {what}")

    def ids(value) -> bool:
        return isinstance(value, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in value
        )

    need(isinstance(meta.get("model"), dict) and isinstance(meta["model"].get("config"), dict), "no model config")
    need(isinstance(meta.get("system"), str), "system is not text")
    need(ids(meta.get("system_ids")), "system_ids are not token ids of this model")
    need(isinstance(meta.get("stateless"), bool), "stateless is not true or false")
    need(isinstance(meta.get("params"), dict) and isinstance(meta["params"].get("logit_bias", {}), dict), "bad params")
    need(isinstance(meta.get("generator"), str), "bad generator state")
    turns = meta.get("turns")
    need(isinstance(turns, list), "turns is not a list")
    fields = {f.name for f in dataclasses.fields(Turn)}
    for i, t in enumerate(turns):
        need(isinstance(t, dict) and set(t) == fields, f"turn {i + 1} does not have the fields {sorted(fields)}")
        need(
            isinstance(t["user"], str) and isinstance(t["reply"], str) and isinstance(t["finish_reason"], str),
            f"turn {i + 1}: user, reply and finish_reason must be text",
        )
        need(ids(t["prompt_ids"]) and ids(t["reply_ids"]), f"turn {i + 1}: its ids are not token ids of this model")


def _pieces(parts) -> Iterator[str]:
    for kind, text in parts:
        yield Thought(text) if kind == "reasoning" else text


def _parse_value(field: str, text: str):
    if field in ("max_tokens", "seed") and text.lower() in ("none", "null", ""):
        return None
    try:
        return int(text) if field in ("top_k", "max_tokens", "seed") else float(text)
    except ValueError:
        raise InputError(f"{field}: not a number: {text!r}") from None
