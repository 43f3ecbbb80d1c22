"""Metrics as pure functions over request records, exactly as ``shared/metrics.md`` defines them.

Versioned by ``METRICS_VERSION``: any change to a definition below bumps it, and every result file
carries it. Summary of the definitions (``docs/loadgen.md`` has the full text and the mapping to vLLM's
and GuideLLM's names):

- TTFT ``t_first - t_send`` (service view) and ``t_first - t_sched`` (user view).
- E2EL ``t_last - t_send`` and ``t_last - t_sched``.
- TPOT ``(t_last - t_first) / (n_out - 1)`` per request, only when ``n_out > 1``.
- ITL every gap between consecutive content chunks, pooled; the per-token view divides each gap by the
  tokens of the chunk that ends it and counts the result once per token.
- Throughput over the window first send -> last completion; goodput counts completed requests that meet
  every SLO set for them; attainment = good / all requests sent, so failures count as misses.
- Schedule lag ``t_send_first - t_sched`` (the first attempt; retries are server-induced waits).
- Prompt lengths: asked (``n_in_asked``) beside achieved (the server's ``n_in``) over completed requests
  that have both, and the share within ``PROMPT_LENGTH_TOLERANCE`` of the asked length.

Latency metrics use completed requests only; counts, errors, schedule lag and attainment use all.
Warm-up requests are excluded before any of this (``summarize_run``).
Percentiles: exact, linear interpolation over the raw samples (``numpy.percentile``'s default).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera_loadgen.records import N_OUT_FROM_CHUNKS, RequestRecord
from tessera_loadgen.workload import Slo, Workload

METRICS_VERSION = "1"
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)
CLIENT_LAG_LIMIT_S = 0.005
"""Schedule-lag p99 above this means the client itself was late: the run was client-bound."""

PROMPT_LENGTH_TOLERANCE = 0.02
"""A prompt is on length when the server's count is within this fraction of the asked one."""

LATENCY_METRICS = ("ttft_s", "ttft_user_s", "e2el_s", "e2el_user_s", "tpot_s", "itl_s", "itl_per_token_s")


