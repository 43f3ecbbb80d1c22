"""Evidence for the prefill's causes: ``slow_prefill`` and ``prefill_recompute_after_eviction``.

The numbers: the tokens the engine computed (prompt minus cached) and the time it took, against the engine's
typical time for that length (prefill_curve.py) and the tenant's typical request; the other tenants' work in
the batch during the prefill; for a recompute, the controller's evictions of the prefix, who caused them, and
what the engine computed since the previous request of that prefix. ``prefill_kind`` says which explanation of
a slow prefill those numbers support.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from tessera.telemetry.causes import Attribution, Baseline, first_token_attempt
from tessera.telemetry.evidence import (
    CULPRIT_SHARE,
    Evidence,
    Fact,
    busy,
    culprit_of,
    loads_text,
    meanwhile,
    ms,
    others_tokens,
    seconds_of,
)
from tessera.telemetry.prefill_curve import TypicalPrefill

if TYPE_CHECKING:
    from tessera.telemetry.run_context import RunContext

# A prefill this many times the engine's typical time for its length was slowed by something else than
# its length (the batch it shared, or a stall).
SLOW_FACTOR = 1.5


def prefill_kind(prefill_s: float, typical: TypicalPrefill | None, computed_tokens: int, cached_tokens: int,
                 baseline: Baseline, num_others_tokens: int) -> str:
    """Which explanation of a slow prefill the numbers support:

    - ``busy_batch``: slower than the engine's typical time for its length while the engine computed a
      busy share of tokens for others (without a typical time: no longer than the tenant's usual prompt);
    - ``engine_stall``: slower than typical with (nearly) nothing else on the engine: a first pass, a CPU
      shared with other processes;
    - ``cold_prefix``: typical for its length, but more to compute than usual because less was cached;
    - ``long_prompt``: typical for its length, and the prompt is longer than the tenant's usual one;
    - ``near_typical``: within SLOW_FACTOR of the engine's typical time for its length, no longer than
      usual, little else running: slower than the tenant's median, but not slow.
    """
    longer = computed_tokens > baseline.computed_tokens
    slow_for_length = prefill_s > SLOW_FACTOR * typical.seconds if typical is not None else not longer
    crowded = busy(num_others_tokens, computed_tokens)
    if slow_for_length:
        return "busy_batch" if crowded else "engine_stall"
    if longer:
        return "cold_prefix" if cached_tokens < baseline.cached_tokens else "long_prompt"
    return "busy_batch" if crowded else "near_typical"


def _prefill_facts(a: Attribution, b: Baseline, typical: TypicalPrefill | None) -> dict[str, Fact]:
    p = a.phases
    facts: dict[str, Fact] = {
        "engine": p.engine, "prompt_tokens": p.prompt_tokens, "cached_tokens": p.cached_tokens,
        "computed_tokens": p.computed_tokens, "prefill_s": p.prefill_s, "baseline_prefill_s": b.prefill_s,
        "baseline_cached_tokens": b.cached_tokens, "baseline_computed_tokens": b.computed_tokens}
    if typical is not None:
        facts.update({"typical_prefill_s": typical.seconds, "typical_prefill_requests": typical.num_requests,
                      "typical_prefill_scope": typical.scope,
                      "prefill_vs_typical": round(p.prefill_s / typical.seconds, 2) if typical.seconds > 0 else 0.0})
    return facts


def _typical_text(typical: TypicalPrefill | None, engine: str) -> str:
    if typical is None:
        return "no reference requests of that length"
    where = engine if typical.scope == engine else typical.scope
    return f"{ms(typical.seconds)} typical on {where} for that length ({typical.num_requests} requests)"


def slow_prefill(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    t, p = a.timeline, a.phases
    attempt = first_token_attempt(t)
    assert attempt is not None
    start = attempt.scheduled_ns or attempt.arrival_ns
    end = attempt.first_token_ns or start
    typical = run.prefill.typical(p.engine, p.computed_tokens)
    loads = run.engines.work_during(p.engine, start, end, t.span_id)
    batch = run.engines.mean_running(p.engine, start, end, t.span_id)
    kind = prefill_kind(p.prefill_s, typical, p.computed_tokens, p.cached_tokens, b, others_tokens(loads))
    culprit, share = culprit_of(t.tenant, loads) if kind == "busy_batch" else ("", 0.0)
    head = {"busy_batch": "busy batch", "engine_stall": "engine stalled (little else running)",
            "cold_prefix": "cold prefix", "long_prompt": "long prompt",
            "near_typical": "about typical for its length"}[kind]
    summary = (f"{head}: {p.computed_tokens:,} tokens to compute ({p.cached_tokens:,} of {p.prompt_tokens:,} cached;"
               f" {t.tenant} usually computes {b.computed_tokens:,.0f}) took {ms(p.prefill_s)} vs"
               f" {_typical_text(typical, p.engine)}; {batch:.1f} other request(s) running on average,"
               f" {meanwhile(loads, p.engine)}")
    facts = _prefill_facts(a, b, typical)
    facts.update({"mean_running_others": round(batch, 2), "others_tokens": others_tokens(loads),
                  "preemptions": attempt.preemptions, "culprit_share": round(share, 3)})
    return Evidence("slow_prefill", kind, summary, facts, loads, culprit)


def recompute_after_eviction(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    t, p = a.timeline, a.phases
    attempt = first_token_attempt(t)
    assert attempt is not None
    blocks_by: dict[str, float] = defaultdict(float)
    blocks_by_cause: dict[str, int] = defaultdict(int)
    for r in a.lost_prefix:
        # ``evicted_by`` may name several tenants (the new blocks announced after the eviction): share the blocks.
        evictors = [x for x in r.evicted_by.split(",") if x] or [""]
        for evictor in evictors:
            blocks_by[evictor] += r.num_blocks / len(evictors)
        blocks_by_cause[r.cause or "unattributed"] += r.num_blocks
    blocks = sum(r.num_blocks for r in a.lost_prefix)
    named = {k or "(unattributed)": round(v) for k, v in sorted(blocks_by.items(), key=lambda kv: -kv[1])}
    top = max(blocks_by, key=lambda k: blocks_by[k]) if blocks_by else ""
    share = blocks_by[top] / blocks if blocks else 0.0
    culprit = top if top and top != t.tenant and share >= CULPRIT_SHARE else ""
    kind = max(blocks_by_cause, key=lambda k: blocks_by_cause[k]) if blocks_by_cause else "unattributed"
    scheduled = attempt.scheduled_ns or attempt.arrival_ns
    last = max((r.ts_ns for r in a.lost_prefix), default=scheduled)
    while_queued = sum(r.num_blocks for r in a.lost_prefix if r.ts_ns >= attempt.arrival_ns)
    since = a.prefix_since_ns if a.prefix_since_ns is not None else min(
        (r.ts_ns for r in a.lost_prefix), default=attempt.arrival_ns)
    loads = run.engines.work_during(p.engine, since, scheduled, t.span_id)
    typical = run.prefill.typical(p.engine, p.computed_tokens)
    by_text = ", ".join(f"{k} {v}" for k, v in named.items())
    queued_text = f", {while_queued} of them while it waited in the queue" if while_queued else ""
    summary = (f"{blocks} block(s) of prefix {t.prefix_root} evicted on {p.engine} by {by_text or '?'} ({kind}),"
               f" the last {ms(seconds_of(scheduled - last))} before it was scheduled{queued_text}; cached"
               f" {p.cached_tokens:,} of {p.prompt_tokens:,} tokens ({t.tenant} usually {b.cached_tokens:,.0f}),"
               f" recomputed {p.computed_tokens:,} in {ms(p.prefill_s)} vs {ms(b.prefill_s)} typical for {t.tenant}"
               f" and {_typical_text(typical, p.engine)}; since the previous request of this prefix"
               f" {p.engine} computed {others_tokens(loads):,} tokens for: {loads_text(loads)}")
    facts = _prefill_facts(a, b, typical)
    facts.update({
        "prefix_root": t.prefix_root, "evicted_blocks": blocks, "num_evictions": len(a.lost_prefix),
        "evicted_blocks_by_tenant": named, "evicted_blocks_by_cause": dict(blocks_by_cause),
        "evicted_blocks_while_queued": while_queued, "last_eviction_before_scheduled_s": seconds_of(scheduled - last),
        "previous_prefix_request_before_arrival_s": (
            seconds_of(attempt.arrival_ns - a.prefix_since_ns) if a.prefix_since_ns is not None else -1.0),
        "others_tokens": others_tokens(loads), "culprit_share": round(share, 3)})
    return Evidence("prefill_recompute_after_eviction", kind, summary, facts, loads, culprit)
