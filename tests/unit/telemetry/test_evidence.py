"""Every cause comes with its evidence in numbers, and the evidence names the noisy tenant when it is one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tessera.telemetry.analyze import render
from tessera.telemetry.causes import CAUSES, UNEXPLAINED, Attribution
from tests.support.spans_factory import Attempt, Req, eviction
from tests.support.trace_scenarios import SLOW_AT, only_slow, report_of, typical

# Two noisy requests on e1 from SLOW_AT: 2,048-token prompts whose prefill runs [SLOW_AT + 1, SLOW_AT + 395] ms.
NOISY_PREFILL = Attempt(arrival=0.0, scheduled=1.0, first_token=395.0, finished=450.0, prompt_tokens=2048,
                        cached_tokens=0, output_tokens=16)


def noisy(n: int = 2, attempt: Attempt = NOISY_PREFILL, start: float = SLOW_AT) -> list[dict[str, Any]]:
    return [s for _ in range(n) for s in Req(tenant="noisy", start=start, prefix_root="00000000000000cc",
                                             attempts=[Attempt(**vars(attempt))]).spans()]


def reference(prompt_tokens: int, prefill_ms: float, n: int = 20) -> list[dict[str, Any]]:
    """Another tenant's requests on e1, between the victim's, that set e1's typical prefill for a length (a
    little apart, so the percentile selects only that tenant's slowest)."""
    return [s for i in range(n) for s in Req(tenant="batch", start=i * 1000.0 + 500, prefix_root="00000000000000dd",
                                             attempts=[Attempt(cached_tokens=0, prompt_tokens=prompt_tokens,
                                                               first_token=6.0 + prefill_ms + i * 0.01,
                                                               finished=46.0 + prefill_ms + i * 0.01)]).spans()]


def slow_gateway() -> Attribution:
    slow = Req(admission=(200.0, 201.0), attempts=[Attempt(arrival=204.0, scheduled=205.0, first_token=219.0,
                                                           finished=259.0)])
    in_flight = Attempt(engine="e2", arrival=5.0, scheduled=6.0, first_token=100.0, finished=900.0)
    return only_slow(slow, noisy(3, in_flight, start=SLOW_AT - 10))


def slow_admission() -> Attribution:
    return only_slow(Req(admission=(1.0, 250.0),
                         attempts=[Attempt(arrival=253.0, scheduled=254.0, first_token=268.0, finished=308.0)]))


def queued_behind_noisy() -> Attribution:
    return only_slow(Req(attempts=[Attempt(scheduled=300.0, first_token=314.0, finished=354.0)]), noisy())


def prefill_beside_noisy() -> Attribution:
    return only_slow(Req(attempts=[Attempt(first_token=200.0, finished=240.0)]), noisy())


def prefill_alone() -> Attribution:
    return only_slow(Req(attempts=[Attempt(first_token=200.0, finished=240.0)]))


def prefill_a_little_slow() -> Attribution:
    return only_slow(Req(attempts=[Attempt(first_token=22.0, finished=62.0)]))  # 16 ms vs 14 ms, alone


def long_prompt() -> Attribution:
    # 2,048 tokens to compute (288 cached, as usual): 200 ms is e1's typical time for that length.
    slow = Req(attempts=[Attempt(prompt_tokens=2336, first_token=206.0, finished=246.0)])
    return only_slow(slow, reference(2048, 200.0))


def cold_prefix() -> Attribution:
    # Nothing of the usual 288 cached: 320 tokens to compute in e1's typical 60 ms for that length.
    slow = Req(attempts=[Attempt(cached_tokens=0, first_token=66.0, finished=106.0)])
    return only_slow(slow, reference(320, 60.0))


def evicted_by_noisy() -> Attribution:
    slow = Req(attempts=[Attempt(cached_tokens=0, first_token=200.0, finished=240.0)])
    return only_slow(slow, [eviction("e1", "victim", SLOW_AT - 500, "00000000000000aa", (0, 9), 10)])


