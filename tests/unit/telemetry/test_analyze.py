"""The tail-latency analyzer on synthetic traces: one slow request among typical ones, one cause at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from tessera.cli import app
from tessera.telemetry.analyze import AnalysisOptions, analyze, analyze_spans, render
from tessera.telemetry.spanfile import SpanRecord
from tessera.telemetry.timeline import build_timelines
from tests.support.spans_factory import Attempt, Req, eviction
from tests.support.trace_scenarios import SLOW_AT, only_slow, typical


def test_engine_queueing() -> None:
    a = only_slow(Req(attempts=[Attempt(scheduled=300.0, first_token=314.0, finished=354.0)]))
    assert a.primary == "engine_queueing"
    assert a.causes["engine_queueing"] == pytest.approx(0.294, abs=1e-3)


def test_prefill_recompute_after_an_eviction_of_this_prefix() -> None:
    slow = Req(attempts=[Attempt(cached_tokens=0, first_token=200.0, finished=240.0)])
    evicted = eviction("e1", "victim", SLOW_AT - 500, "00000000000000aa", (0, 9), 10)
    a = only_slow(slow, [evicted])
    assert a.primary == "prefill_recompute_after_eviction"
    assert "10 block(s) of prefix 00000000000000aa evicted on e1 by noisy" in a.evidence[a.primary].summary
    assert a.culprit == "noisy"


@pytest.mark.parametrize("evicted", [
    eviction("e1", "victim", SLOW_AT - 500, "00000000000000bb", (0, 9), 10),   # another prefix
    eviction("e2", "victim", SLOW_AT - 500, "00000000000000aa", (0, 9), 10),   # another engine
    eviction("e1", "victim", SLOW_AT - 1500, "00000000000000aa", (0, 9), 10),  # before the previous request
    eviction("e1", "victim", SLOW_AT + 50, "00000000000000aa", (0, 9), 10),    # after it was scheduled
    eviction("e1", "victim", SLOW_AT - 500, "00000000000000aa", (10, 12), 3),  # beyond the prompt's blocks
])
def test_evictions_that_do_not_explain_the_miss_are_ignored(evicted: dict[str, Any]) -> None:
    slow = Req(attempts=[Attempt(cached_tokens=0, first_token=200.0, finished=240.0)])
    assert only_slow(slow, [evicted]).primary == "slow_prefill"


def test_preemption_during_prefill() -> None:
    a = only_slow(Req(attempts=[Attempt(first_token=250.0, finished=290.0, preemptions=2)]))
    assert a.primary == "preemption" and "preempted 2x on e1" in a.evidence["preemption"].summary


def test_abort_and_retry_elsewhere_counts_as_preemption() -> None:
    aborted = Attempt(engine="e1", first_token=None, finished=150.0, output_tokens=0, steps=0,
                      aborted="kv_exhausted")  # type: ignore[arg-type]
    retried = Attempt(engine="e2", arrival=160.0, scheduled=161.0, first_token=175.0, finished=215.0)
    a = only_slow(Req(attempts=[aborted, retried]))
    assert a.primary == "preemption" and "aborted on e1 (kv_exhausted)" in a.evidence["preemption"].summary
    assert a.timeline.engine == "e2"


def test_admission_wait_and_gateway_queueing() -> None:
    slow_admission = Req(admission=(1.0, 250.0),
                         attempts=[Attempt(arrival=253.0, scheduled=254.0, first_token=268.0, finished=308.0)])
    assert only_slow(slow_admission).primary == "admission_wait"
    slow_gateway = Req(admission=(200.0, 201.0),
                       attempts=[Attempt(arrival=204.0, scheduled=205.0, first_token=219.0, finished=259.0)])
    assert only_slow(slow_gateway).primary == "gateway_queueing"


def test_e2e_speculative_rejection_and_slow_decode() -> None:
    # Typical: 16 tokens in 8 steps over 40 ms. Here 16 steps (no draft accepted) over 80 ms.
    rejected = Req(attempts=[Attempt(finished=100.0, steps=16, spec_accepted=0)])
    a = only_slow(rejected, metric="e2e")
    assert a.primary == "speculative_rejection"
    assert a.causes["speculative_rejection"] == pytest.approx(0.040, abs=1e-3)
    slow = Req(attempts=[Attempt(finished=200.0)])
    assert only_slow(slow, metric="e2e").primary == "slow_decode"


def test_selection_is_per_tenant_by_default() -> None:
    # The noisy tenant is slower across the board; per tenant, each tenant's own tail is selected.
    noisy = [s for i in range(20) for s in Req(tenant="noisy", start=i * 1000.0 + 300,
                                               attempts=[Attempt(scheduled=100.0, first_token=400.0,
                                                                 finished=500.0)]).spans()]
    spans = [SpanRecord.from_dict(d) for d in typical() + noisy]
    per_tenant = analyze_spans(spans, AnalysisOptions(percentile=90))
    assert {a.timeline.tenant for a in per_tenant.attributions} == {"victim", "noisy"}
    overall = analyze_spans(spans, AnalysisOptions(percentile=90, scope="all"))
    assert {a.timeline.tenant for a in overall.attributions} == {"noisy"}


def test_timelines_join_engine_spans_and_keep_engine_only_requests() -> None:
    spans = [SpanRecord.from_dict(d) for d in Req().spans()]
    engine_only = next(s for s in spans if s.name == "engine.generate")
    lone = SpanRecord.from_dict({**_as_dict(engine_only), "span_id": "ffff", "parent_span_id": None,
                                 "trace_id": "f" * 32})
    timelines = build_timelines([*spans, lone])
    assert len(timelines) == 2
    assert {len(t.attempts) for t in timelines} == {1}
    assert any(t.admission_ns is None for t in timelines)


def _as_dict(span: SpanRecord) -> dict[str, Any]:
    return {"trace_id": span.trace_id, "span_id": span.span_id, "parent_span_id": span.parent_span_id,
            "name": span.name, "service": span.service, "start_ns": span.start_ns, "end_ns": span.end_ns,
            "attributes": span.attributes,
            "events": [{"name": e.name, "ts_ns": e.ts_ns, "attributes": e.attributes} for e in span.events]}


def write_run(tmp_path: Path) -> Path:
    slow = Req(start=SLOW_AT, attempts=[Attempt(cached_tokens=0, first_token=200.0, finished=240.0)])
    spans = typical() + slow.spans() + [eviction("e1", "victim", SLOW_AT - 500, "00000000000000aa", (0, 9), 10)]
    run = tmp_path / "run" / "traces"
    run.mkdir(parents=True)
    # Two processes' files, a torn last line and an unrelated JSONL file, as a real run directory has.
    half = len(spans) // 2
    (run / "spans-a-1.jsonl").write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in spans[:half]) + b'{"trace')
    (run / "spans-b-2.jsonl").write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in spans[half:]))
    (run / "requests.jsonl").write_text('{"request_id": "x", "ttft_s": 1}\n')
    return tmp_path / "run"


def test_run_directory_render_and_json(tmp_path: Path) -> None:
    report = analyze([write_run(tmp_path)], AnalysisOptions(percentile=99))
    assert report.num_requests == 21 and report.num_evictions == 1
    text = render(report)
    assert "prefill_recompute_after_eviction" in text and "victim" in text
    data = report.to_dict()
    assert data["by_cause"][0]["cause"] == "prefill_recompute_after_eviction"
    assert data["by_tenant"][0]["top_cause_share"] == 1.0


def test_cli(tmp_path: Path) -> None:
    run = write_run(tmp_path)
    result = CliRunner().invoke(app, ["traces", "analyze", str(run), "--percentile", "99", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["requests"][0]["primary_cause"] == "prefill_recompute_after_eviction"
    table = CliRunner().invoke(app, ["traces", "analyze", str(run), "--metric", "e2e"])
    assert table.exit_code == 0 and "E2E" in table.output
    bad = CliRunner().invoke(app, ["traces", "analyze", str(run), "--metric", "tpot"])
    assert bad.exit_code == 2 and "valid: ttft, e2e" in bad.output
    missing = CliRunner().invoke(app, ["traces", "analyze", str(tmp_path / "nope")])
    assert missing.exit_code == 2