@dataclass(frozen=True, slots=True)
class SloSpec:
    """The thresholds a request is judged by (``None``: not set)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None
    view: str = "user"

    @classmethod
    def from_config(cls, slo: Slo | None) -> SloSpec | None:
        if slo is None:
            return None
        return cls(slo.ttft_s, slo.tpot_s, slo.e2el_s, slo.view)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """What the metrics need from a workload: SLOs per (tenant, class) and target rates.

    ``target_rates`` maps ``(tenant, None)`` to a tenant's arrival rate and ``(tenant, class)`` to the
    class's expected share of it (single-turn classes only); closed-loop tenants have no target.
    """

    slos: Mapping[tuple[str, str], SloSpec | None] = field(default_factory=dict)
    target_rates: Mapping[tuple[str, str | None], float] = field(default_factory=dict)

    @classmethod
    def from_workload(cls, workload: Workload) -> MetricSpec:
        slos: dict[tuple[str, str], SloSpec | None] = {}
        targets: dict[tuple[str, str | None], float] = {}
        for tenant in workload.tenants:
            total_weight = sum(c.weight for c in tenant.classes)
            if tenant.arrival is not None:
                targets[(tenant.name, None)] = tenant.arrival.rate_rps
            for request_class in tenant.classes:
                slos[(tenant.name, request_class.name)] = SloSpec.from_config(tenant.slo_for(request_class))
                if tenant.arrival is not None and request_class.session is None:
                    share = request_class.weight / total_weight
                    targets[(tenant.name, request_class.name)] = tenant.arrival.rate_rps * share
        return cls(slos, targets)


# per-request metrics (None where undefined) ---------------------------------------------------------------
def ttft_s(r: RequestRecord) -> float | None:
    return None if r.t_first is None or r.t_send is None else r.t_first - r.t_send


def ttft_user_s(r: RequestRecord) -> float | None:
    return None if r.t_first is None else r.t_first - r.t_sched


def e2el_s(r: RequestRecord) -> float | None:
    return None if r.t_last is None or r.t_send is None else r.t_last - r.t_send


def e2el_user_s(r: RequestRecord) -> float | None:
    return None if r.t_last is None else r.t_last - r.t_sched


def tpot_s(r: RequestRecord) -> float | None:
    if r.t_first is None or r.t_last is None or r.n_out is None or r.n_out <= 1:
        return None
    return (r.t_last - r.t_first) / (r.n_out - 1)


def schedule_lag_s(r: RequestRecord) -> float | None:
    return None if r.t_send_first is None else r.t_send_first - r.t_sched


def itl_gaps(r: RequestRecord) -> list[tuple[float, float]]:
    """``(gap_s, tokens)`` for every content chunk after the first.

    ``tokens`` is the chunk's token count when the server reported it (a chunk reported with none counts
    as one), else the request's average ``n_out / num_chunks`` (an estimate, flagged in summaries).
    """
    times = r.chunk_times
    if len(times) < 2:
        return []
    counts = r.chunk_tokens
    if counts is not None and len(counts) == len(times):
        return [(times[i] - times[i - 1], float(max(1, counts[i]))) for i in range(1, len(times))]
    average = max(1.0, (r.n_out or len(times)) / len(times))
    return [(times[i] - times[i - 1], average) for i in range(1, len(times))]


def meets_slo(r: RequestRecord, slo: SloSpec | None) -> bool:
    """Completed and within every SLO that is set; a threshold that cannot apply (TTFT of a non-streamed
    request, TPOT when ``n_out <= 1``) is not held against the request."""
    if not r.ok:
        return False
    if slo is None:
        return True
    user = slo.view == "user"
    if slo.ttft_s is not None:
        ttft = ttft_user_s(r) if user else ttft_s(r)
        if ttft is not None and ttft > slo.ttft_s:
            return False
    if slo.tpot_s is not None:
        tpot = tpot_s(r)
        if tpot is not None and tpot > slo.tpot_s:
            return False
    if slo.e2el_s is not None:
        e2el = e2el_user_s(r) if user else e2el_s(r)
        if e2el is not None and e2el > slo.e2el_s:
            return False
    return True


# aggregation ----------------------------------------------------------------------------------------------
def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean, min, max and the exact percentiles of ``PERCENTILES`` (``None`` when empty)."""
    keys = ["mean", "min", "max", *(_pkey(p) for p in PERCENTILES)]
    if len(values) == 0:
        return {"count": 0, **dict.fromkeys(keys)}
    arr = np.asarray(values, dtype=float)
    quantiles = np.percentile(arr, PERCENTILES)
    out: dict[str, float | int | None] = {
        "count": len(arr),
        "mean": float(arr.mean()),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }
    out.update({_pkey(p): float(q) for p, q in zip(PERCENTILES, quantiles, strict=True)})
    return out


def _pkey(p: float) -> str:
    return f"p{p:g}"