def preempted() -> Attribution:
    return only_slow(Req(attempts=[Attempt(first_token=250.0, finished=290.0, preemptions=2)]), noisy())


def aborted() -> Attribution:
    first = Attempt(engine="e1", first_token=None, finished=150.0, output_tokens=0, steps=0,  # type: ignore[arg-type]
                    aborted="kv_exhausted")
    retried = Attempt(engine="e2", arrival=160.0, scheduled=161.0, first_token=175.0, finished=215.0)
    return only_slow(Req(attempts=[first, retried]))


def decode_beside_noisy() -> Attribution:
    decoding = Attempt(arrival=0.0, scheduled=1.0, first_token=10.0, finished=400.0, output_tokens=200, steps=200)
    return only_slow(Req(attempts=[Attempt(finished=200.0)]), noisy(2, decoding), metric="e2e")


def drafts_rejected() -> Attribution:
    return only_slow(Req(attempts=[Attempt(finished=100.0, steps=16, spec_accepted=0, spec_drafted=16)]),
                     metric="e2e")


SCENARIOS: dict[str, tuple[Callable[[], Attribution], str, str]] = {
    # name: (scenario, primary cause, its evidence's kind)
    "gateway": (slow_gateway, "gateway_queueing", "gateway_busy"),
    "admission": (slow_admission, "admission_wait", "admission_slow"),
    "engine_queue": (queued_behind_noisy, "engine_queueing", "busy_engine"),
    "busy_batch": (prefill_beside_noisy, "slow_prefill", "busy_batch"),
    "engine_stall": (prefill_alone, "slow_prefill", "engine_stall"),
    "near_typical": (prefill_a_little_slow, "slow_prefill", "near_typical"),
    "long_prompt": (long_prompt, "slow_prefill", "long_prompt"),
    "cold_prefix": (cold_prefix, "slow_prefill", "cold_prefix"),
    "eviction": (evicted_by_noisy, "prefill_recompute_after_eviction", "cross_tenant"),
    "preempted": (preempted, "preemption", "preempted"),
    "aborted": (aborted, "preemption", "aborted"),
    "slow_decode": (decode_beside_noisy, "slow_decode", "busy_batch"),
    "speculative": (drafts_rejected, "speculative_rejection", "low_acceptance"),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_cause_has_evidence_in_numbers(name: str) -> None:
    scenario, cause, kind = SCENARIOS[name]
    a = scenario()
    assert a.primary == cause
    assert set(a.evidence) == set(a.causes)  # every cause with a share, not only the primary one
    e = a.evidence[cause]
    assert (e.cause, e.kind) == (cause, kind)
    assert e.summary and e.facts
    assert any(isinstance(v, int | float) and v for v in e.facts.values())


def test_the_scenarios_cover_every_cause() -> None:
    assert {cause for _, cause, _ in SCENARIOS.values()} == set(CAUSES)


def test_gateway_evidence_counts_the_requests_in_flight() -> None:
    e = slow_gateway().evidence["gateway_queueing"]
    assert e.facts["gateway_in_flight"] == 3 and e.facts["typical_gateway_in_flight"] == 0
    assert e.facts["gateway_s"] == pytest.approx(0.2035, abs=1e-4)
    assert e.facts["baseline_gateway_s"] == pytest.approx(0.0045, abs=1e-4)
    assert [(n.tenant, n.num_requests) for n in e.neighbours] == [("noisy", 3)]
    assert e.culprit == "noisy"


def test_admission_evidence() -> None:
    e = slow_admission().evidence["admission_wait"]
    assert e.facts["admission_s"] == pytest.approx(0.249) and e.facts["baseline_admission_s"] == pytest.approx(0.001)


def test_engine_queue_evidence_has_the_depth_on_arrival_and_the_others_work() -> None:
    a = queued_behind_noisy()
    e = a.evidence["engine_queueing"]
    assert (e.facts["num_running_at_arrival"], e.facts["num_waiting_at_arrival"]) == (2, 0)
    assert e.facts["queue_depth_source"] == "traces"
    # The wait [SLOW_AT + 5, SLOW_AT + 300] covers 295 of each noisy prefill's 394 ms.
    (load,) = e.neighbours
    assert (load.tenant, load.num_requests) == ("noisy", 2)
    assert load.prefill_tokens == pytest.approx(2 * 2048 * 295 / 394, abs=2)
    assert e.culprit == "noisy" and a.culprit == "noisy"


def test_engine_reported_queue_depth_is_preferred() -> None:
    slow = Req(start=SLOW_AT, attempts=[Attempt(scheduled=300.0, first_token=314.0, finished=354.0)]).spans()
    engine_span = next(s for s in slow if s["name"] == "engine.generate")
    engine_span["attributes"].update({"tessera.engine.num_running": 7, "tessera.engine.num_waiting": 3})
    (a,) = [a for a in report_of(typical() + slow).attributions if a.primary == "engine_queueing"]
    facts = a.evidence["engine_queueing"].facts
    assert (facts["num_running_at_arrival"], facts["num_waiting_at_arrival"], facts["queue_depth_source"]) == (
        7, 3, "engine")


def test_prefill_evidence_against_the_engines_typical_time_for_that_length() -> None:
    e = long_prompt().evidence["slow_prefill"]
    assert (e.facts["prompt_tokens"], e.facts["cached_tokens"], e.facts["computed_tokens"]) == (2336, 288, 2048)
    assert e.facts["typical_prefill_s"] == pytest.approx(0.200, abs=1e-3)
    assert e.facts["typical_prefill_scope"] == "e1" and e.facts["typical_prefill_requests"] == 19 + 20
    assert e.facts["baseline_computed_tokens"] == 32 and e.culprit == ""
    cold = cold_prefix().evidence["slow_prefill"]
    assert cold.facts["cached_tokens"] == 0 and cold.facts["baseline_cached_tokens"] == 288
    busy = prefill_beside_noisy().evidence["slow_prefill"]
    assert busy.culprit == "noisy" and busy.facts["others_tokens"] == 2 * 2048 * 194 // 394 + 1
    assert busy.facts["mean_running_others"] == pytest.approx(2.0, abs=0.05)
    stall = prefill_alone().evidence["slow_prefill"]
    assert stall.facts["others_tokens"] == 0 and stall.culprit == ""
    assert stall.facts["prefill_vs_typical"] == pytest.approx(194 / 14, rel=0.01)


def test_eviction_evidence_names_who_evicted_the_prefix() -> None:
    a = evicted_by_noisy()
    e = a.evidence["prefill_recompute_after_eviction"]
    assert e.facts["evicted_blocks"] == 10 and e.facts["evicted_blocks_by_tenant"] == {"noisy": 10}
    assert e.facts["last_eviction_before_scheduled_s"] == pytest.approx(0.506)
    assert e.facts["evicted_blocks_while_queued"] == 0
    assert e.facts["previous_prefix_request_before_arrival_s"] == pytest.approx(1.0)
    assert (e.facts["cached_tokens"], e.facts["computed_tokens"]) == (0, 320)
    assert e.culprit == "noisy" and a.culprit == "noisy"


def test_an_eviction_while_the_request_waits_in_the_queue_counts() -> None:
    # vLLM looks the prefix up when it schedules the request: evicted at +100 ms, scheduled at +150 ms.
    slow = Req(attempts=[Attempt(scheduled=150.0, cached_tokens=0, first_token=350.0, finished=390.0)])
    a = only_slow(slow, [eviction("e1", "victim", SLOW_AT + 100, "00000000000000aa", (0, 9), 10)])
    assert "prefill_recompute_after_eviction" in a.causes
    e = a.evidence["prefill_recompute_after_eviction"]
    assert e.facts["evicted_blocks_while_queued"] == 10
    assert e.facts["last_eviction_before_scheduled_s"] == pytest.approx(0.050)


def test_an_eviction_by_the_tenant_itself_names_nobody() -> None:
    slow = Req(attempts=[Attempt(cached_tokens=0, first_token=200.0, finished=240.0)])
    a = only_slow(slow, [eviction("e1", "victim", SLOW_AT - 500, "00000000000000aa", (0, 9), 10,
                                  evicted_by="victim")])
    assert a.primary == "prefill_recompute_after_eviction" and a.culprit == ""


def test_preemption_and_abort_evidence() -> None:
    e = preempted().evidence["preemption"]
    assert e.facts["preemptions"] == 2 and e.facts["num_aborted"] == 0 and e.culprit == "noisy"
    e = aborted().evidence["preemption"]
    assert e.facts["num_aborted"] == 1 and e.facts["aborted"] == "e1: kv_exhausted"
    assert e.facts["retry_s"] == pytest.approx(0.155) and e.facts["num_engines_tried"] == 2


def test_decode_and_speculation_evidence() -> None:
    e = decode_beside_noisy().evidence["slow_decode"]
    assert e.facts["output_tokens"] == 16
    assert e.facts["decode_s_per_token"] == pytest.approx(0.180 / 15)
    assert e.facts["baseline_decode_s_per_token"] == pytest.approx(0.040 / 15)
    assert e.culprit == "noisy" and e.facts["mean_running_others"] == pytest.approx(2.0, abs=0.05)
    spec = drafts_rejected().evidence["speculative_rejection"]
    assert (spec.facts["spec_accepted_tokens"], spec.facts["spec_draft_tokens"], spec.facts["spec_acceptance"]) == (
        0, 16, 0.0)
    assert (spec.facts["tokens_per_step"], spec.facts["baseline_tokens_per_step"]) == (1.0, 2.0)


def test_unexplained_has_the_phases_beside_the_baseline() -> None:
    report = report_of(typical(), percentile=50)  # identical requests: nothing above the typical one
    assert report.attributions and all(a.primary == UNEXPLAINED for a in report.attributions)
    e = report.attributions[0].evidence[UNEXPLAINED]
    assert e.kind == "within_baseline" and e.facts["prefill_s"] == e.facts["baseline_prefill_s"]


def test_the_tenant_queued_behind_itself_names_nobody() -> None:
    own = [s for _ in range(2) for s in Req(start=SLOW_AT, attempts=[Attempt(**vars(NOISY_PREFILL))]).spans()]
    slow = Req(start=SLOW_AT, attempts=[Attempt(scheduled=300.0, first_token=314.0, finished=354.0)])
    report = report_of(typical() + own + slow.spans(), percentile=90)
    (a,) = [x for x in report.attributions if x.primary == "engine_queueing"]
    assert [n.tenant for n in a.evidence["engine_queueing"].neighbours] == ["victim"]
    assert a.culprit == ""


def test_the_report_names_the_noisy_tenant_as_the_cause_of_the_quiet_tenants_tail() -> None:
    # The quiet tenant's tail: three requests, each while the noisy tenant's long prompts fill the engine.
    spans = typical(tenant="quiet")
    for k, start in enumerate((20_000.0, 22_000.0, 24_000.0)):
        spans += noisy(2, start=start - 5)
        quiet = Req(tenant="quiet", start=start, attempts=[Attempt(scheduled=6.0 + 100 * k, first_token=250.0,
                                                                   finished=290.0)])
        spans += quiet.spans()
    report = report_of(spans, percentile=90)
    (row,) = [r for r in report.by_tenant() if r["tenant"] == "quiet"]
    assert row["selected"] == 3 and row["culprit"] == "noisy" and row["culprit_share"] == 1.0
    text = render(report)
    assert "noisy (100%)" in text
    data = report.to_dict()
    for request in (r for r in data["requests"] if r["tenant"] == "quiet"):
        assert request["culprit"] == "noisy"
        evidence = request["evidence"][request["primary_cause"]]
        assert evidence["culprit"] == "noisy" and evidence["neighbours"][0]["tenant"] == "noisy"
        assert evidence["facts"]["others_tokens"] > 0
