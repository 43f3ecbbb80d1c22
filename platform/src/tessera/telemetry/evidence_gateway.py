"""Evidence for the gateway's causes: ``gateway_queueing`` and ``admission_wait``.

The numbers: the phase against the tenant's typical request, and the gateway's other requests in flight when
the request arrived (per tenant) against the run's typical in-flight count. More in flight than usual means
the gateway was busy relaying; no more than usual means the process itself stalled (CPU, event loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.telemetry.causes import Attribution, Baseline
from tessera.telemetry.evidence import Evidence, culprit_of, loads_text, ms

if TYPE_CHECKING:
    from tessera.telemetry.run_context import RunContext


def gateway_queueing(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    t, p = a.timeline, a.phases
    loads = run.gateway.in_flight_at(t.start_ns, t.span_id)
    in_flight, typical = sum(x.num_requests for x in loads), run.gateway.typical_in_flight()
    culprit, share = culprit_of(t.tenant, loads, by_tokens=False)
    kind = "gateway_busy" if in_flight > typical else "gateway_stall"
    head = ("gateway busy" if kind == "gateway_busy" else
            "gateway stalled with no more requests than usual (CPU or event loop, not a queue)")
    return Evidence("gateway_queueing", kind, (
        f"{head}: {ms(p.gateway_s)} in the gateway vs {ms(b.gateway_s)} typical for {t.tenant}"
        f" ({ms(p.gateway_relay_s)} relaying the first token); {in_flight} other request(s) in flight on arrival"
        f" (typical {typical:g}): {loads_text(loads, by_tokens=False)}"),
        {"gateway_s": p.gateway_s, "baseline_gateway_s": b.gateway_s, "gateway_relay_s": p.gateway_relay_s,
         "gateway_in_flight": in_flight, "typical_gateway_in_flight": typical, "culprit_share": round(share, 3)},
        loads, culprit)


def admission_wait(a: Attribution, b: Baseline, run: RunContext) -> Evidence:
    t, p = a.timeline, a.phases
    at = t.admission_ns[0] if t.admission_ns else t.start_ns
    loads = run.gateway.in_flight_at(at, t.span_id)
    in_flight, typical = sum(x.num_requests for x in loads), run.gateway.typical_in_flight()
    culprit, share = culprit_of(t.tenant, loads, by_tokens=False)
    return Evidence("admission_wait", "admission_slow", (
        f"admission (one Redis call) took {ms(p.admission_s)} vs {ms(b.admission_s)} typical for {t.tenant};"
        f" {in_flight} other request(s) in flight at the gateway (typical {typical:g}):"
        f" {loads_text(loads, by_tokens=False)}"),
        {"admission_s": p.admission_s, "baseline_admission_s": b.admission_s, "gateway_in_flight": in_flight,
         "typical_gateway_in_flight": typical, "culprit_share": round(share, 3)},
        loads, culprit)
