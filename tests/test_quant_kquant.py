"""Our K-quant quantizers (quant/kquantize.py): ggml's block layouts, checked by the `gguf` package's
dequantizer, and an error search never worse than the plain rounding; the q4k / q6k schemes built
on them (load, convert, bytes against llama.cpp's Q4_K_M)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from rwkv_engine import testing
from rwkv_engine.errors import InputError
from rwkv_engine.quant import kquantize as KQ
from rwkv_engine.quant.ggml_quants import BY_NAME, QK_K, dequantize

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import quants as gq  # noqa: E402

from .conftest import rel_rms  # noqa: E402

BITS = {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}


def _weights(seed: int, rows: int = 8, cols: int = 2 * QK_K) -> dict[str, torch.Tensor]:
    """Small weights of several kinds: Gaussian with per-row magnitudes, heavy-tailed (outlier rows,
    columns and entries), all positive, and rows with zero / constant / one-spike super-blocks."""
    g = torch.Generator().manual_seed(seed)
    special = torch.randn(rows, cols, generator=g) * 0.02
    special[0] = 0.0
    special[1, :QK_K] = 0.37
    special[2, :QK_K] = -0.11
    special[3, :QK_K] = 0.0
    special[3, 5] = 4.0
    return {
        "gauss": torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.1,
        "heavy": testing.checkpoints._linear(g, rows, cols, outliers=True),
        "positive": torch.rand(rows, cols, generator=g) * 0.05,
        "special": special,
    }


def _deq(raw: torch.Tensor, name: str, shape) -> torch.Tensor:
    return dequantize(raw.reshape(-1), BY_NAME[name], tuple(shape))


def _block_err(w: torch.Tensor, raw: torch.Tensor, name: str) -> torch.Tensor:
    """Squared error per super-block [rows * cols / 256]."""
    return (_deq(raw, name, w.shape) - w).double().square().reshape(-1, QK_K).sum(-1)


@pytest.mark.parametrize("name", KQ.K_TYPES)
def test_blocks_are_ggml_layout(name):
    """Our bytes, read by gguf.quants' dequantizer, give our dequantizer's values bit for bit, at
    the type's size and close to the weight."""
    for kind, w in _weights(0).items():
        for search in (False, True):
            raw = KQ.quantize_k(w, name, search)
            assert raw.dtype == torch.uint8
            assert raw.shape == (w.shape[0], w.shape[1] * BITS[name] / 8)
            theirs = gq.dequantize(raw.numpy(), GT[name])
            ours = _deq(raw, name, w.shape).numpy()
            assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), (kind, search)
            if kind != "special":
                err = testing.rel_rms(torch.from_numpy(ours), w)
                assert err < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.035}[name], (kind, search, err)


@pytest.mark.parametrize("name", KQ.K_TYPES)
def test_search_never_worse_than_plain_rounding(name):
    """Block by block, on Gaussian, heavy-tailed, positive and degenerate weights; and lower
    overall on the real-valued kinds."""
    for seed in (1, 2):
        for kind, w in _weights(seed).items():
            searched = _block_err(w, KQ.quantize_k(w, name), name)
            plain = _block_err(w, KQ.quantize_k(w, name, search=False), name)
            assert (searched <= plain * (1 + 1e-6) + 1e-12).all(), (kind, seed)
            if kind in ("gauss", "heavy"):
                assert searched.sum() < 0.97 * plain.sum(), (kind, seed)


def test_degenerate_blocks_stored_exactly():
    """All-zero super-blocks dequantize to zeros; a single spike keeps its value closely."""
    w = _weights(0)["special"]
    for name in KQ.K_TYPES:
        deq = _deq(KQ.quantize_k(w, name), name, w.shape)
        assert torch.equal(deq[0], torch.zeros_like(deq[0])), name
        assert abs(deq[3, 5].item() - 4.0) < 4.0 * 2**-8, name
        assert deq[3, 6:QK_K].abs().max().item() < 4.0 / 60, name


