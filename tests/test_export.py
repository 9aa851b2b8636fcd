"""Exported ExecuTorch programs run through `executorch.runtime` against the engine.

Each version's tiny model is exported once per module (lowering costs tens of seconds even for
a tiny model): fp32, and 4-bit for RWKV-7 (Q4_VERSION), XNNPACK. fp32 must match the engine within 1e-5 relative RMS for
the logits and every state field, after a prompt (prefill pieces + decode rest) and after
decode steps; the 4-bit program within Q4_BOUND of the fp32 engine's logits.
"""

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("executorch.runtime")

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.errors import CheckpointError, InputError
from rwkv_engine.export import ProgramModel, export_program

from .conftest import rel_rms

VERSIONS = ["4", "5.2", "6.0", "7"]
PREFILL = 8
PROMPT = [3, 17, 255, 1, 0, 42, 99, 7, 7, 7, 123, 200, 5, 64, 31, 9, 250, 11, 2]  # 2 prefill pieces + 3 decoded
STEPS = [5, 77, 140]
# The 4-bit program (int4 block 1 and an int8 head, both with int8 dynamic activations, int8
# embedding) against the fp32 engine: relative RMS of the logits over the prompt and the steps.
Q4_BOUND = 0.25
# The tiny model's matrices are under the size the default policy quantizes: name them.
Q4_POLICY = {"blocks.1.*": "q4", "head": "q8"}
Q4_VERSION = "7"


@pytest.fixture(scope="module", params=VERSIONS)
def exported(request, make_pth, tmp_path_factory):
    version = request.param
    # Lowering time grows with the graph: one layer holds every op of RWKV-4/5/6 (layer 0 only adds
    # ln0); RWKV-7's later layers differ from its first (the value residual), so it gets two.
    model = rwkv_engine.load(make_pth(version, n_layer=2 if version == "7" else 1))
    out = tmp_path_factory.mktemp(f"pte{version}")
    programs = {}
    # fp32 for every version (each has its own graph); the 4-bit lowering (torchao's quantizer and
    # XNNPACK's int kernels) is the same for every version, so it is exported for the newest only:
    # each lowering takes a minute or more on a 2-core Zen 3.
    for q in ("fp32", "q4") if version == Q4_VERSION else ("fp32",):
        export_program(model, out / f"{q}.pte", quantization=q, prefill_len=PREFILL, policy=Q4_POLICY)
        programs[q] = rwkv_engine.load(out / f"{q}.pte")
    return model, programs


def _trace(model, state=None):
    """Logits and state after PROMPT, then after each of STEPS."""
    logits, state = model.forward(PROMPT, state)
    out = [(logits, state)]
    for t in STEPS:
        logits, state = model.forward([t], state)
        out.append((logits, state))
    return out


def test_fp32_program_matches_engine(exported):
    model, programs = exported
    pte = programs["fp32"]
    assert isinstance(pte, ProgramModel) and pte.config == model.config
    for (ref, ref_state), (got, got_state) in zip(_trace(model), _trace(pte)):
        assert rel_rms(got, ref) < 1e-5
        assert got_state.fields == ref_state.fields and got_state.signature == ref_state.signature
        for name, t in ref_state.items():
            assert rel_rms(getattr(got_state, name), t) < 1e-5, name


def test_program_continues_an_engine_state_and_back(exported):
    """States are interchangeable: the engine's state into the program, the program's into the engine."""
    model, programs = exported
    pte = programs["fp32"]
    _, mid = model.forward(PROMPT[:10])
    a, sa = model.forward(PROMPT[10:], mid)
    b, sb = pte.forward(PROMPT[10:], mid)
    assert rel_rms(b, a) < 1e-5
    c, _ = model.forward([9], sb)
    d, _ = model.forward([9], sa)
    assert rel_rms(c, d) < 1e-5


def test_all_logits_and_batch_rows(exported):
    model, programs = exported
    pte = programs["fp32"]
    ref, _ = model.forward(PROMPT[:11], all_logits=True)
    got, _ = pte.forward(PROMPT[:11], all_logits=True)
    assert got.shape == ref.shape and rel_rms(got, ref) < 1e-5
    batch = torch.tensor([PROMPT[:9], PROMPT[5:14]])
    ref, ref_state = model.forward(batch)
    got, got_state = pte.forward(batch)
    assert got.shape == ref.shape and rel_rms(got, ref) < 1e-5
    assert got_state.batch_size == 2 and rel_rms(got_state.att_x_prev, ref_state.att_x_prev) < 1e-5


def test_q4_program_within_bound(exported):
    model, programs = exported
    if "q4" not in programs:
        pytest.skip(f"the 4-bit program is exported for version {Q4_VERSION} only")
    pte = programs["q4"]
    assert pte.metadata["quantized_modules"]["emb"] == "q8"
    assert pte.metadata["quantized_modules"]["blocks.1.att.key"] == "q4"
    assert pte.metadata["quantized_modules"]["head"] == "q8"
    ref = torch.stack([lg for lg, _ in _trace(model)])
    got = torch.stack([lg for lg, _ in _trace(pte)])
    err = rel_rms(got, ref)
    assert 0 < err < Q4_BOUND, err


