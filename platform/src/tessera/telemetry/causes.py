"""Why one request was slow: its latency split into phases, each phase's excess over the tenant's typical
request (the baseline) attributed to a cause by the evidence in the spans. Pure functions.

Phases (wall-clock, from the gateway's and the engine's spans):

  gateway         request start → admission start, admission end → engine arrival, engine first token →
                  gateway first token                                   → ``gateway_queueing``
  admission       the ``admission`` span                                → ``admission_wait``
  engine queue    engine arrival → first scheduled                      → ``engine_queueing``
  prefill         first scheduled → first token; its excess goes to
                  ``prefill_recompute_after_eviction`` when the controller saw this engine evict blocks of
                  this request's prefix chain (same root, depths the request then had to recompute) after
                  the previous request of that prefix arrived there and before this one was scheduled (vLLM
                  looks the prefix up when it schedules a request, so an eviction while it waited in the
                  queue counts); else ``preemption`` when the engine preempted the request; else
                  ``slow_prefill``
  decode (e2e)    first token → finished; excess over the baseline time per token: first the extra steps
                  spent because fewer drafts were accepted than usual (``speculative_rejection``), the rest
                  ``preemption`` when preempted, else ``slow_decode``
  retries         time on an engine that aborted the request (the controller's last resort) and the
                  continuation's queue and prefill on the next engine    → ``preemption``

The primary cause is the one with the largest share; ``unexplained`` when no phase exceeds its baseline.
This module decides; the numbers that let a person check each decision are explain.py's.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tessera.telemetry.evidence import Evidence
from tessera.telemetry.timeline import EngineAttempt, EvictionRecord, RequestTimeline

CAUSES = (
    "gateway_queueing", "admission_wait", "engine_queueing", "prefill_recompute_after_eviction", "preemption",
    "slow_prefill", "slow_decode", "speculative_rejection",
)
UNEXPLAINED = "unexplained"


def _s(ns: int) -> float:
    return ns / 1e9


@dataclass(frozen=True, slots=True)
class Phases:
    gateway_s: float = 0.0
    admission_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    retry_s: float = 0.0
    output_tokens: int = 0
    steps: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    # Of gateway_s: engine first token → gateway first token (the relay back through the gateway).
    gateway_relay_s: float = 0.0
    # The attempt that produced the first token: where the queue and prefill were.
    engine: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


def first_token_attempt(t: RequestTimeline) -> EngineAttempt | None:
    return next((a for a in t.attempts if a.first_token_ns), None)


def phases_of(t: RequestTimeline) -> Phases | None:
    """The request's phases; None when it produced no token (rejected or failed)."""
    attempt = first_token_attempt(t)
    if attempt is None or attempt.first_token_ns is None or t.first_token_ns is None:
        return None
    first_arrival = t.attempts[0].arrival_ns
    if t.admission_ns is not None:
        gateway_ns = (t.admission_ns[0] - t.start_ns) + (first_arrival - t.admission_ns[1])
        admission_ns = t.admission_ns[1] - t.admission_ns[0]
    else:
        gateway_ns, admission_ns = first_arrival - t.start_ns, 0
    relay_ns = max(0, t.first_token_ns - attempt.first_token_ns)
    gateway_ns += relay_ns
    scheduled = attempt.scheduled_ns or attempt.arrival_ns
    # Engines that aborted the request before its first token: all their time is lost to the abort.
    retry_ns = max(0, attempt.arrival_ns - first_arrival)
    decode_ns, steps, accepted, drafted, outputs = 0, 0, 0, 0, 0
    later = False
    for a in t.attempts:
        if a is attempt:
            later = True
        if not later or a.first_token_ns is None:
            continue
        if a is not attempt:  # a continuation: its queue and prefill redo work the abort threw away
            retry_ns += max(0, a.first_token_ns - a.arrival_ns)
        decode_ns += max(0, (a.finished_ns or a.end_ns) - a.first_token_ns)
        steps += a.steps
        accepted += a.spec_accepted_tokens
        drafted += a.spec_draft_tokens
        outputs += a.output_tokens
    return Phases(
        gateway_s=max(0.0, _s(gateway_ns)), admission_s=max(0.0, _s(admission_ns)),
        queue_s=max(0.0, _s(scheduled - attempt.arrival_ns)),
        prefill_s=max(0.0, _s(attempt.first_token_ns - scheduled)), decode_s=_s(decode_ns), retry_s=_s(retry_ns),
        output_tokens=outputs, steps=steps, spec_accepted_tokens=accepted, spec_draft_tokens=drafted,
        gateway_relay_s=_s(relay_ns), engine=attempt.engine, prompt_tokens=attempt.prompt_tokens,
        cached_tokens=attempt.cached_tokens,
    )


@dataclass(frozen=True, slots=True)
class Baseline:
    """The typical request (medians): what a phase "should" take for this tenant."""

    gateway_s: float = 0.0
    admission_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s_per_token: float = 0.0
    tokens_per_step: float = 1.0
    step_s: float = 0.0
    cached_tokens: float = 0.0
    computed_tokens: float = 0.0
    num_requests: int = 0

    @classmethod
    def of(cls, phases: Sequence[Phases]) -> Baseline:
        if not phases:
            return cls()

        def med(values: Iterable[float]) -> float:
            values = list(values)
            return float(statistics.median(values)) if values else 0.0

        decoding = [p for p in phases if p.output_tokens > 1 and p.steps > 0]
        return cls(
            gateway_s=med(p.gateway_s for p in phases), admission_s=med(p.admission_s for p in phases),
            queue_s=med(p.queue_s for p in phases), prefill_s=med(p.prefill_s for p in phases),
            decode_s_per_token=med(p.decode_s / (p.output_tokens - 1) for p in decoding),
            tokens_per_step=med(p.output_tokens / p.steps for p in decoding) or 1.0,
            step_s=med(p.decode_s / p.steps for p in decoding),
            cached_tokens=med(p.cached_tokens for p in phases), computed_tokens=med(p.computed_tokens for p in phases),
            num_requests=len(phases),
        )


