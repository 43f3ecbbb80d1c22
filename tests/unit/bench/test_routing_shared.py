"""The helpers the routing benchmarks share (bench/routing_figures.py, bench/replica_drive.py) and their use
by bench_routing's workload (bench/routing_sim.py): the ideal cache, percentiles, the replica's /generate
stream read, the open-loop replay. No process started."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import routing_sim
from replica_drive import read_generate_stream, replay
from routing_figures import fleet_lru_cached_tokens, ideal_cached_tokens, percentile


def test_percentile_interpolates_linearly_and_is_nan_for_nothing() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert math.isclose(percentile([0.0, 10.0], 99), 9.9)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_the_sim_workloads_ideal_is_the_shared_ideal_over_its_chains() -> None:
    spec = routing_sim.WorkloadSpec(tenants=2, prompts_per_tenant=2, system_tokens=128, suffix_tokens=(8, 40))
    requests = routing_sim.make_workload(spec, 40, 5.0)
    expected = ideal_cached_tokens([r.chain for r in requests], [len(r.prompt) for r in requests], spec.block_size)
    assert [r.ideal_cached for r in requests] == expected
    assert requests[0].ideal_cached == 0  # nothing seen before the first
    # Four system prompts of four whole blocks each, 40 requests: every later repeat hits its whole prompt.
    assert sum(1 for r in requests if r.ideal_cached == 128) == 40 - len({r.chain[:4] for r in requests})


def test_the_fleet_lru_evicts_the_least_recently_used_blocks_a_requests_head_last() -> None:
    a, b, c = (10, 11), (20, 21), (30, 31)  # three prompts of two blocks of 4 tokens, 9 tokens each
    sequence = [a, b, a, c, b, a]
    lengths = [9] * len(sequence)
    # Room for all six blocks: every repeat hits its whole prompt (8 tokens), as the unbounded ideal does.
    assert fleet_lru_cached_tokens(sequence, lengths, 4, 6) == ideal_cached_tokens(sequence, lengths, 4) \
        == [0, 0, 8, 0, 8, 8]
    # Room for four: c evicts b (least recently used), so b misses; a, used just before, stays.
    assert fleet_lru_cached_tokens(sequence, lengths, 4, 4) == [0, 0, 8, 0, 0, 0]
    # Room for three: a prompt's tail block goes before its head (vLLM frees a request's blocks tail first), so
    # after c the cache still holds b's head, and b again hits its first block (with the head evicted first: 0).
    assert fleet_lru_cached_tokens([a, b, c, b], [9] * 4, 4, 3) == [0, 0, 0, 4]


def test_a_simulated_outcome_is_an_outcome_of_bench_routings_figures() -> None:
    outcome = routing_sim.SimOutcome("sim-0", "reason", 0.1, 0.2, 32, 64, 4, expected_cached=32)
    assert isinstance(outcome, routing_sim.Outcome)
    assert (outcome.engine_id, outcome.cached, outcome.expected_cached, outcome.best_cached) == ("sim-0", 32, 32, 0)


async def _lines(*messages: dict[str, object]) -> AsyncIterator[bytes]:
    for message in messages:
        yield orjson.dumps(message) + b"\n"


async def test_a_generate_stream_gives_its_first_token_time_and_the_engines_stats() -> None:
    before = time.perf_counter()
    done = {"done": True, "stats": {"num_cached_tokens": 32}}
    stream = await read_generate_stream(_lines({"t": [5]}, {"t": [6]}, done))
    assert stream.first_token_s is not None and before <= stream.first_token_s <= time.perf_counter()
    assert stream.stats == {"num_cached_tokens": 32} and stream.error is None


async def test_a_generate_stream_stops_at_its_error_line() -> None:
    stream = await read_generate_stream(_lines({"error": "engine gone"}, {"done": True, "stats": {"x": 1}}))
    assert (stream.first_token_s, stream.stats, stream.error) == (None, {}, "engine gone")


@dataclass(frozen=True)
class _Request:
    name: str
    arrival_s: float


async def test_replay_sends_each_request_at_its_scaled_arrival_and_keeps_request_order() -> None:
    sent: list[tuple[str, float, float]] = []

    async def one(request: _Request, scheduled: float, start: float) -> str:
        sent.append((request.name, scheduled - start, time.perf_counter() - scheduled))
        await asyncio.sleep(0.03 if request.name == "a" else 0.0)  # the first finishes last
        return request.name

    requests = [_Request("a", 0.0), _Request("b", 0.01), _Request("c", 0.02)]
    assert await replay(requests, one, time_scale=2.0, lead_s=0.01) == ["a", "b", "c"]
    assert [name for name, _, _ in sent] == ["a", "b", "c"]
    assert [round(offset, 6) for _, offset, _ in sent] == [0.0, 0.02, 0.04]  # arrival_s x time_scale
    assert all(late >= 0 for _, _, late in sent)  # never sent before its time
