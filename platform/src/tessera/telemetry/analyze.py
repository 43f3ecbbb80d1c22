"""``tessera traces analyze``: which requests are in the tail, and why.

1. Load every span of a run directory (or one JSONL file) and rebuild request timelines (timeline.py).
2. Select the requests at or above the ``percentile`` of TTFT or E2E — per tenant by default (each tenant's
   own tail: a victim's p99 is not the noisy tenant's p99), or over all requests with ``scope="all"``.
3. Compare each selected request with its tenant's typical request (medians of the tenant's requests below
   the threshold) and attribute the excess to causes from the evidence in the spans (causes.py).
4. Give every cause its evidence in numbers (explain.py): the engine's typical prefill time for the prompt's
   length, the queues at the gateway and the engine, the other tenants' work where the request waited, the
   evictions of its prefix and who caused them; name the other tenant the evidence points at (the culprit).
5. Tabulate per cause and per tenant; the JSON form has every selected request with its shares and evidence.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tessera.telemetry.causes import (
    CAUSES,
    UNEXPLAINED,
    Attribution,
    Baseline,
    EvictionIndex,
    Phases,
    attribute,
    phases_of,
)
from tessera.telemetry.explain import RunContext, explain
from tessera.telemetry.occupancy import EngineLoad, GatewayLoad
from tessera.telemetry.prefill_curve import PrefillCurves
from tessera.telemetry.spanfile import SpanRecord, load_spans
from tessera.telemetry.timeline import RequestTimeline, build_evictions, build_timelines

Metric = Literal["ttft", "e2e"]
Scope = Literal["tenant", "all"]
MIN_BASELINE_REQUESTS = 3
MIN_SHOWN_S = 0.001  # the text report leaves out secondary causes with a smaller excess


@dataclass(frozen=True, slots=True)
class AnalysisOptions:
    percentile: float = 99.0
    metric: Metric = "ttft"
    scope: Scope = "tenant"

    def __post_init__(self) -> None:
        if not 0.0 <= self.percentile <= 100.0:
            raise ValueError(f"percentile={self.percentile} must be within [0, 100]")
        if self.metric not in ("ttft", "e2e"):
            raise ValueError(f"unknown metric {self.metric!r}; valid: ttft, e2e")
        if self.scope not in ("tenant", "all"):
            raise ValueError(f"unknown scope {self.scope!r}; valid: tenant, all")


@dataclass(slots=True)
class Report:
    options: AnalysisOptions
    num_spans: int
    num_requests: int
    num_without_token: int
    num_evictions: int
    thresholds_s: dict[str, float]
    attributions: list[Attribution] = field(default_factory=list)

    def by_cause(self) -> list[dict[str, Any]]:
        primary = Counter(a.primary for a in self.attributions)
        kinds: dict[str, Counter[str]] = defaultdict(Counter)
        seconds: dict[str, float] = defaultdict(float)
        for a in self.attributions:
            for cause, value in a.causes.items():
                seconds[cause] += value
            if a.primary in a.evidence:
                kinds[a.primary][a.evidence[a.primary].kind] += 1
        total = len(self.attributions) or 1
        rows = []
        for cause in (*CAUSES, UNEXPLAINED):
            if primary.get(cause) or seconds.get(cause):
                rows.append({"cause": cause, "requests": primary.get(cause, 0),
                             "share": primary.get(cause, 0) / total, "excess_s": seconds.get(cause, 0.0),
                             "kinds": dict(kinds[cause].most_common())})
        return sorted(rows, key=lambda r: (-r["requests"], -r["excess_s"]))

    def by_tenant(self) -> list[dict[str, Any]]:
        rows = []
        grouped: dict[str, list[Attribution]] = defaultdict(list)
        for a in self.attributions:
            grouped[a.timeline.tenant].append(a)
        for tenant in sorted(grouped):
            selected = grouped[tenant]
            causes = Counter(a.primary for a in selected)
            top, top_n = causes.most_common(1)[0]
            culprits = Counter(a.culprit for a in selected if a.culprit)
            culprit, culprit_n = culprits.most_common(1)[0] if culprits else ("", 0)
            rows.append({"tenant": tenant, "selected": len(selected),
                         "threshold_s": self.thresholds_s.get(tenant, self.thresholds_s.get("*", 0.0)),
                         "max_s": max(a.metric_s for a in selected), "top_cause": top,
                         "top_cause_share": top_n / len(selected), "causes": dict(causes),
                         "culprit": culprit or None, "culprit_share": culprit_n / len(selected),
                         "culprits": dict(culprits.most_common())})
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": {"percentile": self.options.percentile, "metric": self.options.metric,
                        "scope": self.options.scope},
            "num_spans": self.num_spans, "num_requests": self.num_requests,
            "num_without_token": self.num_without_token, "num_evictions": self.num_evictions,
            "thresholds_s": self.thresholds_s, "by_cause": self.by_cause(), "by_tenant": self.by_tenant(),
            "requests": [
                {"request_id": a.timeline.request_id, "trace_id": a.timeline.trace_id, "tenant": a.timeline.tenant,
                 "engine": a.timeline.engine, f"{self.options.metric}_s": a.metric_s, "primary_cause": a.primary,
                 "culprit": a.culprit or None, "causes_s": {k: round(v, 6) for k, v in a.causes.items()},
                 "phases": _phases_dict(a.phases),
                 "evidence": {cause: e.to_dict() for cause, e in a.evidence.items()}}
                for a in sorted(self.attributions, key=lambda a: -a.metric_s)
            ],
        }


def _phases_dict(p: Phases) -> dict[str, Any]:
    seconds = {"gateway_s": p.gateway_s, "admission_s": p.admission_s, "queue_s": p.queue_s, "prefill_s": p.prefill_s,
               "decode_s": p.decode_s, "retry_s": p.retry_s}
    return {**{k: round(v, 6) for k, v in seconds.items()}, "prompt_tokens": p.prompt_tokens,
            "cached_tokens": p.cached_tokens, "output_tokens": p.output_tokens, "steps": p.steps}


def analyze(paths: Iterable[Path], options: AnalysisOptions | None = None) -> Report:
    return analyze_spans(load_spans(paths), options or AnalysisOptions())


def analyze_spans(spans: Sequence[SpanRecord], options: AnalysisOptions) -> Report:
    timelines = build_timelines(spans)
    evictions = build_evictions(spans)
    served = [t for t in timelines if t.metric(options.metric) is not None and phases_of(t) is not None]
    groups: dict[str, list[RequestTimeline]] = defaultdict(list)
    for t in served:
        groups[t.tenant if options.scope == "tenant" else "*"].append(t)
    thresholds: dict[str, float] = {}
    selected: list[RequestTimeline] = []
    rest: dict[str, list[RequestTimeline]] = defaultdict(list)
    for key, members in groups.items():
        values = np.asarray([t.metric(options.metric) for t in members], dtype=float)
        threshold = float(np.percentile(values, options.percentile))
        thresholds[key] = threshold
        for t in members:
            value = t.metric(options.metric)
            assert value is not None
            (selected if value >= threshold else rest[t.tenant]).append(t)
    baselines = _baselines(rest, served)
    index = EvictionIndex(evictions)
    previous = _previous_arrivals(served)
    run = RunContext(EngineLoad(timelines), GatewayLoad(timelines), _prefill_curves(rest, served))
    report = Report(options, len(spans), len(served), len(timelines) - len(served), len(evictions), thresholds)
    for t in selected:
        baseline = baselines.get(t.tenant, baselines["*"])
        attribution = attribute(t, options.metric, baseline, index, previous.get(t.span_id))
        if attribution is not None:
            report.attributions.append(dataclasses.replace(attribution, evidence=explain(attribution, baseline, run)))
    return report


def _prefill_curves(rest: dict[str, list[RequestTimeline]], served: Sequence[RequestTimeline]) -> PrefillCurves:
    """Every engine's typical prefill per length, from the requests below the thresholds (like the baselines:
    the tail itself is not its own reference)."""
    reference = [t for ts in rest.values() for t in ts] or list(served)
    phases = (phases_of(t) for t in reference)
    return PrefillCurves((p.engine, p.computed_tokens, p.prefill_s) for p in phases if p is not None)


def _baselines(rest: dict[str, list[RequestTimeline]], served: Sequence[RequestTimeline]) -> dict[str, Baseline]:
    def phases(ts: Iterable[RequestTimeline]) -> list[Any]:
        return [p for p in (phases_of(t) for t in ts) if p is not None]

    everyone_else = [t for ts in rest.values() for t in ts] or list(served)
    out = {"*": Baseline.of(phases(everyone_else))}
    for tenant, members in rest.items():
        if len(members) >= MIN_BASELINE_REQUESTS:
            out[tenant] = Baseline.of(phases(members))
    return out


def _previous_arrivals(served: Sequence[RequestTimeline]) -> dict[str, int]:
    """For each request: when the previous request with the same prefix arrived at the same engine."""
    keyed: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    for t in served:
        attempt = next((a for a in t.attempts if a.first_token_ns), None)
        if attempt is not None and t.prefix_root:
            keyed[(attempt.engine, t.prefix_root)].append((attempt.arrival_ns, t.span_id))
    previous: dict[str, int] = {}
    for rows in keyed.values():
        rows.sort()
        for (before, _), (_, span_id) in itertools.pairwise(rows):
            previous[span_id] = before
    return previous


def render(report: Report, num_slowest: int = 10) -> str:
    """Plain-text tables: per cause, per tenant, and the slowest selected requests with their evidence."""
    o = report.options
    lines = [f"{report.num_requests} requests ({report.num_without_token} without a first token), "
             f"{report.num_evictions} eviction records; {len(report.attributions)} at or above "
             f"p{o.percentile:g} of {o.metric.upper()} ({'per tenant' if o.scope == 'tenant' else 'all requests'})",
             ""]
    cause_rows = [[r["cause"], r["requests"], f"{r['share']:.0%}", f"{r['excess_s']:.3f}",
                   ", ".join(f"{k} {n}" for k, n in r["kinds"].items())] for r in report.by_cause()]
    lines += _table(["cause", "requests", "share", "excess_s", "kinds"], cause_rows)
    lines.append("")
    lines += _table(["tenant", "selected", f"p{o.percentile:g}_s", "max_s", "top cause", "share", "culprit"],
                    [[r["tenant"], r["selected"], f"{r['threshold_s']:.3f}", f"{r['max_s']:.3f}", r["top_cause"],
                      f"{r['top_cause_share']:.0%}",
                      f"{r['culprit']} ({r['culprit_share']:.0%})" if r["culprit"] else "-"]
                     for r in report.by_tenant()])
    lines.append("")
    slowest = sorted(report.attributions, key=lambda a: -a.metric_s)[:num_slowest]
    lines += _table(["request", "tenant", "engine", f"{o.metric}_s", "primary cause", "culprit", "evidence"],
                    [[a.timeline.request_id, a.timeline.tenant, a.timeline.engine, f"{a.metric_s:.3f}", a.primary,
                      a.culprit or "-", _clip(a.evidence[a.primary].summary if a.primary in a.evidence else "", 100)]
                     for a in slowest])
    if slowest:
        lines += ["", f"evidence of the {len(slowest)} slowest (every cause, largest share first):"]
    for a in slowest:
        lines.append(f"  {a.timeline.request_id} ({a.timeline.tenant}, {a.timeline.engine}, "
                     f"{o.metric} {a.metric_s:.3f} s)")
        for cause in sorted(a.evidence, key=lambda c: -a.causes.get(c, 0.0)):
            if cause != a.primary and a.causes.get(cause, 0.0) < MIN_SHOWN_S:
                continue  # in the JSON; in the text it would bury the causes that matter
            e = a.evidence[cause]
            named = f" [culprit: {e.culprit}]" if e.culprit else ""
            lines.append(f"    {cause} +{a.causes.get(cause, 0.0):.3f} s ({e.kind}){named}: {e.summary}")
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    if not cells:
        out.append("(none)")
    return out