def test_16_bit_weights_and_typed_wrappers():
    """bf16 / fp16 weights quantize as their fp32 values; the named wrappers are quantize_k."""
    w = _weights(3)["gauss"]
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(KQ.quantize_q4_k(w.to(dt)), KQ.quantize_k(w.to(dt).float(), "Q4_K"))
    assert torch.equal(KQ.quantize_q5_k(w), KQ.quantize_k(w, "Q5_K"))
    assert torch.equal(KQ.quantize_q6_k(w), KQ.quantize_k(w, "Q6_K"))


@pytest.mark.parametrize(
    "weight,match",
    [
        (torch.zeros(4, 100), "multiple of 256"),
        (torch.full((2, 256), float("nan")), "inf or nan"),
        (torch.full((2, 256), 2e6), "beyond the fp16"),
        (torch.zeros(256), "2-D"),
        (torch.zeros(2, 256, dtype=torch.int32), "floating-point"),
    ],
)
def test_bad_weights_rejected(weight, match):
    with pytest.raises(InputError, match=match):
        KQ.quantize_q4_k(weight)


def test_unknown_type_rejected():
    with pytest.raises(InputError, match="unknown K-quant type"):
        KQ.quantize_k(torch.zeros(2, 256), "Q3_K")


# --- the q4k / q6k policy ---------------------------------------------------------------------


def _meta_model(n_layer: int, n_embd: int, vocab: int = 65536):
    """An RWKV-7 of the given shape on the meta device (the policy needs only shapes)."""
    from rwkv_engine.config import ModelConfig
    from rwkv_engine.models.model import RWKV

    r = testing.lora_ranks("7", n_embd)
    cfg = ModelConfig(
        version="7",
        n_layer=n_layer,
        n_embd=n_embd,
        vocab_size=vocab,
        dim_att=n_embd,
        ffn_dim=4 * n_embd,
        n_head=n_embd // 64,
        head_size=64,
        lora_decay=r["decay"],
        lora_iclr=r["iclr"],
        lora_value=r["value"],
        lora_gate=r["gate"],
    )
    with torch.device("meta"):
        return RWKV(cfg)


def _q4_k_m_bytes(model) -> int:
    """llama.cpp's Q4_K_M of the same matrices: the head Q6_K, the rest Q4_K, no column scales."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * (6.5625 if name == "head" else 4.5) / 8
    return int(total)


@pytest.mark.parametrize(
    "shape,leading",
    [
        ((12, 768), {0: "Q6_K", 1: "Q6_K", 2: "Q6_K", 3: "Q5_K"}),  # 0.1B: the head is 37% of the weights
        ((24, 2048), {0: "Q6_K"}),  # 1.5B
        ((32, 4096), {0: "Q5_K"}),  # 7B
    ],
)
def test_q4k_policy_reads_at_most_q4_k_m_bytes(shape, leading):
    """q4k spends the bytes its Q5_K head saves against Q4_K_M's Q6_K on the leading blocks, column
    scales counted: at most Q4_K_M's bytes per token, within 1% of them, on every shape."""
    from rwkv_engine.quant.schemes import kquant_actions, kquant_read_bytes

    model = _meta_model(*shape)
    actions = kquant_actions(model, "q4k")
    assert actions["head"] == "Q5_K"
    up = {int(n.split(".")[1]) for n, t in actions.items() if n.startswith("blocks.") and t != "Q4_K"}
    assert up == set(leading)
    for i, t in leading.items():
        assert all(t == a for n, a in actions.items() if n.startswith(f"blocks.{i}.")), i
    ours, theirs = kquant_read_bytes(model, actions), _q4_k_m_bytes(model)
    assert 0.99 * theirs < ours <= theirs, (ours, theirs)


def test_q6k_policy_and_fallbacks():
    """q6k is Q6_K throughout; a matrix no 256-block fits takes our q4 (Q4_K / Q5_K) or q8 (Q6_K);
    matrices under the policy's size are kept, as in every scheme."""
    from rwkv_engine.quant.schemes import kquant_actions

    model = _meta_model(2, 768)
    assert set(kquant_actions(model, "q6k").values()) == {"Q6_K"}
    narrow = _meta_model(2, 320, vocab=128)  # 320 = 5 x 64: no K-quant block fits its rows
    q4k, q6k = kquant_actions(narrow, "q4k"), kquant_actions(narrow, "q6k")
    assert q4k["blocks.0.att.key"] == "q4" and q6k["blocks.0.att.key"] == "q8"
    assert q4k["blocks.0.ffn.value"] == "Q4_K" and q6k["blocks.0.ffn.value"] == "Q6_K"  # 1280 = 5 x 256 wide
    assert q4k["head"] == q6k["head"] == "keep"  # 128 x 320: under MIN_QUANT_WEIGHTS


