"""`rwkv-engine chat` driven in a real pseudo-terminal (pexpect), plus ChatSession in-process.

The oracle for the conversation state is an independent one-shot prefill: the test rebuilds the
conversation's token ids from the format (the default preamble written out here, "User: {msg}
\\n\\nAssistant:" for each message, the replies as the screen showed them) and compares the saved
state with `model.forward(ids)` from a fresh state.
"""

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import rwkv_engine
from rwkv_engine.errors import InputError, StateError
from rwkv_engine.state import State
from rwkv_engine.tokenizer import WorldTokenizer

from .conftest import states_equal

pexpect = pytest.importorskip("pexpect")

REPO = Path(__file__).resolve().parents[1]
PREAMBLE = (
    "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full "
    "details. Please feel free to ask any question and I will always answer it.\n\n"
)


@pytest.fixture(scope="module")
def model_path(make_pth):
    return make_pth("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16)


@pytest.fixture(scope="module")
def model(model_path):
    return rwkv_engine.load(model_path)


@pytest.fixture(scope="module")
def tok():
    return WorldTokenizer()


class Chat:
    """One `rwkv-engine chat` process in a pseudo-terminal."""

    def __init__(self, model_path, cwd, *args):
        env = dict(os.environ, TERM="dumb", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        # SIGINT as a shell gives a foreground program: a test run started in the background of a
        # non-interactive shell inherits it ignored, and Python then leaves Ctrl-C ignored too.
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "rwkv_engine", "chat", str(model_path), *args],
            cwd=str(cwd),
            env=env,
            encoding="utf-8",
            timeout=60,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.child.expect_exact("User: ")
        self.banner = self.child.before

    def _screen(self) -> str:
        self.child.expect_exact("User: ")
        return self.child.before.replace("\r\n", "\n")

    def send(self, message: str) -> str:
        """Type a message; return the reply as shown."""
        self.child.sendline(message)
        screen = self._screen()
        assert screen.startswith(message + "\nAssistant: ") and screen.endswith("\n\n"), screen
        return screen[len(message + "\nAssistant: ") : -2]

    def command(self, line: str) -> str:
        self.child.sendline(line)
        screen = self._screen()
        assert screen.startswith(line + "\n"), screen
        return screen[len(line) + 1 :]

    def regen(self) -> str:
        out = self.command("/regen")
        assert out.startswith("Assistant: ") and out.endswith("\n\n"), out
        return out[len("Assistant: ") : -2]

    def exit(self) -> int:
        self.child.sendline("/exit")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


def read_session(path):
    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read("session.json"))
        states = {}
        for name in z.namelist():
            if name.endswith(".safetensors"):
                z.extract(name, path.parent / (path.stem + "_x"))
                states[name[: -len(".safetensors")]] = State.load(path.parent / (path.stem + "_x") / name)
    return meta, states


def conversation(tok, preamble, messages, turns):
    """The ids the state should have read, rebuilt from the format; checks each turn on the way."""
    ids = tok.encode(preamble) if preamble else []
    for msg, turn in zip(messages, turns):
        assert turn["user"] == msg
        assert turn["prompt_ids"] == tok.encode(f"User: {msg}\n\nAssistant:")
        assert tok.decode(turn["reply_ids"]) == turn["reply"] + "\n\n"
        ids = ids + turn["prompt_ids"] + turn["reply_ids"]
    return ids


def shown(reply: str) -> str:
    return reply[1:] if reply.startswith(" ") else reply


# --- in a pseudo-terminal ---------------------------------------------------------------------


