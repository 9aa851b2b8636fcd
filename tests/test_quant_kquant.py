"""Our K-quant quantizers (quant/kquantize.py): ggml's block layouts, checked by the `gguf` package's
dequantizer, and an error search never worse than the plain rounding."""

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
        "heavy": testing._linear(g, rows, cols, outliers=True),
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