class EvictionIndex:
    """Evictions by (engine, prefix root), in time order."""

    def __init__(self, records: Iterable[EvictionRecord]) -> None:
        self._by_key: dict[tuple[str, str], list[EvictionRecord]] = defaultdict(list)
        for record in sorted(records, key=lambda r: r.ts_ns):
            self._by_key[(record.engine, record.prefix_root)].append(record)
        self._ts = {key: [r.ts_ns for r in rows] for key, rows in self._by_key.items()}
        self.block_size = {engine: rows[0].block_size for (engine, _), rows in self._by_key.items()}

    def lost(self, engine: str, prefix_root: str, after_ns: int, before_ns: int, depth_lo: int,
             depth_hi: int) -> list[EvictionRecord]:
        """Evictions of blocks at depths [depth_lo, depth_hi) of that chain, in (after_ns, before_ns)."""
        key = (engine, prefix_root)
        rows = self._by_key.get(key)
        if not rows or depth_lo >= depth_hi:
            return []
        start = bisect_left(self._ts[key], after_ns + 1)
        return [r for r in rows[start:] if r.ts_ns < before_ns and r.depth_max >= depth_lo and r.depth_min < depth_hi]


@dataclass(frozen=True, slots=True)
class Attribution:
    timeline: RequestTimeline
    metric_s: float
    causes: dict[str, float]
    primary: str
    phases: Phases = field(default_factory=Phases)
    # The controller's evictions that explain a prefix miss (the prefill_recompute_after_eviction decision).
    lost_prefix: tuple[EvictionRecord, ...] = ()
    # Arrival of the previous request with this prefix on this engine (None: none in the trace).
    prefix_since_ns: int | None = None
    evidence: dict[str, Evidence] = field(default_factory=dict)

    @property
    def culprit(self) -> str:
        """The other tenant behind at least half of this request's excess seconds, by the evidence of each
        cause (its ``culprit``); "" when no tenant is."""
        seconds: dict[str, float] = defaultdict(float)
        for cause, evidence in self.evidence.items():
            if evidence.culprit:
                seconds[evidence.culprit] += self.causes.get(cause, 0.0)
        total = sum(self.causes.values())
        if not seconds or total <= 0:
            return ""
        top = max(seconds, key=lambda k: seconds[k])
        return top if seconds[top] >= 0.5 * total else ""


def attribute(t: RequestTimeline, metric: str, baseline: Baseline, evictions: EvictionIndex,
              since_ns: int | None) -> Attribution | None:
    """Splits one request's latency into causes (see the module docstring). ``since_ns``: arrival of the
    previous request with the same prefix on the same engine (None: none in the trace)."""
    value = t.metric(metric)
    phases = phases_of(t)
    if value is None or phases is None:
        return None
    causes: dict[str, float] = defaultdict(float)
    causes["gateway_queueing"] += max(0.0, phases.gateway_s - baseline.gateway_s)
    causes["admission_wait"] += max(0.0, phases.admission_s - baseline.admission_s)
    causes["engine_queueing"] += max(0.0, phases.queue_s - baseline.queue_s)
    if phases.retry_s > 0:
        causes["preemption"] += phases.retry_s
    attempt = first_token_attempt(t)
    assert attempt is not None
    prefill_excess = max(0.0, phases.prefill_s - baseline.prefill_s)
    lost: list[EvictionRecord] = []
    if prefill_excess > 0:
        lost = _lost_prefix(t, attempt, evictions, since_ns)
        if lost:
            causes["prefill_recompute_after_eviction"] += prefill_excess
        elif attempt.preemptions:
            causes["preemption"] += prefill_excess
        else:
            causes["slow_prefill"] += prefill_excess
    if metric == "e2e" and phases.output_tokens > 1:
        expected = baseline.decode_s_per_token * (phases.output_tokens - 1)
        excess = max(0.0, phases.decode_s - expected)
        spec = min(excess, max(0.0, extra_steps(phases, baseline)) * baseline.step_s)
        if spec > 0:
            causes["speculative_rejection"] += spec
        if excess - spec > 0:
            preempted = any(a.preemptions for a in t.attempts)
            causes["preemption" if preempted else "slow_decode"] += excess - spec
    causes = {k: v for k, v in causes.items() if v > 0}
    primary = max(causes, key=lambda k: causes[k]) if causes else UNEXPLAINED
    return Attribution(t, value, dict(causes), primary, phases, tuple(lost), since_ns)


def extra_steps(phases: Phases, baseline: Baseline) -> float:
    """Decode steps beyond what the tenant's usual tokens per step (accepted drafts) would have needed."""
    return phases.steps - phases.output_tokens / max(baseline.tokens_per_step, 1e-9)


def _lost_prefix(t: RequestTimeline, attempt: EngineAttempt, evictions: EvictionIndex,
                 since_ns: int | None) -> list[EvictionRecord]:
    if not t.prefix_root or not t.prompt_blocks:
        return []
    block_size = evictions.block_size.get(attempt.engine, 0)
    if block_size <= 0:
        return []
    cached_blocks = attempt.cached_tokens // block_size
    return evictions.lost(attempt.engine, t.prefix_root, since_ns if since_ns is not None else -1,
                          attempt.scheduled_ns or attempt.arrival_ns, cached_blocks, t.prompt_blocks)
