"""Evidence for every cause of one attribution (evidence.py says what an ``Evidence`` holds).

Each builder reads the request's phases, its tenant's baseline and the run-wide indices (occupancy.py,
prefill_curve.py) and returns the numbers behind its cause. Windows, per cause:

  gateway_queueing, admission_wait   the gateway's other requests in flight when the request arrived there
  engine_queueing                    the engine's queue on arrival, and what it computed during the wait
  slow_prefill                       the prompt's computed tokens against the engine's typical time for that
                                     length, and what else the batch computed during the prefill
  prefill_recompute_after_eviction   the controller's evictions of the prefix, who caused them, and what the
                                     engine computed since the previous request of that prefix arrived
  preemption                         the aborts or preemptions, and what the engine computed meanwhile
  slow_decode                        time per token against the tenant's, and the batch during the decode
  speculative_rejection              accepted / drafted tokens and tokens per step against the tenant's
  unexplained                        every phase beside its baseline
"""

from __future__ import annotations

from collections.abc import Callable

from tessera.telemetry import evidence_engine, evidence_gateway, evidence_prefill
from tessera.telemetry.causes import UNEXPLAINED, Attribution, Baseline
from tessera.telemetry.evidence import Evidence
from tessera.telemetry.run_context import RunContext

Builder = Callable[[Attribution, Baseline, RunContext], Evidence]
BUILDERS: dict[str, Builder] = {
    "gateway_queueing": evidence_gateway.gateway_queueing, "admission_wait": evidence_gateway.admission_wait,
    "engine_queueing": evidence_engine.engine_queueing, "preemption": evidence_engine.preemption,
    "slow_decode": evidence_engine.slow_decode, "speculative_rejection": evidence_engine.speculative_rejection,
    "slow_prefill": evidence_prefill.slow_prefill,
    "prefill_recompute_after_eviction": evidence_prefill.recompute_after_eviction,
}


__all__ = ["BUILDERS", "RunContext", "explain"]


def explain(a: Attribution, baseline: Baseline, run: RunContext) -> dict[str, Evidence]:
    """Evidence for each cause with a share, and for ``unexplained`` when that is the primary cause."""
    out = {cause: BUILDERS[cause](a, baseline, run) for cause in a.causes}
    if a.primary == UNEXPLAINED:
        out[UNEXPLAINED] = evidence_engine.unexplained(a, baseline, run)
    return out