def test_rounds_resume_regen_reset(model_path, model, tok, tmp_path):
    # "\n" and "\n\n\n" made likely, so replies end on "\n\n" split over tokens or inside one token.
    args = ["--seed", "1", "--top-p", "1", "--max-tokens", "8", "--logit-bias", "11=9", "--logit-bias", "3328=8"]
    chat = Chat(model_path, tmp_path, *args)
    messages = ["hello there", "how are you?", "tell me more", "ok"]
    replies = [chat.send(m) for m in messages]
    assert chat.command("/save s1.zip").startswith("(saved to s1.zip)")
    after_save = chat.send("and then?")
    stats = chat.command("/stats")
    assert "tok/s" in stats and "5 turns" in stats and "bytes" in stats
    assert chat.exit() == 0

    # The state after N rounds is the one-shot prefill of system + dialogue.
    meta, states = read_session(tmp_path / "s1.zip")
    turns = meta["turns"]
    assert [shown(t["reply"]) for t in turns] == replies  # what the screen showed, nothing more
    assert all("\n\n" not in r for r in replies)
    assert {t["finish_reason"] for t in turns} == {"stop", "length"}  # both endings exercised
    ids = conversation(tok, PREAMBLE, messages, turns)
    text = PREAMBLE + "".join(f"User: {m}\n\nAssistant:{t['reply']}\n\n" for m, t in zip(messages, turns))
    assert tok.decode(ids) == text
    states_equal(states["state"], model.forward(ids)[1])
    states_equal(states["system_state"], model.forward(tok.encode(PREAMBLE))[1])
    last = len(turns[-1]["prompt_ids"]) + len(turns[-1]["reply_ids"])
    states_equal(states["regen_state"], model.forward(ids[:-last])[1])

    # A new process resumed from the file continues exactly as the original did (state and RNG).
    chat = Chat(model_path, tmp_path, "--load", "s1.zip")
    assert "resumed 4 turns" in chat.banner
    assert chat.send("and then?") == after_save

    # /regen: greedy from the state before the message gives the same answer again; from any
    # other state (e.g. after the first answer) it would not.
    assert "temperature=0.0" in chat.command("/set temperature=0")
    first = chat.send("what is this")
    assert chat.regen() == first
    chat.command("/save s2.zip")
    meta, states = read_session(tmp_path / "s2.zip")
    messages += ["and then?", "what is this"]
    assert [t["user"] for t in meta["turns"]] == messages  # the regenerated turn replaced the old one
    states_equal(states["state"], model.forward(conversation(tok, PREAMBLE, messages, meta["turns"]))[1])

    # /reset: back to the cached system state itself
    assert "reset" in chat.command("/reset")
    chat.command("/save s3.zip")
    meta, states = read_session(tmp_path / "s3.zip")
    assert meta["turns"] == []
    assert all(torch.equal(t, getattr(states["system_state"], k)) for k, t in states["state"].items())
    assert chat.exit() == 0


def test_stateless_system_prompt_and_ctrl_c(model_path, model, tok, tmp_path):
    system = "System: You are a pirate.\n\n"
    # No token that holds a newline: a reply can never end on "\n\n", so the long one below is
    # still running when Ctrl-C comes (sampled at temperature 1 it otherwise ended early now and then).
    no_newlines = [a for i in range(1, 65536) if b"\n" in tok.decode_bytes([i]) for a in ("--logit-bias", f"{i}=-inf")]
    chat = Chat(
        model_path,
        tmp_path,
        "--stateless",
        "--system",
        "You are a pirate.",
        "--temperature",
        "0",
        "--max-tokens",
        "5",
        *no_newlines,
    )
    a = chat.send("hello")
    chat.send("what?")
    assert chat.send("hello") == a  # every turn starts from the system state
    chat.command("/save s5.zip")
    meta, states = read_session(tmp_path / "s5.zip")
    assert meta["stateless"] and meta["system"] == system
    # the state is the system prompt plus the last turn only
    ids = conversation(tok, system, ["hello"], meta["turns"][-1:])
    states_equal(states["state"], model.forward(ids)[1])
    states_equal(states["system_state"], model.forward(tok.encode(system))[1])

    # Ctrl-C during a reply stops the reply, not the program; the partial reply is kept.
    chat.command("/set temperature=1 max_tokens=100000")
    chat.child.sendline("tell me everything")
    chat.child.expect(r"Assistant: [\s\S]")  # the reply has started
    time.sleep(0.3)
    chat.child.sendintr()
    chat.child.expect_exact("[interrupted]")
    chat.child.expect_exact("User: ")
    chat.command("/save s4.zip")
    meta, states = read_session(tmp_path / "s4.zip")
    turn = meta["turns"][-1]
    assert turn["finish_reason"] == "interrupted" and len(turn["reply_ids"]) > 1
    states_equal(states["state"], model.forward(conversation(tok, system, ["tell me everything"], [turn]))[1])
    # Ctrl-C at the prompt does not quit either; Ctrl-D does.
    chat.child.sendintr()
    chat.child.expect_exact("Ctrl-D quits")
    chat.child.expect_exact("User: ")
    chat.child.sendeof()
    chat.child.expect(pexpect.EOF)
    chat.child.close()
    assert chat.child.exitstatus == 0


# --- ChatSession in-process -------------------------------------------------------------------


