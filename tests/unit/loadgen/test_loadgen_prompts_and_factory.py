"""Prompt material and request bodies: lengths, shared prefixes, ShareGPT, multi-turn history."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from tessera_loadgen.factory import RequestFactory
from tessera_loadgen.prompts import PromptLibrary, SyntheticText, load_sharegpt
from tessera_loadgen.workload import Workload


def workload(**class_fields: object) -> Workload:
    return Workload.model_validate(
        {
            "num_requests": 10,
            "seed": 1,
            "prefix_groups": {"sys": {"num_prefixes": 2, "prefix_tokens": 30}},
            "tenants": [
                {"name": "a", "arrival": {"rate_rps": 1}, "classes": [{"name": "c", **class_fields}]},
                {"name": "b", "arrival": {"rate_rps": 1}, "classes": [{"name": "c", **class_fields}]},
            ],
        }
    )


def factory(w: Workload, tenant: int = 0, library: PromptLibrary | None = None) -> RequestFactory:
    library = library or PromptLibrary(
        w.seed, {n: (g.num_prefixes, g.prefix_tokens) for n, g in w.prefix_groups.items()}
    )
    return RequestFactory(w, w.tenants[tenant], "m", library, seed=tenant)


def test_synthetic_text_has_the_requested_word_count() -> None:
    text = SyntheticText(0)
    rng = random.Random(0)
    assert len(text.text(rng, 100).split()) == 100
    assert len(text.text(rng, 70_000).split()) == 70_000
    prompts = {text.text(rng, 20) for _ in range(50)}
    assert len(prompts) == 50  # random offsets: no two prompts alike


def test_chat_body_has_stream_options_and_max_tokens() -> None:
    w = workload(output_tokens=12, prompt={"tokens": 40})
    record, body = factory(w).single(w.tenants[0].classes[0], "a-0", 5.0, warmup=False)
    assert body["model"] == "m"
    assert body["max_tokens"] == 12
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert len(body["messages"]) == 1 and len(body["messages"][0]["content"].split()) == 40
    assert (record.request_id, record.t_sched, record.max_tokens, record.tenant) == ("a-0", 5.0, 12, "a")


def test_completions_non_streamed_with_extra_body_and_ignore_eos() -> None:
    w = workload(endpoint="completions", stream=False, extra_body={"temperature": 0})
    w = w.model_copy(update={"ignore_eos": True, "continuous_usage_stats": False})
    _, body = factory(w).single(w.tenants[0].classes[0], "a-0", 0.0, warmup=True)
    assert "prompt" in body and "messages" not in body
    assert "stream" not in body
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0


def test_prefix_groups_are_shared_across_tenants() -> None:
    w = workload(prompt={"tokens": 5, "prefix_group": "sys"})
    library = PromptLibrary(w.seed, {"sys": (2, 30)})
    seen: Counter[str] = Counter()
    for tenant in (0, 1):
        f = factory(w, tenant, library)
        for i in range(40):
            _, body = f.single(w.tenants[tenant].classes[0], f"{i}", 0.0, False)
            system = body["messages"][0]
            assert system["role"] == "system"
            seen[system["content"]] += 1
    assert len(seen) == 2  # two prefixes in the group, used by both tenants
    assert all(len(p.split()) == 32 for p in seen)  # "[sys i]" label + 30 words


def test_class_mix_follows_weights() -> None:
    w = Workload.model_validate(
        {
            "num_requests": 1,
            "tenants": [
                {
                    "name": "a",
                    "arrival": {"rate_rps": 1},
                    "classes": [{"name": "x", "weight": 3}, {"name": "y", "weight": 1}],
                }
            ],
        }
    )
    f = factory(w)
    counts = Counter(f.pick_class().name for _ in range(4000))
    assert counts["x"] / 4000 == pytest.approx(0.75, abs=0.04)


def test_session_turns_carry_the_history() -> None:
    w = workload(session={"turns": 3, "think_time_s": 0.5}, prompt={"tokens": 4, "prefix_group": "sys"})
    f = factory(w)
    request_class = w.tenants[0].classes[0]
    session = f.new_session(request_class, "a-s0")
    assert session.num_turns == 3
    record, body = f.turn(request_class, session, 1.0, False)
    assert (record.request_id, record.session_id, record.turn) == ("a-s0-t0", "a-s0", 0)
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    f.end_turn(session, "answer one")
    record, body = f.turn(request_class, session, 2.0, False)
    assert record.turn == 1
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "answer one"
    assert f.think_time_s(request_class) == 0.5


def sharegpt_file(tmp_path: Path) -> Path:
    data = [
        {
            "id": "1",
            "conversations": [
                {"from": "human", "value": "first q"},
                {"from": "gpt", "value": "a"},
                {"from": "human", "value": "second q"},
            ],
        },
        {"id": "2", "conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "only a"}]},
        {"id": "3", "conversations": [{"from": "user", "value": "lonely q"}]},
        "garbage",
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_loading_keeps_user_turns(tmp_path: Path) -> None:
    conversations = load_sharegpt(sharegpt_file(tmp_path))
    assert [c.user_turns for c in conversations] == [("first q", "second q"), ("lonely q",)]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no conversation"):
        load_sharegpt(empty)


def test_sharegpt_sessions_replay_the_conversation(tmp_path: Path) -> None:
    path = str(sharegpt_file(tmp_path))
    w = workload(prompt={"source": "sharegpt", "path": path}, session={"turns": 5})
    f = factory(w)
    request_class = w.tenants[0].classes[0]
    for _ in range(10):
        session = f.new_session(request_class, "s")
        assert session.conversation is not None
        assert session.num_turns == len(session.conversation.user_turns)  # capped by the conversation
        _, body = f.turn(request_class, session, 0.0, False)
        assert body["messages"][-1]["content"] == session.conversation.user_turns[0]
