"""State-only files (RWKV-PEFT time_state .pth / .safetensors, State.save) wherever a state is."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import rwkv_engine
from rwkv_engine import State, testing
from rwkv_engine.errors import StateError

IDS = [1, 5, 9, 200, 3, 77, 31]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rwkv_engine", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A state-tuned RWKV-7: the base checkpoint, its time_state alone, and the merged file."""
    d = tmp_path_factory.mktemp("states")
    sd = testing.random_state_dict("7", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=5, time_state=True)
    states = {k: v for k, v in sd.items() if k.endswith(".time_state")}
    base = {k: v for k, v in sd.items() if k not in states}
    return {
        "merged": testing.save_pth(sd, d / "merged.pth"),
        "base": testing.save_pth(base, d / "base.pth"),
        "peft": testing.save_pth(states, d / "persona.pth"),
        "states": states,
        "dir": d,
    }


def test_time_state_file_equals_merged_checkpoint(tuned, tmp_path):
    merged = rwkv_engine.load(tuned["merged"], dtype="fp32")
    base = rwkv_engine.load(tuned["base"], dtype="fp32")
    want, _ = merged.forward(IDS, merged.new_state())
    for path in (tuned["peft"], tmp_path / "persona.safetensors"):
        if path.suffix == ".safetensors":
            save_file({k: v.contiguous() for k, v in tuned["states"].items()}, str(path))
        state = rwkv_engine.load_state(base, path)
        got, _ = base.forward(IDS, state)
        assert torch.equal(got, want)
        plain, _ = base.forward(IDS, base.new_state())
        assert not torch.allclose(plain, want)  # the state mattered
    _, after = base.forward(IDS, base.new_state())
    after.save(tmp_path / "ours.safetensors")  # our own files load the same way
    assert rwkv_engine.load_state(base, tmp_path / "ours.safetensors").allclose(after)


def test_bad_state_files_refused(tuned, tmp_path):
    base = rwkv_engine.load(tuned["base"], dtype="fp32")
    other = {k: v[:2] for k, v in tuned["states"].items()}  # 2 heads: another model's shape
    testing.save_pth(other, tmp_path / "other.pth")
    with pytest.raises(StateError, match="another model"):
        rwkv_engine.load_state(base, tmp_path / "other.pth")
    nan = {k: v.clone() for k, v in tuned["states"].items()}
    next(iter(nan.values()))[0, 0, 0] = float("nan")
    testing.save_pth(nan, tmp_path / "nan.pth")
    with pytest.raises(StateError, match="NaN"):
        rwkv_engine.load_state(base, tmp_path / "nan.pth")
    State(dict(base.new_state().items()), "rwkv-7:L9:C1:A1:H1:N1").save(tmp_path / "alien.safetensors")
    with pytest.raises(StateError, match="another model"):
        rwkv_engine.load_state(base, tmp_path / "alien.safetensors")
    with pytest.raises(StateError, match="not a state file"):
        rwkv_engine.load_state(base, tuned["base"])  # a whole checkpoint is not a state


def _huge_states(tuned, base, where):
    """R1: finite but huge states (every value 3e38) as a time_state file and a State.save file."""
    testing.save_pth({k: torch.full_like(v, 3e38) for k, v in tuned["states"].items()}, where / "huge.pth")
    State({k: torch.full_like(v, 3e38) for k, v in base.new_state().items()}, base.new_state().signature).save(
        where / "huge.safetensors"
    )
    return ["huge.pth", "huge.safetensors"]


def test_huge_state_files_refused(tuned, tmp_path):
    """A state whose values are finite but too large for the model's arithmetic is refused at
    load, as a NaN one is: the model's output from it would be NaN or infinite."""
    base = rwkv_engine.load(tuned["base"], dtype="fp32")
    for name in _huge_states(tuned, base, tmp_path):
        with pytest.raises(StateError, match="NaN or infinite") as e:
            rwkv_engine.load_state(base, tmp_path / name)
        assert "\n" not in str(e.value)
    moderate = {k: v * 100 for k, v in tuned["states"].items()}  # large, and still usable: loads
    testing.save_pth(moderate, tmp_path / "moderate.pth")
    state = rwkv_engine.load_state(base, tmp_path / "moderate.pth")
    assert base.forward(IDS, state)[0].isfinite().all()