def test_metadata_describes_the_state(exported):
    model, programs = exported
    meta = programs["fp32"].metadata
    state = model.new_state(1)
    assert [s["name"] for s in meta["state"]] == list(state.fields)
    assert [tuple(s["shape"]) for s in meta["state"]] == [tuple(t.shape) for _, t in state.items()]
    assert meta["inputs"] == ["tokens", *state.fields] and meta["outputs"] == ["logits", *state.fields]
    assert meta["methods"]["prefill"]["tokens"] == [1, PREFILL]
    assert meta["config"]["version"] == model.config.version
    # initial_state: RWKV-4's att_max starts at -1e30, everything else at 0
    start = programs["fp32"].new_state(1)
    for name, t in state.items():
        assert torch.equal(getattr(start, name), t), name


def test_generate_runs_on_a_program(exported):
    model, programs = exported
    assert testing.greedy_tokens(programs["fp32"], PROMPT, 6) == testing.greedy_tokens(model, PROMPT, 6)


def test_export_refuses_bad_arguments(make_pth, tmp_path):
    model = rwkv_engine.load(make_pth("5.2", n_layer=2))
    with pytest.raises(InputError, match="quantization"):
        export_program(model, tmp_path / "x.pte", quantization="q3")
    with pytest.raises(InputError, match="backend"):
        export_program(model, tmp_path / "x.pte", backend="vulkan9")
    with pytest.raises(InputError, match="prefill_len"):
        export_program(model, tmp_path / "x.pte", prefill_len=0)
    q = rwkv_engine.load(make_pth("5.2", vocab_size=2048), quantization="q8")  # its head is big enough to quantize
    with pytest.raises(InputError, match="fp32 without --quantization"):
        export_program(q, tmp_path / "x.pte")


def test_pte_without_executorch_is_one_clear_error(exported, tmp_path):
    _, programs = exported
    path = programs["fp32"].path
    code = (
        "import sys; sys.modules['executorch.runtime'] = None\n"
        "import rwkv_engine\n"
        "from rwkv_engine.errors import CheckpointError\n"
        f"try:\n    rwkv_engine.load({str(path)!r})\nexcept CheckpointError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout and 'pip install -e ".[export]"' in out.stdout, out.stderr[-2000:]
    bogus = tmp_path / "bogus.pte"
    bogus.write_bytes(b"\0\0\0\0ET12" + b"\0" * 64)
    with pytest.raises(CheckpointError):
        rwkv_engine.load(bogus)


def test_commands_run_on_a_program(exported, capsys):
    """bench and verify take a .pte like any model (generate / chat / serve go through the same forward)."""
    from rwkv_engine.cli import main

    model, programs = exported
    pte = str(programs["fp32"].path)
    assert main(["bench", pte, "--prompt-len", "10", "--decode-tokens", "3", "--json"]) == 0
    bench = json.loads(capsys.readouterr().out)
    assert bench["decode_tok_s"] > 0 and bench["quantization"] == "q0f32"
    ids = ",".join(map(str, PROMPT))
    assert main(["verify", str(model.path), "--against", pte, "--prompt-ids", ids, "--steps", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "hidden" not in r["layers"][0] and r["prompt_logits"] < 1e-5 and r["greedy_agreement"] == 4
    assert max(v for row in r["layers"] for k, v in row.items() if k != "layer") < 1e-5


def test_export_command_errors_are_one_line(make_pth, tmp_path, capsys):
    from rwkv_engine.cli import main

    assert main(["export", str(make_pth("5.2", n_layer=2)), str(tmp_path / "x.pte"), "-q", "q3"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing.pth"), str(tmp_path / "x.pte")]) == 1
    err = capsys.readouterr().err
    assert "no such file" in err and "Traceback" not in err


def test_export_command_portable_backend(make_pth, tmp_path, capsys):
    """The CLI end to end, with ExecuTorch's portable kernels only (no XNNPACK delegate)."""
    from rwkv_engine.cli import main

    path = make_pth("5.2", n_layer=1)
    out = tmp_path / "portable.pte"
    assert main(["export", str(path), str(out), "--backend", "portable", "--prefill-len", "4"]) == 0
    printed = capsys.readouterr().out
    assert "att_kv [1, 1, 4, 16, 16]" in printed and "prefill(tokens [1, 4]" in printed
    pte = rwkv_engine.load(out)
    assert pte.metadata["backend"] == "portable"
    model = rwkv_engine.load(path)
    ref, _ = model.forward(PROMPT)
    got, _ = pte.forward(PROMPT)
    assert rel_rms(got, ref) < 1e-5
