"""Our K-quant quantizers (quant/kquantize.py): ggml's block layouts, checked by the `gguf` package's
dequantizer, and an error search never worse than the plain rounding."""

import numpy as np
import pytest
import torch

from rwkv_engine import testing
from rwkv_engine.errors import InputError
from rwkv_engine.loading.ggml_quants import BY_NAME, QK_K, dequantize
from rwkv_engine.quant import kquantize as KQ

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
