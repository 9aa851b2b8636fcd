"""The `rwkv-engine` command: dispatcher, `generate`, and one-line errors.

Real processes (`python -m rwkv_engine`, what the console script runs) for help, generation and
the common failures; the rest of the error mapping in-process through `main(argv)`. The
processes of a test are started together, so the machine's cores overlap their start-up.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import rwkv_engine
from rwkv_engine.cli import COMMANDS, main
from rwkv_engine.errors import StateError
from rwkv_engine.generation import generate
from rwkv_engine.tokenizer import WorldTokenizer

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def start(*args, stdin=subprocess.DEVNULL, cwd=None):
    return subprocess.Popen(
        [sys.executable, "-m", "rwkv_engine", *map(str, args)],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        cwd=cwd,
        text=True,
    )


def finish(proc, input=None):
    out, err = proc.communicate(input, timeout=120)
    return proc.returncode, out, err


def one_error_line(rc, out, err, *needles):
    assert rc != 0, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model_path(make_pth):
    return make_pth("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16)


def test_entry_points():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rwkv-engine"] == "rwkv_engine.cli:main"
    assert set(COMMANDS) >= {"generate", "chat", "convert", "bench", "perplexity", "serve"}
    rc, out, err = finish(start("--help"))
    assert rc == 0 and err == ""
    for name in COMMANDS:
        assert f"  {name} " in out


def test_generate_streams_and_stops(model_path, tmp_path):
    from rwkv_engine.cli.generate import DEFAULTS
    from rwkv_engine.sampling import SamplingParams

    # What the library makes of the request the flags describe.
    prompt = "The quick brown fox"
    flags = ["--seed", "3", "--max-tokens", "8", "--top-p", "0.9"]
    model = rwkv_engine.load(model_path)
    gen = generate(
        model, WorldTokenizer(), prompt, SamplingParams(**{**DEFAULTS, "seed": 3, "max_tokens": 8, "top_p": 0.9})
    )
    text = gen.read()
    assert len(gen.tokens) == 8
    # A stop string from the middle of that text: the output must end right before it.
    stop = text[4:7]
    assert stop.strip() and text.find(stop) == 4

    plain = start("generate", model_path, "--prompt", prompt, *flags)
    stopped = start("generate", model_path, *flags, "--stop", stop, "--stats", stdin=subprocess.PIPE)
    helps = start("generate", "--help")
    rc, out, err = finish(plain)
    assert rc == 0 and err == "" and out == text
    rc, out, err = finish(stopped, prompt)  # the prompt on stdin this time
    assert rc == 0 and out == text[:4]
    assert "finish: stop" in err and "tok/s" in err
    rc, help_text, _ = finish(helps)
    assert rc == 0
    for flag in (
        "--temperature",
        "--top-p",
        "--top-k",
        "--presence-penalty",
        "--frequency-penalty",
        "--penalty-decay",
        "--max-tokens",
        "--seed",
        "--stop",
        "--device",
        "--dtype",
        "--tokenizer",
    ):
        assert flag in help_text


def test_process_errors_are_one_line(model_path, tmp_path):
    procs = {
        "missing": start("generate", tmp_path / "nope.pth", "--prompt", "x"),
        "bad_flag": start("chat", model_path, "--bogus"),
        "pipe": start("generate", model_path, "--prompt", "x", "--max-tokens", "300"),
    }
    # a reader that goes away after the first bytes (`| head -c 1`): no traceback
    pipe = procs.pop("pipe")
    pipe.stdout.read(1)
    pipe.stdout.close()
    pipe.wait(timeout=120)
    assert "Traceback" not in pipe.stderr.read()
    results = {k: finish(p) for k, p in procs.items()}
    one_error_line(*results["missing"], "nope.pth")
    assert results["bad_flag"][0] == 2
    one_error_line(*results["bad_flag"], "--bogus")


def test_user_errors_in_process(model_path, tmp_path, capsys, monkeypatch):
    def err_of(argv):
        rc = main([str(a) for a in argv])
        cap = capsys.readouterr()
        return one_error_line(rc, cap.out, cap.err)

    (tmp_path / "notes.txt").write_text("hello")
    assert "notes.txt" in err_of(["generate", tmp_path / "notes.txt", "--prompt", "x"])
    assert "nope.pth" in err_of(["chat", tmp_path / "nope.pth"])
    assert "--top-p" in err_of(["generate", model_path, "--prompt", "x", "--top-p", "2"])
    assert "no-such.txt" in err_of(["generate", model_path, "--prompt-file", tmp_path / "no-such.txt"])
    assert "no-such.zip" in err_of(["chat", model_path, "--load", tmp_path / "no-such.zip"])
    monkeypatch.setattr("sys.stdin", open(os.devnull))
    assert "prompt is empty" in err_of(["generate", model_path])
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    assert "not UTF-8" in err_of(["generate", model_path, "--prompt-file", tmp_path / "latin1.txt"])


def test_dispatcher_errors_in_process(capsys, monkeypatch):
    def err_of(argv):
        rc = main(argv)
        cap = capsys.readouterr()
        return one_error_line(rc, cap.out, cap.err)

    assert "no command" in err_of([])
    assert "unknown command 'frobnicate'" in err_of(["frobnicate"])
    monkeypatch.setitem(COMMANDS, "teleport", "a command listed but not shipped")
    assert "'teleport' command is not available in this version" in err_of(["teleport", "x"])
    assert main(["--version"]) == 0 and rwkv_engine.__version__ in capsys.readouterr().out
    assert "argument --temperature" in err_of(["generate", "m.pth", "--temperature", "hot"])
    assert "--top-k" in err_of(["generate", "m.pth", "--top-k", "-1", "--prompt", "x"])
    assert "TOKEN_ID=VALUE" in err_of(["generate", "m.pth", "--logit-bias", "11", "--prompt", "x"])

    # whatever a subcommand raises that a user can cause: one line, non-zero
    import rwkv_engine.cli.generate as gen_cmd

    for exc, status in [
        (StateError("bad state file"), 2),  # a state that does not fit: a usage error
        (FileNotFoundError(2, "No such file", "x.bin"), 1),
        (KeyboardInterrupt(), 130),
    ]:

        def boom(args, exc=exc):
            raise exc

        monkeypatch.setattr(gen_cmd, "run", boom)
        assert main(["generate", "m.pth", "--prompt", "x"]) == status
        cap = capsys.readouterr()
        line = one_error_line(status, cap.out, cap.err)
        assert line.startswith("rwkv-engine generate: error: ")


def test_help_and_flag_errors_come_before_any_heavy_import():
    """N4: `generate --help` took 6 s and `generate M --dtype int8` 10 s: torch was imported
    before the flags were parsed. Every command's --help and flag errors import no torch; every
    command that computes has --threads (N5)."""
    computing = [c for c in COMMANDS]  # every command loads a model and computes
    script = f"""
