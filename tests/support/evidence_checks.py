"""Checks of ``tessera traces analyze``'s evidence that any real run can reuse (the noisy-neighbour ground-truth
test in tests/integration/kvcontrol can call ``check_evidence`` on its own report without a second engine)."""

from __future__ import annotations

from collections.abc import Collection

from tessera.telemetry.analyze import Report

ENGINE_CAUSES = ("engine_queueing", "slow_prefill", "prefill_recompute_after_eviction", "preemption", "slow_decode")


def check_evidence(report: Report, engines: Collection[str]) -> None:
    """Every selected request has evidence for its primary cause (and every other cause with a share), whose
    numbers agree with the request's own."""
    assert report.attributions, "nothing selected"
    for a in report.attributions:
        where = (a.timeline.request_id, a.primary)
        evidence = a.evidence.get(a.primary)
        assert evidence is not None and evidence.summary and evidence.kind, where
        assert any(isinstance(v, int | float) for v in evidence.facts.values()), (where, evidence.facts)
        assert set(a.evidence) >= set(a.causes), (where, sorted(a.causes), sorted(a.evidence))
        facts = evidence.facts
        if a.primary in ENGINE_CAUSES:
            assert facts["engine"] in engines, (where, facts)
        if "computed_tokens" in facts:  # the prefill causes: the engine's own counts, and they add up
            p = a.phases
            assert (facts["prompt_tokens"], facts["cached_tokens"]) == (p.prompt_tokens, p.cached_tokens), facts
            assert p.prompt_tokens > 0 and facts["computed_tokens"] == p.prompt_tokens - p.cached_tokens, facts
        if a.primary == "prefill_recompute_after_eviction":
            blocks = facts["evicted_blocks"]
            assert isinstance(blocks, int) and blocks > 0 and facts["evicted_blocks_by_tenant"], (where, facts)


def check_culprit(report: Report, victim: str, culprit: str, min_share: float = 0.5) -> None:
    """The report names ``culprit`` as the cause of ``victim``'s tail, for at least ``min_share`` of it."""
    (row,) = [r for r in report.by_tenant() if r["tenant"] == victim]
    assert row["culprit"] == culprit and row["culprit_share"] >= min_share, row
    named = [a for a in report.attributions if a.timeline.tenant == victim and a.culprit == culprit]
    for a in named:  # the culprit is in the numbers, not only in the name
        assert any(e.culprit == culprit and (e.neighbours or e.facts.get("evicted_blocks_by_tenant"))
                   for e in a.evidence.values()), a.evidence
