"""The prompt's pieces encoded by tiktoken's merge loop give the tokenizer's own ids (gateway/fast_bpe.py), and a
tokenizer whose merges tiktoken's rule would not repeat keeps its own BPE."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from tessera.gateway.fast_bpe import byte_alphabet, merge_ranks, tiktoken_pieces
from tessera.gateway.models import ServedModel, added_tokens, load_served_model, token_ids
from tessera.registry import ModelInfo

from .test_segment_tokens import random_text, trained_tokenizer

# cl100k's split regex, as Llama 3's and Qwen's tokenizers write it in a Split pre-tokenizer.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def fast_of(tokenizer: Tokenizer) -> Any:
    return tiktoken_pieces(json.loads(tokenizer.to_str()), lambda text: token_ids(tokenizer, text),
                           added_tokens(tokenizer), "test")


def soup(tokenizer: Tokenizer, rng: random.Random, num_tokens: int = 120) -> str:
    """Text decoded from random ids, as bench-stack's prompts are made: words no cache has seen."""
    ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(num_tokens)]
    return str(tokenizer.decode(ids))


def test_the_small_models_prompts_get_the_tokenizers_own_ids(small_model_dir: Path) -> None:
    served = load_served_model(ModelInfo(name="m", tokenizer=str(small_model_dir), max_model_len=1024, block_size=32))
    assert served.fast_path  # the small model's check takes ~10 ms: done before loading returns
    rng = random.Random(3)
    specials = ["<|user|>", "<|assistant|>", "<|system|>", "<s>", "</s>", "<unk>"]
    texts = [random_text(rng, specials) for _ in range(300)] + [soup(served.tokenizer, rng) for _ in range(300)]
    for text in texts:
        assert served.encode_text(text) == token_ids(served.tokenizer, text), text
    messages = [{"role": "user", "content": texts[-1]}]
    rendered = served.chat_template.render(messages=messages, add_generation_prompt=True, bos_token="<s>",
                                           eos_token="</s>")
    assert served.encode_chat(messages) == token_ids(served.tokenizer, rendered)
    assert served.segments is not None and served.segments.num_cached_tokens == 0  # a lone message keeps nothing


def test_a_tokenizer_whose_check_is_long_serves_on_its_own_path_until_the_check_ends() -> None:
    tokenizer = trained_tokenizer(["<|im_end|>"])
    served = ServedModel(ModelInfo("m", "/nowhere", 256, 16), tokenizer, None, "", "")
    assert not served.fast_path
    thread = served.speed_up(wait_s=0.0)
    assert thread is not None
    text = "the naïve cache<|im_end|> tokens"
    assert served.encode_text(text) == token_ids(tokenizer, text)  # either path, the same ids
    thread.join()
    assert served.fast_path and served.encode_text(text) == token_ids(tokenizer, text)


def test_added_tokens_the_gateway_cannot_cut_keep_the_tokenizers_path() -> None:
    tokenizer = trained_tokenizer(["<|im_end|>"], lstrip=True)  # its cut depends on the spaces before it
    served = ServedModel(ModelInfo("m", "/nowhere", 256, 16), tokenizer, None, "", "")
    thread = served.speed_up()
    assert thread is not None
    thread.join()
    assert not served.fast_path
    text = "a  <|im_end|> b"
    assert served.encode_text(text) == token_ids(tokenizer, text)


def test_a_trained_byte_level_bpe_with_nfc_gets_its_own_ids() -> None:
    tokenizer = trained_tokenizer(["<|im_start|>", "<|im_end|>"])
    fast = fast_of(tokenizer)
    assert fast is not None
    rng = random.Random(8)
    for _ in range(300):
        text = random_text(rng, [])
        assert fast(text) == token_ids(tokenizer, text), text