def test_session_behaviour(model, tok, tmp_path):
    from rwkv_engine.chat import DEFAULTS, ChatSession, normalize_message
    from rwkv_engine.sampling import SamplingParams

    assert normalize_message("  a\r\n\r\n\nb\n\nc  ") == "a\nb\nc"
    greedy = SamplingParams(**DEFAULTS).replace(temperature=0, max_tokens=3)

    def replies(session, messages):
        return ["".join(session.ask(m)) for m in messages]

    s = ChatSession(model, tok, greedy)
    assert s.system_ids == tok.encode(PREAMBLE)
    stateful = replies(s, ["hello", "what?", "hello"])
    assert stateful[2] != stateful[0]  # with memory, the same message gets another answer
    s.reset()
    assert s.state is s.system_state and s.turns == []  # no prefill: the cached state itself
    with pytest.raises(InputError):
        s.regen()
    with pytest.raises(InputError):
        s.ask(" \n\n ")
    # the system prompt is in effect: another one, another answer
    assert replies(ChatSession(model, tok, greedy, system="You are a pirate."), ["hello"])[0] != stateful[0]
    empty = ChatSession(model, tok, greedy, system="")
    assert empty.system_ids == [] and empty.system == ""

    sampled = SamplingParams(**DEFAULTS).replace(max_tokens=4, top_p=0.9)
    same = [
        replies(ChatSession(model, tok, sampled.replace(seed=seed), system=""), ["hi", "more"]) for seed in (5, 5, 6)
    ]
    assert same[0] == same[1] and same[0] != same[2]

    with pytest.raises(InputError):
        s.set(["top_p=3"])
    with pytest.raises(InputError):
        s.set(["colour=red"])
    s.set(["temp=0.5", "top-p=0.2", "max_tokens=none"])
    assert (s.params.temperature, s.params.top_p, s.params.max_tokens) == (0.5, 0.2, None)
    assert s.params.stop == ("\n\n",) and 0 in s.params.banned_token_ids  # chat rules survive /set

    with pytest.raises(InputError):
        s.load(tmp_path / "missing.zip")
    (tmp_path / "junk.zip").write_text("not a zip")
    with pytest.raises(StateError):
        s.load(tmp_path / "junk.zip")
    s.save(tmp_path / "ok.zip")
    with zipfile.ZipFile(tmp_path / "ok.zip") as z, zipfile.ZipFile(tmp_path / "other.zip", "w") as out:
        for name in z.namelist():
            data = z.read(name)
            if name == "session.json":
                meta = json.loads(data)
                meta["model"]["config"]["n_layer"] = 3
                data = json.dumps(meta)
            out.writestr(name, data)
    with pytest.raises(StateError, match="another model"):
        s.load(tmp_path / "other.zip")


def test_interrupted_regen_keeps_the_turn(model, tok):
    from rwkv_engine.chat import DEFAULTS, ChatSession
    from rwkv_engine.sampling import SamplingParams

    class Interruptible:
        """The model, but Ctrl-C arrives during the forward call number `at`."""

        def __init__(self):
            self.config, self.path, self.calls, self.at = model.config, model.path, 0, None

        def new_state(self, *a, **k):
            return model.new_state(*a, **k)

        def forward(self, *a, **k):
            self.calls += 1
            if self.calls == self.at:
                raise KeyboardInterrupt
            return model.forward(*a, **k)

    m = Interruptible()
    s = ChatSession(m, tok, SamplingParams(**DEFAULTS).replace(temperature=0, max_tokens=3), system="")
    "".join(s.ask("hello"))
    turns, state = list(s.turns), s.state
    m.at = m.calls + 1  # during the prefill of the regenerated message
    with pytest.raises(KeyboardInterrupt):
        "".join(s.regen())
    assert s.turns == turns and s.state is state
    m.at = m.calls + 3  # during the decode: the partial reply replaces the old one
    with pytest.raises(KeyboardInterrupt):
        "".join(s.regen())
    assert len(s.turns) == 1 and s.turns[0].finish_reason == "interrupted"
    states_equal(s.state, model.forward(s.conversation_ids())[1])


