"""serve/decode.py's DecodeBatch keeps its rows' states in two buffers it reuses, and
RWKV.forward_into writes a forward's new state into a given one."""

from __future__ import annotations

import random

import pytest
import torch

import rwkv_engine
from rwkv_engine.errors import StateError
from rwkv_engine.models.model import decode_rows
from rwkv_engine.serve.decode import DecodeBatch
from rwkv_engine.state import State
from rwkv_engine.testing import random_state_dict, save_pth


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_pth(
        random_state_dict(version="7", n_layer=2, n_embd=64, vocab_size=1000, head_size=16, seed=3),
        tmp_path_factory.mktemp("decode") / "m.pth",
    )
    return rwkv_engine.load(path)


def random_state(model, rows: int, seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    st = model.new_state(rows)
    return State({k: torch.randn(v.shape, generator=g) * 0.3 for k, v in st.items()}, st.signature)


def same(a: State, b: State) -> bool:
    return all(torch.equal(v, getattr(b, k)) for k, v in a.items())


@pytest.mark.parametrize("rows", [3, 20])  # one native group; several (GEMV_MAX_ROWS rows each)
def test_forward_into_equals_forward_bit_for_bit(model, rows):
    tokens = torch.randint(0, 1000, (rows, 1))
    state = random_state(model, rows, 1)
    before = state.clone()
    logits, new = decode_rows(model, tokens, state)
    out = State({k: torch.full_like(v, float("nan")) for k, v in state.items()}, state.signature)
    got, into = decode_rows(model, tokens, state, out=out)
    assert into is out and same(out, new) and torch.equal(got, logits)
    assert same(state, before)  # the state given is not modified
    # the plain path (no native step: the block loop), also bit for bit with forward
    model.native_decode = False
    try:
        out2 = State({k: torch.empty_like(v) for k, v in state.items()}, state.signature)
        got2 = model.forward_into(tokens[:2], state[:2], out2[:2])
        ref2, new2 = model.forward(tokens[:2], state[:2])
        assert torch.equal(got2, ref2) and same(out2[:2], new2)
    finally:
        model.native_decode = True


def test_forward_into_refuses_an_out_it_cannot_write(model):
    state = random_state(model, 2, 2)
    tokens = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(StateError, match=r"out\.\w+ must be contiguous"):
        model.forward_into(tokens, state, random_state(model, 3, 3))
    transposed = State({k: v.transpose(0, 1).contiguous().transpose(0, 1) for k, v in state.items()}, state.signature)
    with pytest.raises(StateError, match="contiguous"):
        model.forward_into(tokens, state, transposed)


def test_rows_keep_their_states_through_joins_and_leaves(model):
    """Rows join (one or several at a time) and leave (any of them, several at once, all of
    them): every row's state stays its own, though the last rows move into the places of those
    that left; the buffers grow and shrink as the batch does."""
    rng = random.Random(7)
    batch = DecodeBatch(model, "test")
    mine: dict[int, State] = {}  # row -> its state
    serial = 0
    for _ in range(60):
        if not batch.rows or rng.random() < 0.55:
            entries = []
            for _ in range(rng.randint(1, 6)):
                serial += 1
                mine[serial] = random_state(model, 1, serial)
                entries.append((serial, mine[serial]))
            batch.join(entries)
        else:
            n = len(batch.rows)
            keep = sorted(rng.sample(range(n), rng.randint(0, n - 1)))
            batch.keep(keep)
        assert len(batch) == len(set(batch.rows))
        if batch.rows:
            assert len(batch.state) == len(batch.rows) <= len(batch._buf)
            for i, row in enumerate(batch.rows):
                assert same(batch.state[i], mine[row]), f"row {row} at {i}"
        else:
            assert batch.state is None and batch._buf is None
    assert serial > 50


class _Row:
    """What DecodeBatch.step asks of a plain row that decodes greedily forever."""

    def __init__(self, token: int):
        from rwkv_engine.sampling import Sampler, SamplingParams

        self.next_token, self.spec, self.tokens = token, None, []
        self.sampler = Sampler(SamplingParams(temperature=0), vocab_size=1000)

        class _Req:
            logprobs = None

        class _Group:
            request = _Req()

        self.group = _Group()

    def feed(self):
        return [self.next_token]

    def push(self, token, entry=None) -> bool:
        self.tokens.append(token)
        return True


def test_a_step_writes_the_spare_buffer_and_swaps_no_new_state(model):
    """A step of every row reads one buffer and writes the other: the rows' states alternate
    between two memories (no batch-sized allocation a step), and each row decodes what it
    decodes alone."""
    batch = DecodeBatch(model, "test")
    rows = [_Row(t) for t in (5, 17, 400, 9, 31)]
    states = [random_state(model, 1, 10 + i) for i in range(5)]
    batch.join(list(zip(rows, states)))
    ptrs = []
    for _ in range(4):
        batch.step()
        ptrs.append(batch.state.att_kv.data_ptr())
    assert ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]
    for row, st, first in zip(rows, states, (5, 17, 400, 9, 31)):
        alone, tok = st, first
        for got in row.tokens:
            logits, alone = model.forward(torch.tensor([[tok]]), alone)
            tok = int(logits[0].argmax())
            assert got == tok
