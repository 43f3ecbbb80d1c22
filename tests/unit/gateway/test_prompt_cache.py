"""Repeated prompts skip the chat template and the tokenizer (models.ServedModel's bounded cache), and the
admission's per-request ids and period windows need no syscall and no date formatting per request."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from tessera.gateway import models
from tessera.gateway.models import ServedModel
from tessera.registry import ModelInfo
from tessera.tenancy.admission import Admission
from tessera.tenancy.periods import period_window
from tessera.tenancy.policy import TenantPolicy


class _Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        self.calls += 1
        return _Encoding([ord(c) for c in text])


def _model() -> tuple[ServedModel, CountingTokenizer]:
    tokenizer = CountingTokenizer()
    return ServedModel(ModelInfo("m", "/nowhere", 256, 16), tokenizer, None, "", ""), tokenizer


def test_a_repeated_prompt_is_tokenized_once_and_a_different_one_again() -> None:
    model, tokenizer = _model()
    chat = [{"role": "user", "content": "hi"}]
    first = model.encode_chat(chat)
    assert model.encode_chat([{"role": "user", "content": "hi"}]) == first and tokenizer.calls == 1
    assert model.encode_chat([{"role": "system", "content": "hi"}]) != first and tokenizer.calls == 2
    assert model.encode("hi") == [ord("h"), ord("i")] and model.encode("hi") == [104, 105]
    assert tokenizer.calls == 3


def test_the_cache_is_bounded_in_entries_and_prompt_length(monkeypatch: Any) -> None:
    monkeypatch.setattr(models, "MAX_CACHED_PROMPTS", 2)
    model, tokenizer = _model()
    for text in ("a", "b", "c"):
        model.encode(text)
    model.encode("c")
    assert tokenizer.calls == 3
    model.encode("a")  # the oldest went out first
    assert tokenizer.calls == 4
    long = "x" * (models.MAX_CACHED_PROMPT_CHARS + 1)
    model.encode(long)
    model.encode(long)
    assert tokenizer.calls == 6


def test_the_cache_is_bounded_in_tokens_oldest_out_first(monkeypatch: Any) -> None:
    monkeypatch.setattr(models, "MAX_CACHED_TOKENS", 10)
    monkeypatch.setattr(models, "MAX_CACHED_PROMPT_SHARE", 0.3)  # at most 3 tokens a prompt
    model, tokenizer = _model()
    for text in ("aa", "bbb", "cc", "dd"):  # 9 tokens cached
        model.encode(text)
    model.encode("ee")  # 11 > 10: "aa", the oldest, goes
    assert model._num_cached_tokens == 9
    model.encode("bbb")
    assert tokenizer.calls == 5  # "bbb" still cached
    model.encode("aa")
    assert tokenizer.calls == 6 and model._num_cached_tokens <= 10
    model.encode("wxyz")  # 4 tokens > its share of the budget: not cached, nothing evicted for it
    model.encode("wxyz")
    assert tokenizer.calls == 8 and model._num_cached_tokens <= 10


def test_distinct_long_prompts_keep_the_cache_within_its_token_budget() -> None:
    model, _ = _model()
    for i in range(2 * models.MAX_CACHED_PROMPTS):
        model.encode(f"{i:05d}" + "x" * 2000)  # ~2,000 tokens each, all different
    assert model._num_cached_tokens <= models.MAX_CACHED_TOKENS
    assert sum(len(ids) for ids in model._encoded.values()) == model._num_cached_tokens


def test_lease_ids_are_unique_and_windows_match_period_window() -> None:
    redis = aioredis.Redis()  # never connected: prepare() makes no call
    first, second = Admission(redis), Admission(redis)
    policy = TenantPolicy(token_budget=1000, budget_period="day")
    ids = {a.prepare("t", policy, 10).lease.lease_id for a in (first, second) for _ in range(100)}
    assert len(ids) == 200
    call = first.prepare("t", policy, 10)
    period_id, ttl = period_window("day", datetime.now(UTC))
    assert call.keys[4].endswith(period_id) and abs(int(call.args[7]) - ttl) <= 1  # the budget key, its TTL


def test_token_ids_skip_the_offsets_and_give_the_ids_encode_gives() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({"kv": 0, "cache": 1, "é": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    for text in ("kv cache", "cache é kv unknown", ""):
        assert models.token_ids(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False).ids
    # A tokenizer without the batch method (an older tokenizers, a test double) goes through encode.
    assert models.token_ids(CountingTokenizer(), "ab") == [97, 98]
