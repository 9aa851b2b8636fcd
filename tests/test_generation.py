"""Generation: streaming text, stop handling, the final state, and greedy decoding vs the reference.

Oracles: the tokenizer's one-shot `decode` of all tokens (for what the stream must show), a
from-scratch `model.forward` over prompt + generated tokens (for the final state), and the
`rwkv` pip package's PIPELINE.generate driving the same model (for the decode loop itself).
"""

import random

import pytest
import torch

import rwkv_engine
from rwkv_engine.errors import InputError
from rwkv_engine.generation import TextStream, generate
from rwkv_engine.sampling import SamplingParams
from rwkv_engine.tokenizer import WorldTokenizer

from .conftest import states_equal

WORLD_VOCAB = 65536


@pytest.fixture(scope="module")
def tok():
    return WorldTokenizer()


@pytest.fixture(scope="module")
def model(make_pth):
    return rwkv_engine.load(make_pth("5.2", n_layer=2, n_embd=64, vocab_size=WORLD_VOCAB, head_size=16))


# --- TextStream ---------------------------------------------------------------------------------


def stream_all(tok, ids, **params):
    s = TextStream(tok, SamplingParams(**params))
    chunks = []
    for t in ids:
        chunks.append(s.push(t))
        if s.done:
            break
    if not s.done:  # the tokens ran out (as if the caller stopped): release what is held
        chunks.append(s.finish("end"))
    return s, chunks


def test_stop_string_split_across_tokens_is_never_shown(tok):
    ids = tok.encode("abc\n") + tok.encode("\nxyz")
    assert all("\n\n" not in tok.decode([i]) for i in ids)  # the stop only exists across two tokens
    s, chunks = stream_all(tok, ids, stop=["\n\n"], stop_token_ids=[])
    assert "".join(chunks) == "abc" and all("\n" not in c for c in chunks)
    assert s.finish_reason == "stop" and s.text == "abc"


def test_held_prefix_is_released_when_no_stop_follows(tok):
    s = TextStream(tok, SamplingParams(stop=["\n\nUser"], stop_token_ids=[]))
    assert s.push(tok.encode("ok")[0]) == "ok"  # nothing that could start a stop: shown at once
    assert s.push(tok.encode("\n")[0]) == ""  # could be the start of "\n\nUser"
    assert s.push(tok.encode("\n")[0]) == ""
    assert s.push(tok.encode("Us")[0]) == ""
    assert s.push(tok.encode("x")[0]) == "\n\nUsx"
    assert not s.done


def test_utf8_split_over_tokens(tok):
    ids = tok.encode("a\U0001f600b")
    assert len(ids) >= 4  # the emoji takes three byte-level tokens
    s, chunks = stream_all(tok, ids, stop_token_ids=[])
    assert "".join(chunks) == "a\U0001f600b" and "\ufffd" not in "".join(chunks)


def test_random_streams_match_one_shot_decode(tok):
    pieces = ["a", "b", "\n", "\n\n", "ab", " ", "ba", "\u00e9", "\U0001f600"]
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        ids = tok.encode(text)
        stops = rng.sample(["\n\n", "ab", "b\nb", "\U0001f600a", "zz"], k=rng.randint(1, 2))
        max_tokens = rng.choice([None, 3, 100])
        s, chunks = stream_all(tok, ids, stop=stops, stop_token_ids=[], max_tokens=max_tokens)
        used = ids if max_tokens is None else ids[:max_tokens]
        full = tok.decode(used)
        cuts = [full.find(x) for x in stops if x in full]
        expected = full[: min(cuts)] if cuts else full
        assert "".join(chunks) == expected, (text, stops)
        if cuts:
            assert s.finish_reason == "stop"
        elif max_tokens is not None and len(ids) >= max_tokens:
            assert s.finish_reason == "length"
        # never shown, even partially, at any point of the stream
        shown = ""
        for c in chunks:
            shown += c
            assert not any(x in shown for x in stops)


def test_stop_token_ends_without_being_recorded(tok):
    s, chunks = stream_all(tok, tok.encode("hi") + [0] + tok.encode("more"))
    assert "".join(chunks) == "hi" and s.finish_reason == "stop" and s.tokens == tok.encode("hi")