def test_chat_load_of_an_unusable_session_is_exit_2(model_path, tmp_path):
    """Issue 28 R5: `chat --load` of a file that is no usable session (missing, not a zip, a
    session whose params do not validate) is one stderr line and exit 2, before any prompt."""
    bad_params = tmp_path / "params.zip"
    with zipfile.ZipFile(bad_params, "w") as z:
        z.writestr("session.json", json.dumps({"format": "x"}))
    (tmp_path / "junk.zip").write_text("not a zip")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for name in ("missing.zip", "junk.zip", "params.zip"):
        out = subprocess.run(
            [sys.executable, "-m", "rwkv_engine", "chat", str(model_path), "--load", name],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (name, out.stderr[-2000:])
        assert "Traceback" not in out.stderr and name in lines[-1], (name, lines)


def test_g1_thinking_in_a_terminal(model_path, tok, tmp_path):
    """`chat --chat-template g1`: /think on|off|bit|lot writes the G1 generation prompts (checked
    against rwkv-tl's template, tests/test_templates.py), the thought is shown dimmed before the
    answer, and --hide-thoughts shows the answer alone."""
    from rwkv_engine.cli.chat import DIM, UNDIM
    from rwkv_engine.reasoning import split

    from .test_templates import render_rwkv_tl

    # "</", "think", ">" likely: this random model then ends its thoughts (and never writes "\n\n").
    bias = [a for t in (754, 35762, 63) for a in ("--logit-bias", f"{t}=30")]
    flags = ["--chat-template", "g1", "--temperature", "1", "--top-p", "1", "--max-tokens", "24", "--seed", "2", *bias]
    chat = Chat(model_path, tmp_path, "--think", "on", *flags)
    assert "chat template g1" in chat.banner and "think on" in chat.banner
    shown = [chat.send(m) for m in ("hello", "and?")]
    assert "think=bit" in chat.command("/think bit")
    chat.send("more")
    assert "think=off" in chat.command("/think off")
    assert DIM not in chat.send("plain")
    assert "/think takes one of off, on, bit, lot" in chat.command("/think maybe")
    chat.command("/save g1.zip")
    assert chat.exit() == 0

    meta, _ = read_session(tmp_path / "g1.zip")
    for turn, mode in zip(meta["turns"], [True, True, "bit", False]):
        message = [{"role": "user", "content": turn["user"] + (" think a bit" if mode == "bit" else "")}]
        assert turn["prompt_ids"] == tok.encode(render_rwkv_tl(message, thinking=bool(mode)))
    for screen, turn in zip(shown, meta["turns"]):
        thought, answer = split(turn["reply"], "thought>")
        assert screen == DIM + thought + (UNDIM + "\n" + answer if answer else UNDIM)
    assert any(UNDIM + "\n" in screen for screen in shown), shown  # (the bias makes the model end a thought)

    hidden = Chat(model_path, tmp_path, "--think", "on", "--hide-thoughts", *flags)
    assert [hidden.send(m) for m in ("hello", "and?")] == [s.partition(UNDIM + "\n")[2] for s in shown]
    assert hidden.exit() == 0


def test_session_file_keeps_template_and_think(model, tok, tmp_path):
    """/save records the chat template and /think mode; /load resumes with them, so the next
    turn's prompt is the saved template's rendering (checked against the template itself), not
    that of the session that loads it. A file without them keeps the current ones; a template
    that is not Jinja is refused as a bad session file."""
    from rwkv_engine.chat import DEFAULTS, ChatSession, turn_prompt
    from rwkv_engine.sampling import SamplingParams
    from rwkv_engine.templates import builtin

    greedy = SamplingParams(**DEFAULTS).replace(temperature=0, max_tokens=2)
    g1 = ChatSession(model, tok, greedy, system="", template=builtin("g1"), think="bit")
    "".join(g1.ask("hi"))
    g1.save(tmp_path / "g1.zip")
    world = ChatSession(model, tok, greedy)
    world.load(tmp_path / "g1.zip")
    assert (world.template.name, world.template.text, world.think) == ("g1", builtin("g1").text, "bit")
    "".join(world.ask("and then?"))
    want = builtin("g1").render([{"role": "user", "content": "and then?"}], thinking=True, reasoning_effort="low")
    assert world.turns[-1].prompt_ids == tok.encode(want) == tok.encode(turn_prompt("and then?", world.template, "bit"))

    def rewritten(name, change):
        with zipfile.ZipFile(tmp_path / "g1.zip") as z, zipfile.ZipFile(tmp_path / name, "w") as out:
            for entry in z.namelist():
                data = z.read(entry)
                if entry == "session.json":
                    meta = json.loads(data)
                    change(meta)
                    data = json.dumps(meta)
                out.writestr(entry, data)
        return tmp_path / name

    old = rewritten("old.zip", lambda m: [m.pop("template"), m.pop("think")])
    fresh = ChatSession(model, tok, greedy, think="on")
    fresh.load(old)
    assert (fresh.template.name, fresh.think) == ("world", "on")
    for name, change in (
        ("bad_jinja.zip", lambda m: m["template"].update(text="{% if %}")),
        ("bad_think.zip", lambda m: m.update(think="maybe")),
        ("bad_template.zip", lambda m: m.update(template="g1")),
    ):
        with pytest.raises(StateError, match="session.json"):
            fresh.load(rewritten(name, change))
    assert (fresh.template.name, fresh.think) == ("world", "on")  # (a refused file changes nothing)