# --- q4k / q6k as schemes: load, convert, the K-quant module -----------------------------------

MODEL_IDS = list(range(1, 41))


@pytest.fixture(scope="module")
def k_src(tmp_path_factory):
    """A random RWKV-7 whose matrices are 256 wide (K-quant rows), heavy-tailed like trained ones."""
    sd = testing.random_state_dict(
        "7", n_layer=1, n_embd=256, vocab_size=300, head_size=64, ffn_dim=256, seed=3, outliers=True
    )
    return testing.save_pth(sd, tmp_path_factory.mktemp("k_src") / "m.pth")


@pytest.fixture(scope="module")
def k_models(k_src):
    import rwkv_engine

    return {q: rwkv_engine.load(k_src, quantization=q, progress=False) for q in (None, "q4k", "q6k")}


def _klinears(model) -> dict:
    from rwkv_engine.quant.kquant_linear import KQuantLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, KQuantLinear)}


@pytest.mark.parametrize("scheme", ["q4k", "q6k"])
def test_scheme_blocks_are_the_writers_and_gguf_reads_them(k_models, scheme):
    """Every matrix of a q4k / q6k load is a KQuantLinear of the policy's type holding exactly
    quantize_k's bytes of weight / column scales; gguf.quants reads them back to the weight."""
    from rwkv_engine.quant.schemes import kquant_actions

    model, ref = k_models[scheme], k_models[None]
    kl = _klinears(model)
    actions = kquant_actions(ref, scheme)
    assert set(kl) == {n for n, t in actions.items() if t in KQ.K_TYPES} and len(kl) == 7
    assert model.quantization.name == scheme
    for name, m in kl.items():
        assert m.qtype == actions[name]
        if name not in ("head", "blocks.0.ffn.value", "blocks.0.att.key"):
            continue  # (the writer's run on every matrix is the load itself; three are checked)
        w = ref.get_submodule(name).weight.detach().float()
        cs = KQ.column_scales(w)
        assert torch.equal(m.col_scales, cs)
        assert torch.equal(m.qweight, KQ.quantize_k(w, m.qtype, col_scales=cs)), name
        theirs = gq.dequantize(m.qweight.numpy(), GT[m.qtype])
        theirs = torch.from_numpy(theirs.reshape(w.shape)) * cs.float()
        assert torch.equal(theirs, m.dequantize()), name
        limit = {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[m.qtype]
        assert ((theirs - w).norm() / w.norm()).item() < limit, name


def test_q4k_logits_near_16_bit_and_better_than_plain_q4_k(k_models):
    """q4k's logits stay within a stated error of the unquantized model's, and within that of the
    same matrices in the same types rounded plainly (min / max, no search, no column scales)."""
    import copy

    from rwkv_engine.quant.kquant_linear import KQuantLinear
    from rwkv_engine.quant.schemes import replace_module

    ref, q4k, q6k = k_models[None], k_models["q4k"], k_models["q6k"]
    plain = copy.deepcopy(ref)
    for name, m in _klinears(q4k).items():
        w = ref.get_submodule(name).weight.detach().float()
        blocks = KQ.quantize_k(w, m.qtype, search=False)
        replace_module(plain, name, KQuantLinear.from_blocks(m.qtype, blocks, tuple(w.shape)))
    want, _ = ref.forward(MODEL_IDS, all_logits=True)
    err = {k: rel_rms(m.forward(MODEL_IDS, all_logits=True)[0], want) for k, m in [("q4k", q4k), ("plain", plain)]}
    err["q6k"] = rel_rms(q6k.forward(MODEL_IDS, all_logits=True)[0], want)
    # (a random model's logits amplify the matrices' error: q4 gives about 0.2 here, q8 0.03)
    assert err["q4k"] < 0.3 and err["q6k"] < 0.08, err
    assert err["q4k"] <= err["plain"], err


def test_q4k_converted_directory_is_the_on_the_fly_model(k_src, k_models, tmp_path):
    """`convert -q q4k` writes the blocks a load with -q q4k makes, bit for bit."""
    import rwkv_engine

    r = subprocess.run(
        [sys.executable, "-m", "rwkv_engine", "convert", str(k_src), str(tmp_path / "o"), "-q", "q4k"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    conv, live = rwkv_engine.load(tmp_path / "o", progress=False), k_models["q4k"]
    assert conv.quantization.name == "q4k"
    a, b = conv.state_dict(), live.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {n: m.qtype for n, m in _klinears(conv).items()} == {n: m.qtype for n, m in _klinears(live).items()}
    assert torch.equal(conv.forward(MODEL_IDS, all_logits=True)[0], live.forward(MODEL_IDS, all_logits=True)[0])


@pytest.mark.parametrize("shape", [(2, 256, 300), (12, 768, 65536), (24, 2048, 65536)])
def test_q4k_module_bytes_at_most_q4_k_m(shape):
    """The bytes q4k's modules hold (blocks and column scales, counted from their buffers) are at
    most those of llama.cpp's Q4_K_M of the same matrices; the same bound as the policy's count."""
    from rwkv_engine.quant import quantize_model
    from rwkv_engine.quant.linear import weight_bytes
    from rwkv_engine.quant.schemes import kquant_actions, kquant_read_bytes

    model = _meta_model(*shape[:2], vocab=shape[2])
    theirs = _q4_k_m_bytes(model)
    counted = kquant_read_bytes(model, kquant_actions(model, "q4k"))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.bias is None]
    quantize_model(model, "q4k", empty=True)
    held = sum(weight_bytes(model.get_submodule(n)) for n in names)
    assert held == counted <= theirs, (held, counted, theirs)


def test_kquant_scheme_errors():
    from rwkv_engine.quant import quantize_model
    from rwkv_engine.quant.schemes import get_scheme

    with pytest.raises(InputError, match="fixed blocks"):
        get_scheme("q4k", 64)
    narrow = _meta_model(2, 320, vocab=128)
    with pytest.raises(InputError, match="multiple of 256"):
        quantize_model(narrow, "q8", policy={"blocks.0.att.key": "q4k"}, empty=True)


def test_q4k_from_a_gguf_keeps_blocks_of_its_own_type(tmp_path):
    """-q q4k on a GGUF of K-quants: a matrix whose stored type is the one q4k gives it runs from
    the file's blocks as they are (no second rounding); another (Q4_K_M's Q6_K head, Q5_K under
    q4k) is quantized again from the file's values."""
    import rwkv_engine
    from rwkv_engine.testing.ggml_writers import write_gguf

    sd = testing.random_state_dict("7", n_layer=1, n_embd=256, vocab_size=300, head_size=64, ffn_dim=256, seed=4)
    path = write_gguf(sd, tmp_path / "m.gguf", lambda name: "Q6_K" if name == "output.weight" else "Q4_K")
    # fp32: the values re-quantized are the file's, not rounded to bf16 first (the default dtype
    # where the CPU has bf16 dot products)
    stored = _klinears(rwkv_engine.load(path, dtype="fp32", progress=False))  # the "gguf" scheme: as stored
    ours = _klinears(rwkv_engine.load(path, dtype="fp32", quantization="q4k", progress=False))
    assert stored["head"].qtype == "Q6_K" and ours["head"].qtype == "Q5_K"
    assert torch.equal(
        ours["head"].qweight, KQ.quantize_k(stored["head"].dequantize(), "Q5_K", col_scales=ours["head"].col_scales)
    )
    for name in ("blocks.0.att.key", "blocks.0.ffn.value"):
        assert ours[name].qtype == "Q4_K" and torch.equal(ours[name].qweight, stored[name].qweight)
        assert torch.equal(ours[name].col_scales, torch.ones(256, dtype=torch.float16))