def test_min_tokens_holds_off_stop_strings(tok):
    """vLLM's min_tokens on the text: a stop string ends the stream only where it ends in the
    text of the min_tokens-th token or later; before that it is shown like any text."""
    ids = [tok.encode(p)[0] for p in ("a", "b", "\n", "\n", "c", "d", "\n", "\n", "e")]
    assert tok.decode(ids) == "ab\n\ncd\n\ne"
    s, chunks = stream_all(tok, ids, stop=["\n\n"], stop_token_ids=[], min_tokens=4)
    assert "".join(chunks) == "ab" and s.finish_reason == "stop"  # the 4th token completes it: armed
    s, chunks = stream_all(tok, ids, stop=["\n\n"], stop_token_ids=[], min_tokens=5)
    assert "".join(chunks) == "ab\n\ncd" and s.finish_reason == "stop" and len(s.tokens) == 8
    s, chunks = stream_all(tok, ids, stop=["\n\n"], stop_token_ids=[], min_tokens=9)
    assert "".join(chunks) == "ab\n\ncd\n\ne" and s.finish_reason == "end"
    # A stop string that straddles the count is matched once its last token arrives.
    s, chunks = stream_all(tok, ids, stop=["\n\nc"], stop_token_ids=[], min_tokens=5)
    assert "".join(chunks) == "ab" and s.finish_reason == "stop"

    rng = random.Random(1)
    pieces = ["a", "b", "\n", "ab", " ", "ba"]
    for _ in range(200):
        ids = tok.encode("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
        stops = rng.sample(["\n\n", "ab", "b\nb", "zz", "a a"], k=rng.randint(1, 2))
        m = rng.randint(0, len(ids) + 1)
        s, chunks = stream_all(tok, ids, stop=stops, stop_token_ids=[], min_tokens=m)
        full, before = tok.decode(ids), tok.decode(ids[: max(0, m - 1)])
        # the first occurrence that ends after the text of the first m - 1 tokens
        cuts = [i for x in stops if (i := full.find(x, max(0, len(before) - len(x) + 1))) >= 0]
        assert "".join(chunks) == (full[: min(cuts)] if cuts else full), (ids, stops, m)


# --- Generation with a scripted model -----------------------------------------------------------


class ScriptedModel:
    """Emits `script` token by token after any prompt; its 'state' is the list of ids read."""

    class config:
        vocab_size = WORLD_VOCAB

    def __init__(self, script):
        self.script = script

    def forward(self, tokens, state=None):
        state = list(state or []) + list(tokens)
        logits = torch.full((WORLD_VOCAB,), -30.0)
        generated = len(state) - self.prompt_len
        logits[self.script[generated] if generated < len(self.script) else 0] = 30.0
        return logits, state


def scripted(tok, prompt, pieces):
    m = ScriptedModel([i for p in pieces for i in tok.encode(p)])
    m.prompt_len = len(tok.encode(prompt))
    return m


def test_generation_stops_on_split_stop_string(tok):
    m = scripted(tok, "Q", ["Hel", "lo", " wo", "rld", "!"])
    gen = generate(m, tok, "Q", SamplingParams(temperature=0, stop=["o w"]))
    chunks = list(gen)
    assert "".join(chunks) == "Hell" and gen.finish_reason == "stop"
    assert gen.tokens == tok.encode("Hel") + tok.encode("lo") + tok.encode(" wo")
    # the state covers the prompt and every generated token, including the one holding the stop
    assert gen.state == tok.encode("Q") + gen.tokens and gen.prompt_state == tok.encode("Q")


def test_generation_stop_token_and_length(tok):
    m = scripted(tok, "Q", ["one", " two"])  # then token 0
    gen = generate(m, tok, "Q", SamplingParams(temperature=0))
    assert gen.read() == "one two" and gen.finish_reason == "stop"
    assert gen.state == tok.encode("Q") + tok.encode("one two")  # token 0 not fed
    gen = generate(m, tok, "Q", SamplingParams(temperature=0, max_tokens=1))
    assert gen.read() == "one" and gen.finish_reason == "length" and gen.stats.generated_tokens == 1
    gen = generate(m, tok, "Q", SamplingParams(temperature=0, max_tokens=0))
    assert gen.read() == "" and gen.finish_reason == "length" and gen.state == tok.encode("Q")


def test_generation_min_tokens_goes_past_the_stop_token(tok):
    m = scripted(tok, "Q", ["one", " two"])  # then token 0, which min_tokens keeps out
    gen = generate(m, tok, "Q", SamplingParams(temperature=0, min_tokens=5))
    gen.read()
    assert gen.finish_reason == "stop" and len(gen.tokens) == 5 and 0 not in gen.tokens
    assert gen.tokens[:2] == tok.encode("one") + tok.encode(" two")


def test_bad_prompts(tok):
    m = scripted(tok, "Q", ["x"])
    for prompt in ["", [], [WORLD_VOCAB], [-1], [1.5], torch.tensor([[1, 2]])]:
        with pytest.raises(InputError):
            generate(m, tok, prompt, SamplingParams())
    with pytest.raises(InputError):
        generate(m, tok, "Q", {"temperature": 0})
    with pytest.raises(InputError):
        generate(m, tok, "Q", SamplingParams(banned_token_ids=[WORLD_VOCAB]))


# --- Generation with a real random-weight model -------------------------------------------------


def test_final_state_equals_prefill_of_prompt_and_output(model, tok):
    prompt = "User: tell me a story\n\nAssistant:"
    gen = generate(model, tok, prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=3))
    text = "".join(gen)
    assert gen.stats.generated_tokens == len(gen.tokens) == 12 and gen.finish_reason == "length"
    assert gen.stats.prompt_tokens == len(tok.encode(prompt))
    assert gen.stats.prefill_tokens_per_second > 0 and gen.stats.decode_tokens_per_second > 0
    assert text == tok.decode(gen.tokens)
    _, expected = model.forward(tok.encode(prompt) + gen.tokens)
    states_equal(gen.state, expected)
    states_equal(gen.prompt_state, model.forward(tok.encode(prompt))[1])
    # continuing from a state: same as one long prompt
    gen2 = generate(model, tok, " more", SamplingParams(temperature=0, max_tokens=4), state=gen.state)
    gen2.read()
    _, expected2 = model.forward(tok.encode(prompt) + gen.tokens + tok.encode(" more") + gen2.tokens)
    states_equal(gen2.state, expected2)


