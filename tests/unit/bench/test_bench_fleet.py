"""bench-fleet's pure parts (bench/fleet/workload.py, summary.py): the workload, the ideal hit rate, load
imbalance, a policy's row and the goals' verdicts. No process started."""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from fleet.summary import TABLE_HEADERS, EngineStat, Outcome, goals, imbalance, summarize, table_rows
from fleet.workload import (
    NOISY_TENANT,
    WorkloadConfig,
    block_chains,
    ideal_cached_tokens,
    make_workload,
    zipf_weights,
)

from tessera.routing.hashing import block_hash_chain

SMALL = WorkloadConfig(num_requests=400, rate_per_s=40.0, num_system_prompts=16, system_tokens=(64, 128),
                       user_tokens=(8, 24), reply_tokens=(8, 24), noisy_tokens=(64, 96), max_prompt_tokens=600)


# ---- workload ---------------------------------------------------------------------------------------------


def test_the_workload_is_seeded_ordered_and_as_long_as_asked() -> None:
    requests = make_workload(SMALL)
    assert requests == make_workload(SMALL)
    assert make_workload(replace(SMALL, seed=18)) != requests
    assert len(requests) == SMALL.num_requests
    assert [r.index for r in requests] == list(range(len(requests)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(requests))
    # Longer than nominal: sessions cut short by max_prompt_tokens bring fewer turns than their mean.
    assert 0.5 < requests[-1].arrival_s / (SMALL.num_requests / SMALL.rate_per_s) < 2.0
    assert {r.worker for r in requests} == {0, 1}
    assert all(r.text.isascii() and r.num_prompt_tokens == len(r.token_ids()) for r in requests)
    assert all(r.num_prompt_tokens <= SMALL.max_prompt_tokens for r in requests)


def test_a_sessions_turns_each_extend_the_previous_prompt_and_share_its_system_prompt() -> None:
    requests = make_workload(SMALL)
    sessions: dict[str, list[str]] = {}
    for r in requests:
        if r.session_id is not None:
            assert r.turn == len(sessions.setdefault(r.session_id, []))
            sessions[r.session_id].append(r.text)
    multi = [turns for turns in sessions.values() if len(turns) > 1]
    assert len(multi) > 10
    for turns in multi:
        for earlier, later in itertools.pairwise(turns):
            assert later.startswith(earlier + "\nAssistant: ")
    system_prompts = {turns[0].split("\nUser: ")[0] for turns in sessions.values()}
    assert len(system_prompts) <= SMALL.num_system_prompts


def test_the_noisy_tenant_takes_its_share_and_shares_nothing() -> None:
    requests = make_workload(replace(SMALL, num_requests=2000, rate_per_s=100.0))
    noisy = [r for r in requests if r.tenant == NOISY_TENANT]
    assert len(requests) == 2000 and len(noisy) == 300
    assert max(r.arrival_s for r in noisy) <= requests[-1].arrival_s
    assert all(r.session_id is None for r in noisy)
    assert len({r.text[:40] for r in noisy}) == len(noisy)
    without = make_workload(replace(SMALL, noisy_share=0.0))
    assert not [r for r in without if r.tenant == NOISY_TENANT]


def test_zipf_popularity_falls_with_rank() -> None:
    weights = zipf_weights(4, 1.0)
    assert math.isclose(sum(weights), 1.0)
    assert weights == sorted(weights, reverse=True)
    assert math.isclose(weights[0] / weights[1], 2.0)


def test_an_invalid_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="noisy_share"):
        WorkloadConfig(num_requests=1, rate_per_s=1.0, noisy_share=1.0)
    with pytest.raises(ValueError, match="num_requests"):
        WorkloadConfig(num_requests=0, rate_per_s=1.0)


# ---- the ideal --------------------------------------------------------------------------------------------


def test_the_ideal_hits_the_longest_prefix_any_earlier_request_held() -> None:
    chains = [(1, 2, 3), (1, 2, 9), (1, 2, 9, 4), (7, 2, 3), (1, 5)]
    lengths = [48, 48, 70, 48, 40]
    assert ideal_cached_tokens(chains, lengths, 16) == [
        0,   # cold
        32,  # blocks 1, 2 seen; 9 is new
        48,  # 1, 2, 9 seen (by two different requests)
        0,   # a different first block: nothing, whatever follows
        16,  # 1 seen
    ]


def test_the_ideal_never_counts_the_last_prompt_token() -> None:
    # A 48-token prompt seen before whole: vLLM computes its last token, so 32 tokens hit, not 48.
    assert ideal_cached_tokens([(1, 2, 3), (1, 2, 3)], [48, 48], 16) == [0, 32]
    with pytest.raises(ValueError):
        ideal_cached_tokens([(1,)], [16, 16], 16)


