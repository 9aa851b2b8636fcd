"""A deterministic mixed-text corpus for tokenizer tests and benchmarks (no downloads).

`mixed_corpus(n_bytes, seed)` strings together paragraphs of English-like prose (a Zipf-weighted
word list), Python-like code, Chinese / Japanese / Korean text, emoji (with skin tones and ZWJ
sequences), accented Latin and Cyrillic words, and whitespace runs, roughly in that order of size.
The same arguments always give the same text.
"""

from __future__ import annotations

import itertools
import random

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "model",
    "language",
    "network",
    "recurrent",
    "attention",
    "state",
    "token",
    "inference",
    "memory",
    "kernel",
    "tensor",
    "matrix",
    "vector",
    "layer",
    "weight",
    "training",
    "dataset",
    "benchmark",
    "throughput",
    "latency",
    "quantization",
    "embedding",
]
_NAMES = [
    "x",
    "y",
    "i",
    "n",
    "k",
    "value",
    "result",
    "data",
    "items",
    "config",
    "state",
    "model",
    "tokens",
    "buffer",
    "offset",
]
_CJK = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说"
    "产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点"
    "从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原"
    "又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革"
    "位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强"
    "放决西被干做必战先回则任取据处理世车点语言模型推理记忆网络状态"
)
_KANA = (
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコ"
)
_HANGUL = "가나다라마바사아자차카타파하한국어모델언어토큰추론"
_CJK_PUNCT = "，。！？、：；「」（）"
_EMOJI = "😀😃😄😁😆😅😂🤣😊😇🙂🙃😉😌😍🥰😘🤔🤗🤩🥳😎🚀🌍🌟🔥✨🎉🎈💡📚🧠⚡🐍🦀🍕☕🏆✅❌"
_SKIN = "🏻🏼🏽🏾🏿"
_ZWJ_SEQ = ("👨\u200d👩\u200d👧\u200d👦", "👩\u200d💻", "🏳\ufe0f\u200d🌈", "🧑\u200d🚀", "❤\ufe0f\u200d🔥")
_LATIN = (
    "café",
    "naïve",
    "façade",
    "über",
    "Straße",
    "señor",
    "déjà",
    "crème",
    "brûlée",
    "Øresund",
    "привет",
    "мир",
    "модель",
    "язык",
    "ελληνικά",
    "שלום",
    "مرحبا",
)


_WORD_CUM_WEIGHTS = list(itertools.accumulate(1.0 / (k + 1) ** 0.8 for k in range(len(_WORDS))))


def _prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 6)):
        words = rng.choices(_WORDS, cum_weights=_WORD_CUM_WEIGHTS, k=rng.randint(5, 18))
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2024)))
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words)), rng.choice(_LATIN))
        sentence = " ".join(words)
        sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".....?!;"))
    return " ".join(sentences)


def _code(rng: random.Random) -> str:
    lines = [f"def {rng.choice(_NAMES)}_{rng.choice(_NAMES)}({', '.join(rng.sample(_NAMES, 2))}):"]
    for _ in range(rng.randint(2, 8)):
        indent = " " * rng.choice((4, 4, 8, 12))
        a, b = rng.sample(_NAMES, 2)
        lines.append(
            indent
            + rng.choice(
                (
                    f"{a} = {b} * {rng.randint(0, 99)} + {rng.choice(_NAMES)}[{rng.randint(0, 9)}]",
                    f"if {a} is not None and len({b}) > {rng.randint(1, 64)}:",
                    f"for {a} in range({rng.randint(1, 512)}):",
                    f"return {{'{a}': {b}, \"{rng.choice(_NAMES)}\": {rng.random():.3f}}}",
                    f"# {' '.join(rng.choices(_WORDS, k=rng.randint(3, 9)))}",
                    f"{a}.append(({b} << 2) ^ 0x{rng.randrange(1 << 16):04x})",
                )
            )
        )
    return "\n".join(lines) + "\n"


def _cjk(rng: random.Random) -> str:
    pool = rng.choice((_CJK, _CJK, _CJK, _KANA + _CJK, _HANGUL))
    parts = []
    for _ in range(rng.randint(2, 5)):
        parts.append("".join(rng.choices(pool, k=rng.randint(4, 20))) + rng.choice(_CJK_PUNCT))
    return "".join(parts)


def _emoji(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.15:
            out.append(rng.choice(_ZWJ_SEQ))
        elif r < 0.3:
            out.append(rng.choice("👍👋🙌👏✋") + rng.choice(_SKIN))
        else:
            out.append(rng.choice(_EMOJI))
        if rng.random() < 0.5:
            out.append(" ")
    return "".join(out)


def _whitespace(rng: random.Random) -> str:
    runs = ("  ", " ", "\t", "\n", "\n\n", "    ", "\r\n", "\u3000")
    return "".join(rng.choices(runs, k=rng.randint(1, 8)))


_KINDS = ((_prose, 45), (_code, 25), (_cjk, 15), (_emoji, 5), (_whitespace, 10))


def mixed_corpus(n_bytes: int, seed: int = 0) -> str:
    """About `n_bytes` of UTF-8 mixed text (at least that many bytes, at most a paragraph more)."""
    rng = random.Random(seed)
    makers, weights = zip(*_KINDS)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        piece = rng.choices(makers, weights)[0](rng)
        piece += rng.choice(("\n\n", "\n", " ", ""))
        parts.append(piece)
        size += len(piece.encode("utf-8"))
    return "".join(parts)