def test_same_seed_same_text(model, tok):
    def run(seed):
        return generate(model, tok, "Once upon a time", SamplingParams(max_tokens=6, seed=seed, top_p=0.95)).read()

    a = run(7)
    assert a == run(7)
    assert a != run(8)


class _Ids:
    """A stand-in vocabulary for a 300-row model: text is "<id><id>...", never digits or spaces."""

    def encode(self, text):
        return [int(x) for x in text.split()]

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def decode_bytes(self, ids):
        return self.decode(ids).encode()


def test_greedy_with_penalties_matches_reference_pipeline(make_pth):
    """A 300-token model repeats itself quickly under greedy decoding, so the penalties decide the path."""
    rwkv_utils = pytest.importorskip("rwkv.utils")
    small = rwkv_engine.load(make_pth("5.2", n_layer=2, n_embd=64, vocab_size=300, head_size=16))
    pipe = rwkv_utils.PIPELINE.__new__(rwkv_utils.PIPELINE)
    pipe.model, pipe.tokenizer = small, _Ids()
    picked = []
    sample = pipe.sample_logits

    def record(logits, **kw):
        picked.append(sample(logits, **kw))
        return picked[-1]

    pipe.sample_logits = record
    n, prompt = 40, "5 17 42"
    args = rwkv_utils.PIPELINE_ARGS(
        temperature=0,
        top_p=0.5,
        alpha_presence=0.4,
        alpha_frequency=0.3,
        alpha_decay=0.99,
        token_ban=[7],
        token_stop=[0],
    )
    pipe.generate(prompt, token_count=n, args=args)
    params = SamplingParams(
        temperature=0,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        penalty_decay=0.99,
        banned_token_ids=[7],
        stop_token_ids=[0],
        max_tokens=n,
    )
    ours = generate(small, _Ids(), prompt, params)
    ours.read()
    assert ours.tokens == picked[: len(ours.tokens)] and len(ours.tokens) >= 10
    plain = generate(small, _Ids(), prompt, params.replace(presence_penalty=0, frequency_penalty=0))
    plain.read()
    assert plain.tokens != ours.tokens  # the penalties changed the greedy path
