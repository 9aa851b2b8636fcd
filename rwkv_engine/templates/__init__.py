"""Chat templates: a conversation (OpenAI-style messages) -> the prompt text a model continues.

A template is a Jinja file rendered in jinja2's sandbox, the way transformers renders a model's
`chat_template` (an immutable sandboxed environment; `tojson` without HTML escaping, keys in
their order, non-ASCII kept; `raise_exception`, `strftime_now`), with the usual variables:
`messages` (dicts with role, content, tool_calls, tool_call_id, reasoning_content),
`tools` (OpenAI tool definitions), `add_generation_prompt`, `bos_token`, and keyword
arguments of the caller (`thinking`, `enable_thinking`, `reasoning_effort`, ...). Templates
from a model's files are untrusted code: the sandbox is what keeps them from reaching Python.

Built in (files beside this module, written for rwkv-engine):

    world   the World chat format, byte for byte what rwkv-engine rendered before templates
            existed (tools and calls in our <tool_call> convention, rwkv_engine/tool_calls.py)
    g1      the RWKV-7 G1 format: "<think" / "<think></think" at the end of the prompt chooses
            thinking, tools and ```json calls as the G1 models were trained on them

`resolve(spec, model_path, version)` picks one: a built-in name, a .jinja file, or "auto" (the
model's own template when its files carry one -- a Hugging Face `tokenizer_config.json`
`chat_template`, a `chat_template.jinja` or `<stem>.jinja` beside the weights, a GGUF's
`tokenizer.chat_template` -- else `g1` for a model recognised as a G1 one by its file,
directory or Hub name, or a GGUF's `general.name`, else `world`).

Nothing here imports torch: the command line resolves templates before the model loads.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..errors import InputError

HERE = Path(__file__).parent
BUILTIN = ("world", "g1")
AUTO = "auto"

# The G-series of RWKV-7 (G0, G1, G1a, G1a3, ... G1j) in a file, directory or Hub name:
# "rwkv7-g1j-2.9b-20260831-ctx16384.pth", "RWKV7-G1a3-13.3B-GGUF", "BlinkDL/rwkv7-g1".
G_SERIES = re.compile(r"(?i)(?:^|[^a-z0-9])g[01][a-z]?[0-9]?(?:[^a-z0-9.]|$)")


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template. name: a built-in name or the file it came from; source: why
    it was chosen (for the log line and /v1/models); text: the Jinja source."""

    name: str
    text: str
    source: str = "given"

    @property
    def tool_format(self) -> str:
        """How tool calls are written and read: "world" (<tool_call>) or "g1" (```json blocks).
        A template of a model's own that lists tools the G1 way is read the G1 way."""
        return "world" if self.name == "world" or "```json" not in self.text else "g1"

    @property
    def thinks(self) -> bool:
        """The template knows reasoning models' <think> tags (rwkv_engine/reasoning.py)."""
        return "<think" in self.text

    @functools.cached_property
    def _compiled(self):
        return _environment().from_string(self.text)

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt of `messages`; kwargs are the template's keyword arguments (chat_template_kwargs)."""
        import jinja2

        variables = dict(kwargs, messages=messages, add_generation_prompt=add_generation_prompt, bos_token="")
        if tools:
            variables["tools"] = tools
        try:
            return self._compiled.render(**variables)
        except jinja2.TemplateError as e:
            raise InputError(f"the chat template {self.name} failed: {e}") from None


def builtin(name: str) -> ChatTemplate:
    return ChatTemplate(name, (HERE / f"{name}.jinja").read_text(encoding="utf-8"), "built in")


def from_file(path: str | Path, source: str = "given") -> ChatTemplate:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--chat-template {path}: cannot be read ({e})") from None
    template = ChatTemplate(str(path), text, source)
    check(template)
    return template


def check(template: ChatTemplate) -> None:
    """InputError when the template's Jinja does not compile (a missing end tag, ...)."""
    import jinja2

    try:
        template._compiled  # noqa: B018  (compiles)
    except jinja2.TemplateError as e:
        raise InputError(f"the chat template {template.name} is not valid Jinja: {e}") from None


def resolve(
    spec: str, model_path: str | None = None, version: str | None = None, asked: str | None = None
) -> ChatTemplate:
    """The template `spec` names: a built-in name, a .jinja file, or "auto" (module docstring).
    model_path: where the model's files are; asked: the name the user gave it (a Hub id), whose
    name also counts for recognising a G1 model."""
    if spec in BUILTIN:
        return builtin(spec)
    if spec != AUTO:
        if not Path(spec).is_file():
            raise InputError(f"--chat-template {spec!r}: neither {', '.join((AUTO, *BUILTIN))} nor a template file")
        return from_file(spec)
    own = model_template(model_path) if model_path else None
    if own is not None:
        return own
    names = [model_path, asked]
    if model_path and model_path.lower().endswith(".gguf"):  # (llama.cpp's files name their model inside)
        names += _gguf_strings(Path(model_path), ("general.name", "general.basename")).values()
    named = next((n for n in names if n and is_g1(n, version)), None)
    if named:
        t = builtin("g1")
        return ChatTemplate(t.name, t.text, f"auto: {Path(named).name} is named as a G1 model")
    t = builtin("world")
    return ChatTemplate(t.name, t.text, "auto: not recognised as a G1 model")


def is_g1(model_path: str, version: str | None = None) -> bool:
    """A model of RWKV-7's G series, by its name (the file, its directory, or a Hub id)."""
    if version is not None and not str(version).startswith("7"):
        return False
    path = Path(model_path)
    return any(G_SERIES.search(part) for part in (path.name, path.parent.name) if part)


def model_template(model_path: str) -> ChatTemplate | None:
    """The template a model's own files carry, or None (see the module docstring for where)."""
    path = Path(model_path)
    folder = path if path.is_dir() else path.parent
    candidates = [folder / "chat_template.jinja"]
    if path.is_file():
        candidates.insert(0, path.with_suffix(".jinja"))
    for file in candidates:
        if file.is_file():
            return from_file(file, f"auto: {file.name} beside the model")
    config = folder / "tokenizer_config.json"
    if path.is_dir() and config.is_file():
        text = _config_template(config)
        if text is not None:
            t = ChatTemplate(str(config), text, "auto: the model's tokenizer_config.json")
            check(t)
            return t
    if path.is_file() and path.suffix.lower() == ".gguf":
        text = _gguf_template(path)
        if text is not None:
            t = ChatTemplate(str(path), text, "auto: the GGUF's tokenizer.chat_template")
            check(t)
            return t
    return None


def _config_template(config: Path) -> str | None:
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, list):  # named templates: the one called "default"
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) and value.strip() else None


def _gguf_template(path: Path) -> str | None:
    return _gguf_strings(path, ("tokenizer.chat_template",)).get("tokenizer.chat_template")


def _gguf_strings(path: Path, keys) -> dict[str, str]:
    """The string metadata `keys` of a GGUF file that has them."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(path).fields
        return {k: bytes(fields[k].parts[fields[k].data[0]]).decode("utf-8") for k in keys if k in fields}
    except Exception:  # noqa: BLE001  (an unreadable GGUF fails later, where the model loads)
        return {}


# --- the sandbox --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _environment():
    """jinja2's immutable sandbox with what transformers gives a chat template."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
