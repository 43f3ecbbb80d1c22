"""The soak's goals, judged from its windows (pure: no process, no Redis).

A window is what the soak sampled at its end (RSS, Redis keys and memory, connections) and the TTFT
percentiles of the requests scheduled in it. The goals (issue #16):

- ``ttft_p99``: no window's p99 TTFT above ``P99_RATIO_LIMIT`` times the first window's, over all requests;
- ``ttft_p95[tenant]``: the same limit per tenant, on its p95. A tenant's window holds ~410 requests at the
  default rate, so its p99 is its 4th-5th slowest: drawn from the run's own TTFTs pooled (a run flat by
  construction), that ratio exceeds 1.2 in 26-31 % of trials per tenant, and three tenants fail together
  about 60 % of the time on a platform that does not change (longrun/sampling_noise.py, run R). A rule a
  flat run fails more often than it passes cannot tell drift from noise; the p95 (its ~20th slowest) fails
  a flat run 0-1 % of the time and still moves with a tenant whose requests slow down. Each tenant's p99
  ratio stays in the report as a reading (``readings``), with how often a flat run exceeds it;
- ``rss_growth``: the gateway's and the engine's RSS at the end at most ``RSS_GROWTH_LIMIT`` above their RSS
  at the end of the first window (the first window is the warm-up: allocators, caches and pools fill then);
- ``redis_keys_bounded``: once the run is past ``KEY_SETTLE_S`` (every per-request key has expired at least
  once by then), no later window holds more than ``KEY_GROWTH_LIMIT`` more keys than the first such window.
  A run shorter than that cannot show a bound: that goal is then ``None`` (not judged), never a pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

P99_RATIO_LIMIT = 1.2
RSS_GROWTH_LIMIT = 0.05
KEY_GROWTH_LIMIT = 0.10
KEY_SLACK = 50  # a few tenants' period keys may appear at an hour's or a day's turn
# NOTE: the longest-lived keys written per request: the engines' usage records (engine_usage_record_ttl_s,
# 900 s) and the finish markers (FINISH_MARKER_TTL_S, 600 s). Before 900 s the key count must still grow.
KEY_SETTLE_S = 900.0


@dataclass(frozen=True, slots=True)
class Window:
    """One window of the soak: its requests are those scheduled in it; ``end_s``, seconds from the start of the
    load, is when its sample (RSS, keys, ...) was taken: the window's end, or a quiet moment of its last minute
    (longrun/quiet_sample.py), so the key bound counts a window as settled only once its sample is."""

    index: int
    end_s: float
    gateway_rss_bytes: int
    engine_rss_bytes: int
    redis_keys: int
    redis_used_memory_bytes: int
    redis_clients: int
    gateway_sockets: int
    num_requests: int
    num_failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    tenant_ttft_p99_s: dict[str, float] = field(default_factory=dict)
    tenant_ttft_p95_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Verdict:
    goal: str
    passed: bool | None  # None: the run cannot judge this goal (too short, no data)
    detail: str


def _ratio_verdict(goal: str, series: list[float]) -> Verdict:
    known = [v for v in series if not math.isnan(v)]
    if len(series) < 2 or math.isnan(series[0]) or len(known) < 2:
        return Verdict(goal, None, "fewer than two windows with a p99")
    first = series[0]
    worst = max(known[1:])
    ratio = worst / first if first > 0 else math.inf
    return Verdict(goal, ratio <= P99_RATIO_LIMIT,
                   f"worst window {worst * 1000:.1f} ms = {ratio:.2f}x the first's {first * 1000:.1f} ms "
                   f"(limit {P99_RATIO_LIMIT}x)")


def _rss_verdict(goal: str, series: list[int]) -> Verdict:
    if len(series) < 2 or series[0] <= 0:
        return Verdict(goal, None, "fewer than two windows")
    growth = series[-1] / series[0] - 1
    return Verdict(goal, growth < RSS_GROWTH_LIMIT,
                   f"{series[0] / 2**20:.1f} MiB after the first window -> {series[-1] / 2**20:.1f} MiB at the end "
                   f"({growth:+.1%}; limit +{RSS_GROWTH_LIMIT:.0%})")


def _keys_verdict(windows: list[Window]) -> Verdict:
    settled = [w for w in windows if w.end_s >= KEY_SETTLE_S]
    if len(settled) < 2:
        counts = ", ".join(str(w.redis_keys) for w in windows)
        return Verdict("redis_keys_bounded", None,
                       f"not judged: needs two windows ending after {KEY_SETTLE_S:.0f} s (the per-request keys' "
                       f"TTL); counts per window: {counts}")
    reference = settled[0].redis_keys
    limit = reference * (1 + KEY_GROWTH_LIMIT) + KEY_SLACK
    worst = max(w.redis_keys for w in settled[1:])
    return Verdict("redis_keys_bounded", worst <= limit,
                   f"{reference} keys at {settled[0].end_s:.0f} s, at most {worst} after (limit {limit:.0f})")


def _tenants(windows: list[Window]) -> list[str]:
    return sorted({t for w in windows for t in (*w.tenant_ttft_p99_s, *w.tenant_ttft_p95_s)})


def judge(windows: list[Window]) -> list[Verdict]:
    """Every goal's verdict, in a fixed order: overall p99, each tenant's p95, gateway RSS, engine RSS, keys."""
    verdicts = [_ratio_verdict("ttft_p99", [w.ttft_p99_s for w in windows])]
    verdicts += [_ratio_verdict(f"ttft_p95[{t}]", [w.tenant_ttft_p95_s.get(t, math.nan) for w in windows])
                 for t in _tenants(windows)]
    verdicts.append(_rss_verdict("gateway_rss_growth", [w.gateway_rss_bytes for w in windows]))
    verdicts.append(_rss_verdict("engine_rss_growth", [w.engine_rss_bytes for w in windows]))
    verdicts.append(_keys_verdict(windows))
    return verdicts


def readings(windows: list[Window]) -> list[Verdict]:
    """Each tenant's p99 ratio, judged against the same limit but not a goal (the module's docstring: a flat run
    exceeds it about as often as not); printed beside the flat-run figure so a slow tenant still shows."""
    return [_ratio_verdict(f"ttft_p99[{t}]", [w.tenant_ttft_p99_s.get(t, math.nan) for w in windows])
            for t in _tenants(windows)]


def verdict_word(passed: bool | None) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def window_row(w: Window) -> list[Any]:
    return [w.index, f"{w.end_s:.0f}", w.num_requests, w.num_failed, f"{w.ttft_p50_s * 1000:.1f}",
            f"{w.ttft_p99_s * 1000:.1f}", f"{w.gateway_rss_bytes / 2**20:.1f}", f"{w.engine_rss_bytes / 2**20:.1f}",
            w.redis_keys, f"{w.redis_used_memory_bytes / 2**20:.2f}", w.redis_clients, w.gateway_sockets]


WINDOW_HEADERS = ["win", "sampled at s", "reqs", "fail", "TTFT p50 ms", "p99 ms", "gw RSS MiB", "engine RSS MiB",
                  "redis keys", "redis MiB", "redis clients", "gw sockets"]