def test_cli_generate_state(tuned, tmp_path, capsys):
    args = ["--prompt", "User: hi\n\nAssistant:", "--max-tokens", "8", "--temperature", "0", "--dtype", "fp32"]
    merged = _cli("generate", str(tuned["merged"]), *args)
    assert merged.returncode == 0, merged.stderr
    with_state = _cli("generate", str(tuned["base"]), "--state", str(tuned["peft"]), *args)
    assert with_state.returncode == 0, with_state.stderr
    assert with_state.stdout == merged.stdout
    nan = {k: torch.full_like(v, float("nan")) for k, v in tuned["states"].items()}
    testing.save_pth(nan, tmp_path / "nan.pth")
    bad = _cli("generate", str(tuned["base"]), "--state", str(tmp_path / "nan.pth"), *args)
    assert bad.returncode == 2 and "NaN" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    from rwkv_engine.cli import main

    base = rwkv_engine.load(tuned["base"], dtype="fp32")
    huge = tmp_path / _huge_states(tuned, base, tmp_path)[0]  # R1: refused before the chat starts
    capsys.readouterr()
    assert main(["chat", str(tuned["base"]), "--state", str(huge), "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "NaN or infinite" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_server_state_per_request(tuned):
    """The server's `state` names a time_state file or a State.save file under --state-dir, per
    request; a NaN state is a 400."""
    openai = pytest.importorskip("openai")
    from .test_serve import GREEDY, Server, client_kwargs

    states = tuned["dir"] / "server-states"
    states.mkdir(exist_ok=True)
    testing.save_pth(tuned["states"], states / "persona.pth")
    base = rwkv_engine.load(tuned["base"])
    tok = rwkv_engine.load_tokenizer(base)
    merged = rwkv_engine.load(tuned["merged"])
    prompt = "User: who are you?\n\nAssistant:"
    _, after = base.forward(tok.encode("User: hi\n\nAssistant: hello.\n\n"))
    after.save(states / "ours.safetensors")
    nan = {k: torch.full_like(v, float("nan")) for k, v in tuned["states"].items()}
    testing.save_pth(nan, states / "nan.pth")
    huge = _huge_states(tuned, base, states)

    def want(model, state=None):
        params = rwkv_engine.SamplingParams(max_tokens=12, **GREEDY)
        gen = rwkv_engine.generate(model, tok, prompt, params, state=state)
        gen.read()
        return gen.text

    server = Server(tuned["base"], tuned["dir"] / "server.log", "--state-dir", str(states))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(state):
            kw = client_kwargs(GREEDY)
            kw["extra_body"] = {**kw["extra_body"], **({"state": state} if state else {})}
            return client.completions.create(model="base", prompt=prompt, max_tokens=12, **kw).choices[0].text

        assert want(merged) != want(base)  # the state matters
        # switched per request, in both directions (the prompt cache is keyed on the state)
        assert ask("persona.pth") == want(merged)
        assert ask(None) == want(base)
        assert ask("ours.safetensors") == want(base, after)
        assert ask("persona.pth") == want(merged)
        with pytest.raises(openai.BadRequestError) as e:
            ask("nan.pth")
        assert e.value.param == "state" and "NaN" in str(e.value)
        for name in huge:  # R1: finite but too large, the client's file: 400 before any work
            with pytest.raises(openai.BadRequestError) as e:
                ask(name)
            assert e.value.param == "state" and "NaN or infinite" in str(e.value), e.value
        assert ask("persona.pth") == want(merged)  # the server is unharmed
    finally:
        server.stop()
