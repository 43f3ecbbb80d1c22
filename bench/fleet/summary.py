"""The fleet benchmark's figures per policy, and the goals' verdicts per fleet size. Pure: outcomes in,
numbers out.

Every latency is in simulated seconds (the fleet may run slower than real time; see bench_fleet.py).
TTFT is measured by the client, from the request's *scheduled* arrival to its first token, so time spent
queued in a router, or in a client that fell behind, counts against the policy it happened under.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from routing_figures import percentile

TESSERA_DEFAULT = "prefix_affinity"
BASELINE = "round_robin"
# vllm-router's rows are named "vllm-router:<its policy>".
VLLM_ROUTER_PREFIX = "vllm-router:"
SHARE_OF_IDEAL_GOAL = 0.9
P99_VS_ROUND_ROBIN_GOAL = 0.5


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's result as the client saw it."""

    ttft_s: float  # simulated, scheduled arrival -> first token
    done_s: float  # simulated, from the run's start to the last byte
    cached_tokens: int  # the engine's own count (the replica protocol's num_cached_tokens / OpenAI usage)
    prompt_tokens: int
    output_tokens: int
    ok: bool = True
    engine_id: str | None = None  # known for Tessera's policies (it chose)
    decision_us: float | None = None  # Tessera's Router.route, wall microseconds


@dataclass(frozen=True, slots=True)
class EngineStat:
    """One replica's /stats after a run."""

    engine_id: str
    busy_s: float  # simulated seconds in steps
    prompt_tokens: int  # prefix_queries: prompt tokens of the requests it finished
    cached_tokens: int  # prefix_hits
    num_preemptions: int


def imbalance(values: Sequence[float]) -> float:
    """max / mean (1.0 = perfectly even); NaN when there is nothing to spread."""
    if not values:
        return math.nan
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else math.nan


def summarize(outcomes: Sequence[Outcome], ideal_cached: int, engines: Sequence[EngineStat],
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One policy's row. Hit rate is the engines' own cached tokens over prompt tokens (their /stats, which
    every policy is measured by alike), against ``ideal_cached`` over the same prompts."""
    ok = [o for o in outcomes if o.ok]
    prompt_tokens = sum(e.prompt_tokens for e in engines)
    cached = sum(e.cached_tokens for e in engines)
    ttft = [o.ttft_s for o in ok]
    makespan_s = max((o.done_s for o in ok), default=0.0)
    decisions = [o.decision_us for o in ok if o.decision_us is not None]
    requests_by_engine: dict[str, int] = {}
    for o in ok:
        if o.engine_id is not None:
            requests_by_engine[o.engine_id] = requests_by_engine.get(o.engine_id, 0) + 1
    row: dict[str, Any] = {
        "num_requests": len(outcomes),
        "num_failed": len(outcomes) - len(ok),
        "hit_rate": cached / prompt_tokens if prompt_tokens else math.nan,
        "ideal_hit_rate": ideal_cached / prompt_tokens if prompt_tokens else math.nan,
        "share_of_ideal": cached / ideal_cached if ideal_cached else math.nan,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "throughput_rps": len(ok) / makespan_s if makespan_s > 0 else math.nan,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / makespan_s if makespan_s > 0 else math.nan,
        # Work per engine: simulated busy time (prefill-heavy engines weigh more) and prompt tokens served.
        "imbalance_busy": imbalance([e.busy_s for e in engines]),
        # How loaded the fleet was: the replicas' mean share of the run spent in steps (the arrivals' window
        # and the drain after it). The goals read differently at 10 % and at 80 % (docs/routing.md).
        "busy_share": (statistics.fmean(e.busy_s for e in engines) / makespan_s
                       if engines and makespan_s > 0 else math.nan),
        "imbalance_prompt_tokens": imbalance([float(e.prompt_tokens) for e in engines]),
        "preemptions": sum(e.num_preemptions for e in engines),
        "decision_p50_us": percentile(decisions, 50) if decisions else None,
        "decision_p99_us": percentile(decisions, 99) if decisions else None,
        "engines_used": len(requests_by_engine) if requests_by_engine else sum(1 for e in engines if e.prompt_tokens),
    }
    row.update(extra or {})
    return row


def _judge(value: float, limit: float, at_most: bool) -> bool | None:
    if math.isnan(value) or math.isnan(limit):
        return None
    return value <= limit if at_most else value >= limit


def goals(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, bool | None]:
    """Issue #17's goals at one fleet size; None where a row needed for the verdict is missing (a policy not
    run, or vllm-router not installed). "Ahead of vllm-router" means ahead of each of its policies run."""
    out: dict[str, bool | None] = {}
    pa, rr = rows.get(TESSERA_DEFAULT), rows.get(BASELINE)
    out["prefix_affinity_at_least_90pct_of_ideal"] = (
        _judge(pa["share_of_ideal"], SHARE_OF_IDEAL_GOAL, at_most=False) if pa else None)
    out["prefix_affinity_p99_at_most_half_round_robin"] = (
        _judge(pa["ttft_p99_ms"], P99_VS_ROUND_ROBIN_GOAL * rr["ttft_p99_ms"], at_most=True) if pa and rr else None)
    others = [row for name, row in rows.items() if name.startswith(VLLM_ROUTER_PREFIX)]
    if pa and others:
        out["prefix_affinity_hit_rate_ahead_of_vllm_router"] = all(pa["hit_rate"] > o["hit_rate"] for o in others)
        out["prefix_affinity_p99_ahead_of_vllm_router"] = all(pa["ttft_p99_ms"] < o["ttft_p99_ms"] for o in others)
    else:
        out["prefix_affinity_hit_rate_ahead_of_vllm_router"] = None
        out["prefix_affinity_p99_ahead_of_vllm_router"] = None
    return out


def table_rows(rows: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    """The printed table's rows for one size (bench/_support.print_table's cells)."""
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    def memory(r: Mapping[str, Any]) -> str:
        # Tessera: one worker's local index. vllm-router: its whole process (its index is not separable).
        if r.get("index_bytes") is not None:
            return f"{r['index_bytes'] / 2**20:.1f}"
        return f"rss {r['router_rss_bytes'] / 2**20:.0f}" if r.get("router_rss_bytes") else "-"

    out = []
    for name, r in rows.items():
        out.append([name, num(r["hit_rate"] * 100, ".1f"), num(r["share_of_ideal"] * 100, ".1f"),
                    num(r["ttft_p50_ms"], ".0f"), num(r["ttft_p99_ms"], ".0f"), num(r["throughput_rps"], ".1f"),
                    num(r["busy_share"] * 100, ".0f"), num(r["imbalance_busy"], ".2f"),
                    num(r["decision_p99_us"], ".0f"),
                    memory(r), num(r.get("event_lag_p99_ms"), ".1f"),
                    str(r["num_failed"])])
    return out


TABLE_HEADERS = ["policy", "hit %", "% of ideal", "TTFT p50 ms", "TTFT p99 ms", "req/s", "busy %", "busy max/mean",
                 "decision p99 us", "index MiB", "event lag p99 ms", "failed"]