def split_tokenizer() -> Tokenizer:
    """A BPE behind a Split regex and a bytes-only ByteLevel, the shape of Llama 3's and Qwen's tokenizers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(1)
    tokenizer.train_from_iterator([random_text(rng, [], 60) for _ in range(400)], trainer)
    return tokenizer


def test_a_split_regex_pre_tokenizer_gets_its_own_ids() -> None:
    tokenizer = split_tokenizer()
    fast = fast_of(tokenizer)
    assert fast is not None
    rng = random.Random(4)
    for _ in range(300):
        text = random_text(rng, []) + soup(tokenizer, rng, 40)
        assert fast(text) == token_ids(tokenizer, text), text


def handmade_bpe(merges: list[tuple[str, str]]) -> Tokenizer:
    """The 256 bytes, then each merge's token in the order given."""
    vocab = {char: i for i, char in enumerate(sorted(byte_alphabet(), key=byte_alphabet().__getitem__))}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def test_merges_that_tiktokens_rule_would_not_take_keep_the_tokenizers_bpe() -> None:
    # "bc" merges before "ab", and "abc" is made of "ab" + "c": the tokenizer can never make "abc" from "abc"
    # (after "bc" no merge joins "a" and "bc"), while tiktoken, finding "abc" among its ranks, would.
    tokenizer = handmade_bpe([("b", "c"), ("a", "b"), ("ab", "c")])
    assert token_ids(tokenizer, "abc") == [ord("a"), 256]
    model = json.loads(tokenizer.to_str())["model"]
    assert merge_ranks(model) is None
    assert fast_of(tokenizer) is None
    # The same merges in an order tiktoken's rule repeats are taken.
    consistent = handmade_bpe([("a", "b"), ("b", "c"), ("ab", "c")])
    assert merge_ranks(json.loads(consistent.to_str())["model"]) is not None
    fast = fast_of(consistent)
    assert fast is not None and fast("abc abcbc") == token_ids(consistent, "abc abcbc")


def test_ignore_merges_is_taken_where_every_word_the_vocabulary_holds_is_a_rank() -> None:
    # ignore_merges: a word that is in the vocabulary is one token, merges or not. tiktoken does the same for its
    # ranks, so a vocabulary entry no merge makes (here "xyz") would be a word only the tokenizer keeps whole.
    tokenizer = handmade_bpe([("a", "b"), ("ab", "c")])
    spec = json.loads(tokenizer.to_str())
    spec["model"]["ignore_merges"] = True
    assert merge_ranks(spec["model"]) is not None
    spec["model"]["vocab"]["xyz"] = len(spec["model"]["vocab"])
    assert merge_ranks(spec["model"]) is None
    odd = Tokenizer.from_str(json.dumps(spec))
    assert token_ids(odd, "xyz") == [spec["model"]["vocab"]["xyz"]]  # whole, where tiktoken would give x, y, z
    # An added token's text is cut out before any word reaches the model: it does not count.
    assert merge_ranks(spec["model"], added=["xyz"]) is not None


def test_a_merge_whose_token_id_is_lower_than_an_earlier_ones_is_refused() -> None:
    tokenizer = handmade_bpe([("a", "b"), ("c", "d")])
    model = json.loads(tokenizer.to_str())["model"]
    model["vocab"]["ab"], model["vocab"]["cd"] = model["vocab"]["cd"], model["vocab"]["ab"]
    assert merge_ranks(model) is None
    model = json.loads(tokenizer.to_str())["model"]
    model["vocab"]["a"] = model["vocab"]["b"]  # two tokens under one id
    assert merge_ranks(model) is None


@pytest.mark.parametrize("change", ["lowercase", "prefix_space", "whitespace", "dropout"])
def test_a_shape_tiktoken_does_not_repeat_keeps_the_tokenizers_bpe(change: str) -> None:
    tokenizer = trained_tokenizer([])
    if change == "lowercase":
        tokenizer.normalizer = normalizers.Lowercase()
    elif change == "prefix_space":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "whitespace":
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    else:
        spec = json.loads(tokenizer.to_str())
        spec["model"]["dropout"] = 0.1
        tokenizer = Tokenizer.from_str(json.dumps(spec))
    assert fast_of(tokenizer) is None


def test_a_sample_that_disagrees_keeps_the_tokenizers_bpe(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = trained_tokenizer([])
    with caplog.at_level(logging.WARNING, logger="tessera.gateway.fast_bpe"):
        assert tiktoken_pieces(json.loads(tokenizer.to_str()), lambda text: [0], [], "odd") is None
    assert "differ" in caplog.text


def test_the_byte_table_is_the_byte_level_alphabet() -> None:
    assert set(byte_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(byte_alphabet().values()) == list(range(256))
