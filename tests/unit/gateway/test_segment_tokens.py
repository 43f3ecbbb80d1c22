"""A conversation tokenized piece by piece between its special tokens gives the tokenizer's own ids
(gateway/segment_tokens.py), and a later turn tokenizes only its new pieces."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from tessera.gateway import segment_tokens
from tessera.gateway.models import load_served_model, token_ids
from tessera.gateway.segment_tokens import SegmentTokenizer
from tessera.registry import ModelInfo

WORDS = ["the", "cache", " ", "  ", "\n", "\n\n", "tokens", "é", "ﬁ", "Ω", "naïve", "🙂", "<", "|", ">", "im",
         "user", "end", "<|im", "12", "3.14", "don't", "\t", "x" * 40]


def random_text(rng: random.Random, specials: list[str], num_words: int = 30) -> str:
    pieces = [rng.choice(specials) if specials and rng.random() < 0.1 else rng.choice(WORDS + specials)
              for _ in range(num_words)]
    return "".join(pieces)


def trained_tokenizer(specials: list[str], *, normalized: bool = False, lstrip: bool = False) -> Tokenizer:
    """A byte-level BPE with an NFC normalizer and overlapping special tokens, trained here in a moment."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    rng = random.Random(0)
    tokenizer.train_from_iterator([random_text(rng, []) for _ in range(300)], trainer)
    tokenizer.add_special_tokens([AddedToken(s, normalized=normalized, lstrip=lstrip) for s in specials])
    return tokenizer


def segments_of(tokenizer: Any) -> SegmentTokenizer:
    segments = SegmentTokenizer.of(tokenizer, functools.partial(token_ids, tokenizer))
    assert segments is not None
    return segments


def test_the_small_models_conversations_get_the_tokenizers_own_ids(small_model_dir: Path) -> None:
    served = load_served_model(ModelInfo(name="m", tokenizer=str(small_model_dir), max_model_len=1024, block_size=32))
    assert served.segments is not None
    rng = random.Random(11)
    specials = ["<|user|>", "<|assistant|>", "<|system|>", "<s>", "</s>"]
    for _ in range(200):
        text = random_text(rng, specials)
        assert served.segments.encode(text) == token_ids(served.tokenizer, text), text
    messages = [{"role": rng.choice(["system", "user", "assistant"]), "content": random_text(rng, specials)}
                for _ in range(6)]
    rendered = served.chat_template.render(messages=messages, add_generation_prompt=True, bos_token="<s>",
                                           eos_token="</s>")
    assert served.encode_chat(messages) == token_ids(served.tokenizer, rendered)


def test_overlapping_special_tokens_and_a_normalizer_cut_as_the_tokenizer_cuts() -> None:
    # "<|im_start|>x" overlaps "<|im_start|>": the tokenizer takes the longest at the leftmost match.
    specials = ["<|im_start|>", "<|im_end|>", "<|im_start|>x", "<|"]
    tokenizer = trained_tokenizer(specials)
    segments = segments_of(tokenizer)
    rng = random.Random(5)
    for _ in range(300):
        text = random_text(rng, [*specials, "x", "_start|>", "<|im_"])
        assert segments.encode(text) == token_ids(tokenizer, text), text


@pytest.mark.parametrize("option", ["normalized", "lstrip"])
def test_a_tokenizer_whose_cut_depends_on_more_than_the_raw_text_is_not_cut(option: str) -> None:
    tokenizer = trained_tokenizer(["<|im_end|>"], **{option: True})
    assert SegmentTokenizer.of(tokenizer, functools.partial(token_ids, tokenizer)) is None
    tokenizer = trained_tokenizer(["<|im_end|>"])
    tokenizer.encode_special_tokens = True  # special tokens' text then tokenized as text
    assert SegmentTokenizer.of(tokenizer, functools.partial(token_ids, tokenizer)) is None


def test_a_later_turn_tokenizes_only_its_new_pieces(small_model_dir: Path) -> None:
    info = ModelInfo(name="m", tokenizer=str(small_model_dir), max_model_len=100_000, block_size=32)
    served = load_served_model(info)
    tokenized: list[str] = []

    def counting(piece: str) -> list[int]:
        tokenized.append(piece)
        return token_ids(served.tokenizer, piece)

    served.segments = SegmentTokenizer.of(served.tokenizer, counting)
    history = [{"role": "system", "content": "You answer briefly."}]
    for turn in range(5):
        history.append({"role": "user", "content": f"question {turn}: " + "why " * 50})
        tokenized.clear()
        ids = served.encode_chat(history)
        rendered = served.chat_template.render(messages=history, add_generation_prompt=True, bos_token="<s>",
                                               eos_token="</s>")
        assert ids == token_ids(served.tokenizer, rendered)
        # Only the messages new since the last turn (the last answer, the question): the rest comes from the cache.
        new = [f"\n{m['content']}\n" for m in (history if turn == 0 else history[-2:])]
        assert tokenized == ([*new, "\n"] if turn == 0 else new)
        history.append({"role": "assistant", "content": f"answer {turn}"})


def test_the_cache_is_bounded_in_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segment_tokens, "MAX_CACHED_PIECE_TOKENS", 400)
    segments = SegmentTokenizer({"<|u|>": 0}, lambda piece: list(range(len(piece))))
    for i in range(100):
        assert segments.encode(f"<|u|>{i:03d}{'y' * 40}<|u|>") == [0, *range(43), 0]
        assert segments.num_cached_tokens <= 400
    # The least recently used piece leaves first: one used on every call stays.
    segments = SegmentTokenizer({"<|u|>": 0}, lambda piece: list(range(len(piece))))
    for i in range(100):
        segments.encode(f"system prompt{'s' * 30}<|u|>{i:03d}{'y' * 40}")
    assert f"system prompt{'s' * 30}" in segments._pieces
    # A piece over a quarter of the bound is never kept.
    segments.encode("z" * 200)
    assert "z" * 200 not in segments._pieces


def test_a_lone_message_is_encoded_whole_and_fills_no_cache(small_model_dir: Path) -> None:
    served = load_served_model(ModelInfo(name="m", tokenizer=str(small_model_dir), max_model_len=1024, block_size=32))
    assert served.segments is not None
    for i in range(20):
        served.encode_chat([{"role": "user", "content": f"a question sent once, number {i}"}])
    assert served.segments.num_cached_tokens == 0
    served.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "and a history"}])
    assert served.segments.num_cached_tokens > 0