def _defined(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def prompt_lengths(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Asked against achieved prompt tokens, over completed requests that have both."""
    pairs = [(r.n_in_asked, r.n_in) for r in records if r.ok and r.n_in_asked is not None and r.n_in is not None]
    on_length = sum(1 for asked, achieved in pairs if abs(achieved - asked) <= PROMPT_LENGTH_TOLERANCE * asked)
    return {
        "num_compared": len(pairs),
        "asked": distribution([asked for asked, _ in pairs]),
        "achieved": distribution([achieved for _, achieved in pairs]),
        "share_within_tolerance": on_length / len(pairs) if pairs else None,
        "tolerance": PROMPT_LENGTH_TOLERANCE,
    }


def summarize(
    records: Sequence[RequestRecord],
    slos: Mapping[tuple[str, str], SloSpec | None] | None = None,
    target_rate_rps: float | None = None,
) -> dict[str, Any]:
    """Every metric of one group of (non-warm-up) records."""
    slos = slos or {}
    completed = [r for r in records if r.ok]
    sent = [r for r in records if r.t_send_first is not None]
    errors = Counter(r.error_kind for r in records if not r.ok)

    window_start = min((r.t_send_first for r in sent if r.t_send_first is not None), default=None)
    window_end = max((r.t_done for r in completed if r.t_done is not None), default=None)
    window_s = (
        window_end - window_start
        if window_start is not None and window_end is not None and window_end > window_start
        else None
    )
    num_good = sum(1 for r in completed if meets_slo(r, slos.get((r.tenant, r.request_class))))
    out_tokens = sum(r.n_out or 0 for r in completed)
    in_tokens = sum(r.n_in or 0 for r in completed)

    gaps = [g for r in completed for g in itl_gaps(r)]
    per_token = [gap / tokens for gap, tokens in gaps for _ in range(_repeats(tokens))]
    lags = _defined(schedule_lag_s(r) for r in records)
    lag = distribution(lags)
    lag_p99 = lag["p99"]
    sched = sorted(r.t_sched for r in records)
    sends = sorted(r.t_send_first for r in sent if r.t_send_first is not None)

    def per_second(count: float) -> float | None:
        return count / window_s if window_s else None

    request_throughput = per_second(len(completed))
    return {
        "num_requests": len(records),
        "num_sent": len(sent),
        "num_completed": len(completed),
        "num_failed": len(records) - len(completed),
        "errors": dict(sorted((str(k), v) for k, v in errors.items())),
        "rejections_429": {
            "num_responses": sum(r.num_429 for r in records),
            "num_with_retry_after": sum(r.num_429_retry_after for r in records),
            "num_without_retry_after": sum(r.num_429 - r.num_429_retry_after for r in records),
            "num_requests_retried": sum(1 for r in records if r.num_429 and r.ok),
            "num_requests_rejected": errors.get("http_429", 0),
            "retry_wait_s_total": sum(r.retry_wait_s for r in records),
        },
        "window": {"start_s": window_start, "end_s": window_end, "duration_s": window_s},
        "target_rate_rps": target_rate_rps,
        "offered_rate_rps": _rate(sched),
        "send_rate_rps": _rate(sends),
        "achieved_rate_rps": request_throughput,
        "request_throughput_rps": request_throughput,
        "output_throughput_tps": per_second(out_tokens),
        "input_throughput_tps": per_second(in_tokens),
        "num_good": num_good,
        "goodput_rps": per_second(num_good),
        "slo_attainment": num_good / len(records) if records else None,
        "latency": {
            "ttft_s": distribution(_defined(ttft_s(r) for r in completed)),
            "ttft_user_s": distribution(_defined(ttft_user_s(r) for r in completed)),
            "e2el_s": distribution(_defined(e2el_s(r) for r in completed)),
            "e2el_user_s": distribution(_defined(e2el_user_s(r) for r in completed)),
            "tpot_s": distribution(_defined(tpot_s(r) for r in completed)),
            "itl_s": distribution([gap for gap, _ in gaps]),
            "itl_per_token_s": distribution(per_token),
        },
        "schedule_lag_s": lag,
        "client_lagging": lag_p99 is not None and float(lag_p99) > CLIENT_LAG_LIMIT_S,
        "tokens": {
            "n_in": distribution(_defined(r.n_in for r in completed)),
            "n_out": distribution(_defined(r.n_out for r in completed)),
            "num_n_out_client_counted": sum(1 for r in completed if r.n_out_source == N_OUT_FROM_CHUNKS),
            "num_chunk_tokens_estimated": sum(
                1 for r in completed if r.chunk_tokens is None and len(r.chunk_times) > 1
            ),
        },
        "prompt_tokens": prompt_lengths(completed),
    }


def _repeats(tokens: float) -> int:
    """Per-token view: a gap closing a chunk of ``k`` known tokens stands for ``k`` tokens."""
    return int(tokens) if float(tokens).is_integer() else 1


def _rate(times: Sequence[float]) -> float | None:
    """Events per second over a sorted series: ``(n - 1) / span``, exact for evenly spaced events."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def summarize_run(records: Sequence[RequestRecord], spec: MetricSpec | None = None) -> dict[str, Any]:
    """Overall, per tenant and per tenant x class summaries of the measured (non-warm-up) records."""
    spec = spec or MetricSpec()
    measured = [r for r in records if not r.warmup]
    by_tenant: dict[str, list[RequestRecord]] = {}
    for r in measured:
        by_tenant.setdefault(r.tenant, []).append(r)
    tenant_targets = [v for (_, c), v in spec.target_rates.items() if c is None]
    tenants: dict[str, Any] = {}
    for tenant in sorted(by_tenant):
        rows = by_tenant[tenant]
        by_class: dict[str, list[RequestRecord]] = {}
        for r in rows:
            by_class.setdefault(r.request_class, []).append(r)
        summary = summarize(rows, spec.slos, spec.target_rates.get((tenant, None)))
        summary["classes"] = {
            name: summarize(by_class[name], spec.slos, spec.target_rates.get((tenant, name)))
            for name in sorted(by_class)
        }
        tenants[tenant] = summary
    return {
        "overall": summarize(measured, spec.slos, sum(tenant_targets) if tenant_targets else None),
        "tenants": tenants,
    }