def test_block_chains_are_the_gateways_unsalted_chains_and_repeat_for_repeated_prompts() -> None:
    requests = make_workload(replace(SMALL, num_requests=50))
    chains = block_chains(requests, 16, block_hash_chain)
    for request, chain in zip(requests, chains, strict=True):
        assert chain == block_hash_chain(request.token_ids(), 16, None)
    later_turn = next(r for r in requests if r.turn > 0)
    turns = [c for r, c in zip(requests, chains, strict=True) if r.session_id == later_turn.session_id]
    assert len(turns) > 1
    for earlier, later in itertools.pairwise(turns):
        assert later[:len(earlier)] == earlier  # a turn's chain extends its predecessor's


# ---- summary and goals ------------------------------------------------------------------------------------


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([1.0, 1.0, 1.0, 1.0]) == 1.0
    assert imbalance([4.0, 0.0, 0.0, 0.0]) == 4.0
    assert math.isnan(imbalance([])) and math.isnan(imbalance([0.0, 0.0]))


def test_a_row_counts_the_engines_hits_against_the_ideal_and_failures_apart() -> None:
    outcomes = [Outcome(0.1, 1.0, 0, 100, 4, True, "e0", 30.0), Outcome(0.3, 2.0, 64, 100, 4, True, "e1", 50.0),
                Outcome(5.0, 3.0, 0, 100, 0, ok=False)]
    engines = [EngineStat("e0", 1.0, 100, 0, 0), EngineStat("e1", 3.0, 100, 64, 1)]
    row = summarize(outcomes, ideal_cached=80, engines=engines, extra={"index_bytes": 3 * 2**20})
    assert row["num_requests"] == 3 and row["num_failed"] == 1
    assert math.isclose(row["hit_rate"], 64 / 200) and math.isclose(row["ideal_hit_rate"], 80 / 200)
    assert math.isclose(row["share_of_ideal"], 0.8)
    assert math.isclose(row["ttft_p50_ms"], 200.0)  # the failed request's TTFT is left out
    assert math.isclose(row["throughput_rps"], 1.0)  # two done by 2.0 simulated s
    assert math.isclose(row["imbalance_busy"], 1.5)
    assert math.isclose(row["busy_share"], 1.0)  # a mean of 2.0 simulated s in steps over a 2.0 s run
    assert row["decision_p50_us"] == 40.0 and row["engines_used"] == 2 and row["preemptions"] == 1
    assert row["index_bytes"] == 3 * 2**20
    [cells] = table_rows({"prefix_affinity": row})
    assert len(cells) == len(TABLE_HEADERS) and cells[9] == "3.0" and cells[6] == "100"
    router_row = {**row, "index_bytes": None, "router_rss_bytes": 50 * 2**20, "decision_p99_us": None}
    [cells] = table_rows({"vllm-router:kv_aware": router_row})
    assert cells[9] == "rss 50" and cells[8] == "-"


def _row(share: float, hit: float, p99: float) -> dict[str, float]:
    return {"share_of_ideal": share, "hit_rate": hit, "ttft_p99_ms": p99}


def test_goals_need_90pct_of_ideal_half_round_robins_p99_and_to_beat_every_vllm_router_policy() -> None:
    rows = {"round_robin": _row(0.3, 0.2, 400.0), "prefix_affinity": _row(0.95, 0.6, 150.0),
            "vllm-router:cache_aware": _row(0.8, 0.5, 180.0), "vllm-router:kv_aware": _row(0.9, 0.55, 160.0)}
    assert goals(rows) == {"prefix_affinity_at_least_90pct_of_ideal": True,
                           "prefix_affinity_p99_at_most_half_round_robin": True,
                           "prefix_affinity_hit_rate_ahead_of_vllm_router": True,
                           "prefix_affinity_p99_ahead_of_vllm_router": True}
    worse = {**rows, "prefix_affinity": _row(0.89, 0.56, 201.0), "vllm-router:kv_aware": _row(0.9, 0.57, 170.0)}
    assert goals(worse) == {"prefix_affinity_at_least_90pct_of_ideal": False,
                            "prefix_affinity_p99_at_most_half_round_robin": False,
                            "prefix_affinity_hit_rate_ahead_of_vllm_router": False,
                            "prefix_affinity_p99_ahead_of_vllm_router": False}


def test_goals_not_judged_without_their_rows() -> None:
    only = goals({"prefix_affinity": _row(0.95, 0.6, 150.0)})
    assert only["prefix_affinity_at_least_90pct_of_ideal"] is True
    assert only["prefix_affinity_p99_at_most_half_round_robin"] is None
    assert only["prefix_affinity_hit_rate_ahead_of_vllm_router"] is None
    assert goals({"prefix_affinity": _row(math.nan, 0.6, 150.0)})["prefix_affinity_at_least_90pct_of_ideal"] is None
