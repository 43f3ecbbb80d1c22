"""Evidence for the engine's causes outside the prefill: ``engine_queueing``, ``preemption``, ``slow_decode``,
``speculative_rejection``, and ``unexplained``.

The numbers: the engine's queue when the request arrived (the engine's own counts when its span carries them,
else the run's overlapping requests), what the engine computed for the other requests while this one waited,
was preempted or decoded (per tenant, occupancy.py), the time per token and the draft acceptance against the
tenant's typical request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.telemetry.causes import UNEXPLAINED, Attribution, Baseline, extra_steps, first_token_attempt
from tessera.telemetry.evidence import Evidence, Fact, busy, culprit_of, meanwhile, ms, others_tokens
from tessera.telemetry.occupancy import QueueDepth
from tessera.telemetry.timeline import EngineAttempt

if TYPE_CHECKING:
    from tessera.telemetry.run_context import RunContext


def depth_on_arrival(attempt: EngineAttempt, owner: str, run: RunContext) -> QueueDepth:
    if attempt.num_running_at_arrival is not None and attempt.num_waiting_at_arrival is not None:
        return QueueDepth(attempt.num_running_at_arrival, attempt.num_waiting_at_arrival, "engine")
    return run.engines.depth_at(attempt.engine, attempt.arrival_ns, owner)


def engine_queueing(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    t, p = a.timeline, a.phases
    attempt = first_token_attempt(t)
    assert attempt is not None
    depth = depth_on_arrival(attempt, t.span_id, run)
    typical = run.engines.typical_depth(attempt.engine)
    end = attempt.scheduled_ns or attempt.arrival_ns
    loads = run.engines.work_during(attempt.engine, attempt.arrival_ns, end, t.span_id)
    culprit, share = culprit_of(t.tenant, loads)
    behind_others = depth.num_total > 0 or others_tokens(loads) > 0
    return Evidence("engine_queueing", "busy_engine" if behind_others else "engine_stall", (
        f"waited {ms(p.queue_s)} for {attempt.engine}'s scheduler vs {ms(b.queue_s)} typical for {t.tenant};"
        f" on arrival {depth.num_running} running and {depth.num_waiting} waiting there (typically {typical:g} in"
        f" all); {meanwhile(loads, attempt.engine)}"),
        {"queue_s": p.queue_s, "baseline_queue_s": b.queue_s, "engine": attempt.engine,
         "num_running_at_arrival": depth.num_running, "num_waiting_at_arrival": depth.num_waiting,
         "queue_depth_source": depth.source, "typical_engine_depth": typical, "priority": attempt.priority,
         "others_tokens": others_tokens(loads), "culprit_share": round(share, 3)},
        loads, culprit)


def preemption(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    t, p = a.timeline, a.phases
    hit = [x for x in t.attempts if x.aborted or x.preemptions] or list(t.attempts[:1])
    worst = next((x for x in hit if x.aborted), hit[0])
    loads = run.engines.work_during(worst.engine, worst.arrival_ns, worst.finished_ns or worst.end_ns, t.span_id)
    culprit, share = culprit_of(t.tenant, loads)
    aborted = [x for x in t.attempts if x.aborted]
    preemptions = sum(x.preemptions for x in t.attempts)
    what = "; ".join(
        [f"aborted on {x.engine} ({x.aborted})" for x in aborted]
        + [f"preempted {x.preemptions}x on {x.engine}" for x in t.attempts if x.preemptions])
    if aborted:
        what += f", continued on {t.engine}: {ms(p.retry_s)} lost"
    return Evidence("preemption", "aborted" if aborted else "preempted", (
        f"{what or 'preempted'} (priority {worst.priority}); while it was there, {meanwhile(loads, worst.engine)}"),
        {"preemptions": preemptions, "num_aborted": len(aborted),
         "aborted": ", ".join(f"{x.engine}: {x.aborted}" for x in aborted), "retry_s": p.retry_s,
         "num_engines_tried": len(t.attempts), "engine": worst.engine, "priority": worst.priority,
         "others_tokens": others_tokens(loads), "culprit_share": round(share, 3)},
        loads, culprit)


def slow_decode(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    t, p = a.timeline, a.phases
    attempt = first_token_attempt(t)
    assert attempt is not None and attempt.first_token_ns is not None
    end = attempt.finished_ns or attempt.end_ns
    loads = run.engines.work_during(attempt.engine, attempt.first_token_ns, end, t.span_id)
    batch = run.engines.mean_running(attempt.engine, attempt.first_token_ns, end, t.span_id)
    culprit, share = culprit_of(t.tenant, loads)
    per_token = p.decode_s / max(1, p.output_tokens - 1)
    crowded = busy(others_tokens(loads), p.output_tokens)
    return Evidence("slow_decode", "busy_batch" if crowded else "engine_stall", (
        f"{p.output_tokens:,} tokens in {ms(p.decode_s)}: {ms(per_token)}/token vs {ms(b.decode_s_per_token)}"
        f" typical for {t.tenant}, {p.steps} steps; {batch:.1f} other request(s) running on average,"
        f" {meanwhile(loads, attempt.engine)}"),
        {"output_tokens": p.output_tokens, "decode_s": p.decode_s, "decode_s_per_token": per_token,
         "baseline_decode_s_per_token": b.decode_s_per_token, "steps": p.steps, "engine": attempt.engine,
         "mean_running_others": round(batch, 2), "others_tokens": others_tokens(loads),
         "preemptions": sum(x.preemptions for x in t.attempts), "culprit_share": round(share, 3)},
        loads, culprit)


def speculative_rejection(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    p = a.phases
    per_step = p.output_tokens / max(1, p.steps)
    acceptance = p.spec_accepted_tokens / p.spec_draft_tokens if p.spec_draft_tokens else None
    drafts = (f"{p.spec_accepted_tokens:,} of {p.spec_draft_tokens:,} drafted tokens accepted ({acceptance:.0%})"
              if acceptance is not None else f"{p.spec_accepted_tokens:,} drafted tokens accepted")
    facts: dict[str, Fact] = {
        "spec_accepted_tokens": p.spec_accepted_tokens, "spec_draft_tokens": p.spec_draft_tokens,
        "tokens_per_step": round(per_step, 3), "baseline_tokens_per_step": round(b.tokens_per_step, 3),
        "steps": p.steps, "extra_steps": round(extra_steps(p, b), 1), "baseline_step_s": b.step_s}
    if acceptance is not None:
        facts["spec_acceptance"] = round(acceptance, 3)
    return Evidence("speculative_rejection", "low_acceptance", (
        f"{drafts}: {per_step:.2f} tokens/step vs {b.tokens_per_step:.2f} typical for {a.timeline.tenant},"
        f" {extra_steps(p, b):.0f} extra step(s) of {ms(b.step_s)}"), facts)


def unexplained(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    p = a.phases
    pairs = [("gateway", p.gateway_s, b.gateway_s), ("admission", p.admission_s, b.admission_s),
             ("queue", p.queue_s, b.queue_s), ("prefill", p.prefill_s, b.prefill_s)]
    return Evidence(UNEXPLAINED, "within_baseline", (
        f"no phase above {a.timeline.tenant}'s typical request: "
        + ", ".join(f"{name} {ms(v)} ({ms(base)})" for name, v, base in pairs)
        + f"; {b.num_requests} requests in the baseline"),
        {**{f"{name}_s": v for name, v, _ in pairs}, **{f"baseline_{name}_s": base for name, _, base in pairs},
         "decode_s": p.decode_s, "baseline_requests": b.num_requests})
