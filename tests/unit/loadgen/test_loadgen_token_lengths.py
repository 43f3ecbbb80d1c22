"""Prompt lengths in the served model's tokens, counted the way the Tessera gateway counts them.

The counts are checked with the gateway's own code (``tessera.gateway.models.ServedModel``: the chat
template rendered as the gateway renders it, no special tokens added) on the project's small model, whose
byte-level BPE splits common English words into about three tokens, so word counts miss by about 3x.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tessera.gateway.models import ServedModel, load_served_model
from tessera.registry import ModelInfo
from tessera_loadgen.factory import RequestFactory
from tessera_loadgen.prompt_tokenizer import PromptTokenizer
from tessera_loadgen.prompts import PromptLibrary, synthetic_words
from tessera_loadgen.token_corpus import TokenCorpus
from tessera_loadgen.token_fit import fit_to_tokens
from tessera_loadgen.tokenizer_spec import TokenizerDocument, TokenizerSpec, load_model_dir
from tessera_loadgen.workload import RequestClass, Workload

TARGETS = (50, 200, 600, 1200)
TOLERANCE = 0.02
MODEL = "tessera-small"


@pytest.fixture(scope="module")
def spec(small_model_dir: Path) -> TokenizerSpec:
    return load_model_dir(small_model_dir)


@pytest.fixture(scope="module")
def gateway_model(small_model_dir: Path) -> ServedModel:
    return load_served_model(ModelInfo(MODEL, str(small_model_dir), 2048, 16))


def workload(classes: list[dict[str, Any]], seed: int = 1, prefix_tokens: int = 300) -> Workload:
    return Workload.model_validate(
        {
            "num_requests": 10,
            "seed": seed,
            "prefix_groups": {"sys": {"num_prefixes": 2, "prefix_tokens": prefix_tokens}},
            "tenants": [
                {"name": "a", "arrival": {"rate_rps": 1}, "classes": classes},
                {"name": "b", "arrival": {"rate_rps": 1}, "classes": classes},
            ],
        }
    )


def library_for(w: Workload, spec: TokenizerSpec) -> PromptLibrary:
    groups = {n: (g.num_prefixes, g.prefix_tokens) for n, g in w.prefix_groups.items()}
    return PromptLibrary(w.seed, groups, {MODEL: spec})


def factory(w: Workload, library: PromptLibrary, tenant: int = 0) -> RequestFactory:
    return RequestFactory(w, w.tenants[tenant], MODEL, library, seed=tenant)


def gateway_count(model: ServedModel, body: dict[str, Any]) -> int:
    """``usage.prompt_tokens`` as the gateway computes it for this body."""
    if "messages" in body:
        return len(model.encode_chat(body["messages"]))
    return len(model.encode(body["prompt"]))


def history_ids(model: ServedModel, messages: list[dict[str, str]]) -> list[int]:
    """The tokens of messages already sent, as they appear at the start of the next prompt."""
    text = model.chat_template.render(messages=messages, add_generation_prompt=False, bos_token="", eos_token="")
    return model.encode(text)


def within_tolerance(achieved: int, asked: int) -> bool:
    return abs(achieved - asked) <= TOLERANCE * asked


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("target", TARGETS)
def test_prompts_have_the_asked_number_of_the_models_tokens(
    endpoint: str, target: int, spec: TokenizerSpec, gateway_model: ServedModel
) -> None:
    w = workload([{"name": "c", "endpoint": endpoint, "prompt": {"tokens": target}}])
    f = factory(w, library_for(w, spec))
    request_class = w.tenants[0].classes[0]
    # Enough requests to pass the first, counted ones and reach the trusted (predicted only) ones.
    for i in range(8):
        record, body = f.single(request_class, f"r{i}", 0.0, False)
        achieved = gateway_count(gateway_model, body)
        assert record.n_in_asked == target
        assert within_tolerance(achieved, target), (endpoint, target, achieved)


def test_without_a_tokenizer_word_counts_miss_the_models_tokens(gateway_model: ServedModel) -> None:
    """The bug of the issue: 200 words are about 600 tokens of the small model."""
    w = workload([{"name": "c", "endpoint": "completions", "prompt": {"tokens": 200}}])
    library = PromptLibrary(w.seed, {"sys": (2, 300)})
    record, body = factory(w, library).single(w.tenants[0].classes[0], "r", 0.0, False)
    assert record.n_in_asked == 200
    assert gateway_count(gateway_model, body) > 400


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prefixes_are_exact_and_shared_token_for_token(
    endpoint: str, spec: TokenizerSpec, gateway_model: ServedModel
) -> None:
    w = workload([{"name": "c", "endpoint": endpoint, "prompt": {"tokens": 200, "prefix_group": "sys"}}])
    library = library_for(w, spec)
    prefixes = library.maker(MODEL).prefix_groups["sys"]  # type: ignore[attr-defined]
    assert [len(gateway_model.encode(p.text)) for p in prefixes] == [300, 300]

    by_prefix: dict[str, list[list[int]]] = {}
    for tenant in (0, 1):
        f = factory(w, library, tenant)
        for i in range(12):
            record, body = f.single(w.tenants[tenant].classes[0], f"r{i}", 0.0, False)
            assert record.n_in_asked == 500
            assert within_tolerance(gateway_count(gateway_model, body), 500)
            if endpoint == "chat":
                system = body["messages"][0]["content"]
                ids = gateway_model.encode_chat(body["messages"])
            else:
                system = body["prompt"].split("\n", 1)[0]
                ids = gateway_model.encode(body["prompt"])
            by_prefix.setdefault(system, []).append(ids)
    assert set(by_prefix) == {p.text for p in prefixes}  # both tenants use the same two prefixes
    for system, prompts in by_prefix.items():
        if endpoint == "chat":
            head = history_ids(gateway_model, [{"role": "system", "content": system}])
        else:
            head = gateway_model.encode(system + "\n")
        # Every prompt of a prefix starts with the same tokens: the prefix is cacheable across requests.
        assert all(ids[: len(head)] == head for ids in prompts)
        assert len(head) >= 300


def test_session_turns_add_the_asked_tokens_to_the_history(spec: TokenizerSpec, gateway_model: ServedModel) -> None:
    w = workload([{"name": "s", "prompt": {"tokens": 120, "prefix_group": "sys"}, "session": {"turns": 4}}])
    f = factory(w, library_for(w, spec))
    request_class = w.tenants[0].classes[0]
    session = f.new_session(request_class, "s0")
    for turn in range(4):
        history = list(session.messages)
        record, body = f.turn(request_class, session, 0.0, False)
        if turn == 0:
            assert record.n_in_asked == 300 + 120
        else:
            before = len(history_ids(gateway_model, history))
            assert record.n_in_asked == before + 120
        assert record.n_in_asked is not None
        assert within_tolerance(gateway_count(gateway_model, body), record.n_in_asked)
        f.end_turn(session, f"answer {turn}: the server said something of some length")


def test_token_prompts_are_deterministic_for_a_seed(spec: TokenizerSpec) -> None:
    classes = [
        {"name": "c", "prompt": {"tokens": {"kind": "uniform", "low": 50, "high": 400}, "prefix_group": "sys"}},
        {"name": "p", "endpoint": "completions", "prompt": {"tokens": 300}},
    ]

    def bodies(seed: int) -> list[dict[str, Any]]:
        w = workload(classes, seed=seed)
        f = factory(w, library_for(w, spec))
        out = []
        for i in range(20):
            _, body = f.single(f.pick_class(), f"r{i}", 0.0, False)
            out.append(body)
        return out

    assert bodies(3) == bodies(3)
    assert bodies(3) != bodies(4)


def test_token_corpus_predicts_the_count_of_its_text(spec: TokenizerSpec) -> None:
    tokenizer = PromptTokenizer(spec)
    corpus = TokenCorpus(synthetic_words(5), tokenizer.count)
    rng = random.Random(0)
    for num_tokens in (1, 2, 7, 50, 333, 1200, 250_000):  # the last one wraps around the word stream
        start = rng.randrange(len(corpus))
        assert tokenizer.count(corpus.text(start, num_tokens)) == num_tokens


def test_fit_to_tokens_corrects_a_wrong_guess() -> None:
    """A seam that adds tokens (here 7, as a chat template would) is measured and absorbed."""
    words = [f"w{i}" for i in range(1000)]

    def build(k: int) -> str:
        return " ".join(words[:k])

    def count(text: str) -> int:
        return len(text.split()) + 7

    fitted = fit_to_tokens(100, build, count, first_guess=100)
    assert (fitted.num_tokens, len(fitted.text.split()), fitted.num_tries) == (100, 93, 2)
    unreachable = fit_to_tokens(3, build, count, first_guess=3)
    assert unreachable.num_tokens == 8  # the closest there is: one word and the seam


def test_model_dir_and_gateway_document_give_the_same_tokenizer(spec: TokenizerSpec, small_model_dir: Path) -> None:
    assert spec.chat_template is not None and "<|assistant|>" in spec.chat_template
    assert (spec.bos_token, spec.eos_token, spec.max_model_len) == ("<s>", "</s>", 8192)
    import json

    document = TokenizerDocument.model_validate(
        {
            "model": MODEL,
            "max_model_len": 2048,
            "tokenizer": json.loads((small_model_dir / "tokenizer.json").read_text()),
            "chat_template": spec.chat_template,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "added_later": "ignored",
        }
    )
    fetched = PromptTokenizer(document.to_spec("http://gateway"))
    local = PromptTokenizer(spec)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the number of states"}]
    assert fetched.count_chat(messages) == local.count_chat(messages)
    assert fetched.max_model_len == 2048


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_model_dir(tmp_path)


def test_request_class_without_a_template_uses_the_gateways_transcript(spec: TokenizerSpec) -> None:
    bare = TokenizerSpec(spec.tokenizer_json, None, "", "", None, "test")
    tokenizer = PromptTokenizer(bare)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    w = workload([{"name": "c", "prompt": {"tokens": 200}}])
    library = PromptLibrary(w.seed, {"sys": (2, 300)}, {MODEL: bare})
    request_class: RequestClass = w.tenants[0].classes[0]
    _, body = factory(w, library).single(request_class, "r", 0.0, False)
    assert within_tolerance(tokenizer.count_chat(body["messages"]), 200)
