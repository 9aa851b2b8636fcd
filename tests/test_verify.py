"""`rwkv-engine verify`: layer-by-layer error between two configurations of one checkpoint.

Documented magnitudes (docs/evaluation.md, "verify"), on these random models: fp32 against fp32 is exactly 0;
bf16 against fp32 puts every layer's hidden state between 1e-3 and 3e-2; q4 (default policy)
against fp32 moves the logits by 0.02-0.4, and its error first jumps in block 2, the first int4 one
(blocks 0-1 are int8); the official rwkv package agrees within 1e-5.
"""

import json

from rwkv_engine.cli import main

PROMPT_IDS = "3,17,255,1,0,42,99,7,7,7,123,200,5,64,31,9,250,11,2,180,33,8,19,4"


def _verify(capsys, path, *flags):
    status = main(["verify", str(path), "--prompt-ids", PROMPT_IDS, "--steps", "8", "--json", *flags])
    out = capsys.readouterr()
    assert status == 0, out.err
    return json.loads(out.out)


def test_fp32_against_itself_is_exactly_zero(make_pth, capsys):
    r = _verify(capsys, make_pth("7"))
    assert r["layers"] and all(v == 0 for row in r["layers"] for k, v in row.items() if k != "layer")
    assert set(r["layers"][0]) == {"layer", "hidden", "att_x_prev", "att_kv", "ffn_x_prev"}
    assert r["prompt_logits"] == 0 and r["step_logits_max"] == 0
    assert r["greedy_agreement"] == r["steps"] == 8 and r["first_jump_layer"] is None


def test_bf16_magnitudes(make_pth, capsys):
    r = _verify(capsys, make_pth("5.2"), "--dtype", "bf16")
    for row in r["layers"]:
        assert 1e-3 < row["hidden"] < 3e-2, row
    assert 1e-3 < r["prompt_logits"] < 3e-2


def test_q4_magnitudes_and_first_jump(make_pth, capsys):
    # 256 wide: every matrix is big enough for the default policy to quantize it
    path = make_pth("5.2", n_layer=4, n_embd=256, head_size=64)
    r = _verify(capsys, path, "--quantization", "q4")
    assert 0.02 < r["prompt_logits"] < 0.4
    assert r["first_jump_layer"] == 2, r["layers"]


def test_against_the_rwkv_package(make_pth, capsys):
    r = _verify(capsys, make_pth("7"), "--against", "rwkv")
    assert "hidden" not in r["layers"][0]
    assert max(v for row in r["layers"] for k, v in row.items() if k != "layer") < 1e-5
    assert r["prompt_logits"] < 1e-5 and r["step_logits_max"] < 1e-5 and r["greedy_agreement"] == 8


def test_bad_reference_is_one_clear_error(make_pth, capsys):
    status = main(["verify", str(make_pth("5.2")), "--prompt-ids", "1,2", "--against", "q3"])
    err = capsys.readouterr().err
    assert status == 1 and "unknown quantization scheme" in err and "Traceback" not in err