import contextlib, io, json, sys
from rwkv_engine.cli import main
out = {{}}
for name in {computing!r}:
    help_text, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(help_text):
        rc_help = main([name, "--help"])
    with contextlib.redirect_stderr(errors):
        rc_bad = main([name, "m.pth", "out", "--dtype", "int8", "--threads", "0"])
    out[name] = [rc_help, "--threads" in help_text.getvalue(), rc_bad, errors.getvalue()]
out["torch imported"] = "torch" in sys.modules
print(json.dumps(out))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got.pop("torch imported") is False
    for name, (rc_help, has_threads, rc_bad, err) in got.items():
        assert rc_help == 0 and has_threads, name
        assert rc_bad == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (name, err)


def test_threads_flag_sets_torch_threads(model_path, capsys):
    """N5: --threads on generate (as on every command that computes) sets torch's thread count."""
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["generate", str(model_path), "-p", "hi", "--max-tokens", "1", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def test_out_of_range_port_and_convert_device_are_flag_errors(capsys):
    """N3: `serve M.pth --port 70000` was an OverflowError traceback; N7: `convert --device` was
    accepted and ignored. Both are one-line flag errors now (exit 2)."""
    for argv, words in (
        (["serve", "m.pth", "--port", "70000"], "0 to 65535"),
        (["convert", "m.pth", "out", "--device", "cuda"], "--device"),
    ):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_mistyped_local_path_fails_at_once(tmp_path, capsys, monkeypatch):
    """N2: `generate models/nope.pth -p hi` spent 34 s on Hugging Face Hub retries, then showed a
    Hub error. A path-like argument (a checkpoint suffix, ./, /, a folder that exists) that does
    not exist is "no such file" at once."""
    from rwkv_engine.loading.resolve import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda *a, **k: pytest.fail("went to the Hub"))
    monkeypatch.setattr("huggingface_hub.list_repo_files", lambda *a, **k: pytest.fail("went to the Hub"))
    for arg in ("models/nope.pth", "weights/nope.safetensors", "models/rwkv-7-world", "./m", "/nope/m.pth"):
        with pytest.raises(rwkv_engine.CheckpointError, match="no such file"):
            resolve(arg)
    rc = main(["generate", "models/nope.pth", "-p", "hi"])
    err = capsys.readouterr().err
    assert rc == 1 and "no such file" in err and "Hub" not in err, err
