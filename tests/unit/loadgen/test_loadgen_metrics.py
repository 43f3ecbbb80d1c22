"""Metric definitions on hand-made records, against values worked out by hand (shared/metrics.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tessera_loadgen.metrics import (
    MetricSpec,
    SloSpec,
    distribution,
    e2el_s,
    e2el_user_s,
    itl_gaps,
    meets_slo,
    schedule_lag_s,
    summarize,
    summarize_run,
    tpot_s,
    ttft_s,
    ttft_user_s,
)
from tessera_loadgen.records import N_OUT_FROM_CHUNKS, RequestRecord


def make(
    t_sched: float = 0.0,
    t_send: float | None = 0.010,
    chunks: list[float] | None = None,
    tokens: list[int] | None = None,
    n_out: int | None = None,
    tenant: str = "a",
    request_class: str = "c",
    error: str | None = None,
    warmup: bool = False,
    t_done: float | None = None,
) -> RequestRecord:
    chunks = chunks if chunks is not None else [0.110, 0.130, 0.150, 0.190]
    record = RequestRecord(
        request_id=f"{tenant}-{t_sched}",
        tenant=tenant,
        request_class=request_class,
        endpoint="chat",
        stream=True,
        t_sched=t_sched,
        warmup=warmup,
        t_send_first=t_send,
        t_send=t_send,
        chunk_times=list(chunks),
        chunk_tokens=tokens,
        n_out=n_out if n_out is not None else len(chunks),
    )
    if chunks:
        record.t_first, record.t_last = chunks[0], chunks[-1]
    record.t_done = t_done if t_done is not None else (chunks[-1] + 0.001 if chunks else t_send)
    if error is not None:
        record.error_kind = error
    return record


def test_per_request_metrics_follow_the_definitions() -> None:
    r = make(t_sched=0.0, t_send=0.010, chunks=[0.110, 0.130, 0.150, 0.190], tokens=[1, 1, 1, 1])
    assert ttft_s(r) == pytest.approx(0.100)
    assert ttft_user_s(r) == pytest.approx(0.110)
    assert e2el_s(r) == pytest.approx(0.180)
    assert e2el_user_s(r) == pytest.approx(0.190)
    assert tpot_s(r) == pytest.approx(0.080 / 3)
    assert schedule_lag_s(r) == pytest.approx(0.010)
    assert [g for g, _ in itl_gaps(r)] == pytest.approx([0.020, 0.020, 0.040])


def test_single_token_output_has_ttft_but_no_tpot_or_itl() -> None:
    r = make(chunks=[0.050], tokens=[1], n_out=1)
    assert ttft_s(r) == pytest.approx(0.040)
    assert e2el_s(r) == pytest.approx(0.040)
    assert tpot_s(r) is None
    assert itl_gaps(r) == []
    summary = summarize([r])
    assert summary["latency"]["tpot_s"]["count"] == 0
    assert summary["latency"]["itl_s"]["count"] == 0
    assert summary["latency"]["ttft_s"]["count"] == 1


def test_multi_token_chunks_do_not_inflate_per_token_itl() -> None:
    # Speculative decoding: the first chunk has 1 token, the next two have 3 each (n_out = 7).
    r = make(t_send=1.0, t_sched=1.0, chunks=[1.10, 1.13, 1.16], tokens=[1, 3, 3], n_out=7)
    summary = summarize([r])
    latency = summary["latency"]
    assert latency["itl_s"]["count"] == 2
    assert latency["itl_s"]["p50"] == pytest.approx(0.03)
    # Each 30 ms gap closes a 3-token chunk: 10 ms per token, counted once per token.
    assert latency["itl_per_token_s"]["count"] == 6
    assert latency["itl_per_token_s"]["p50"] == pytest.approx(0.01)
    assert latency["itl_per_token_s"]["max"] == pytest.approx(0.01)
    # TPOT = (t_last - t_first) / (n_out - 1) = 0.06 / 6.
    assert latency["tpot_s"]["p50"] == pytest.approx(0.01)


def test_unknown_chunk_tokens_are_estimated_from_the_average_and_flagged() -> None:
    r = make(chunks=[0.1, 0.2, 0.3, 0.4], tokens=None, n_out=8)
    assert [k for _, k in itl_gaps(r)] == [2.0, 2.0, 2.0]
    summary = summarize([r])
    assert summary["tokens"]["num_chunk_tokens_estimated"] == 1
    assert summary["latency"]["itl_per_token_s"]["p50"] == pytest.approx(0.05)


def test_a_chunk_reported_with_zero_new_tokens_counts_as_one() -> None:
    r = make(chunks=[0.1, 0.2], tokens=[2, 0], n_out=2)
    assert itl_gaps(r) == [(pytest.approx(0.1), 1.0)]


def test_percentiles_are_exact_with_linear_interpolation() -> None:
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert d["count"] == 4
    assert d["mean"] == pytest.approx(2.5)
    assert d["p50"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7)
    assert d["p99"] == pytest.approx(3.97)
    assert d["p99.9"] == pytest.approx(3.997)
    assert d["min"] == 1.0 and d["max"] == 4.0
    values = list(np.random.default_rng(1).exponential(size=1001))
    assert distribution(values)["p99.9"] == pytest.approx(float(np.percentile(values, 99.9)))


def test_empty_distribution_reports_zero_samples() -> None:
    d = distribution([])
    assert d["count"] == 0
    assert d["p99"] is None


def test_errors_are_counted_by_kind_and_count_as_slo_misses() -> None:
    good = make(t_sched=0.0, t_send=0.0, chunks=[0.1, 0.2], t_done=0.2)
    slow = make(t_sched=1.0, t_send=1.0, chunks=[2.5, 2.6], t_done=2.6)
    failed = make(t_sched=2.0, t_send=2.0, chunks=[], error="http_500", t_done=2.01)
    timed_out = make(t_sched=3.0, t_send=3.0, chunks=[], error="timeout", t_done=4.0)
    slo = SloSpec(ttft_s=1.0)
    slos = {("a", "c"): slo}
    summary = summarize([good, slow, failed, timed_out], slos)
    assert summary["num_requests"] == 4
    assert summary["num_completed"] == 2
    assert summary["num_failed"] == 2
    assert summary["errors"] == {"http_500": 1, "timeout": 1}
    assert summary["num_good"] == 1
    assert summary["slo_attainment"] == pytest.approx(0.25)
    # Window: first send (0.0) to last completion (2.6).
    assert summary["window"]["duration_s"] == pytest.approx(2.6)
    assert summary["request_throughput_rps"] == pytest.approx(2 / 2.6)
    assert summary["goodput_rps"] == pytest.approx(1 / 2.6)
    assert summary["output_throughput_tps"] == pytest.approx(4 / 2.6)
    # Latency metrics use completed requests only; schedule lag uses every request sent.
    assert summary["latency"]["ttft_s"]["count"] == 2
    assert summary["schedule_lag_s"]["count"] == 4


def test_slo_view_user_counts_client_lateness_and_service_does_not() -> None:
    late = make(t_sched=0.0, t_send=0.9, chunks=[1.0, 1.1])  # sent 0.9 s late, served in 0.1 s
    assert not meets_slo(late, SloSpec(ttft_s=0.5, view="user"))
    assert meets_slo(late, SloSpec(ttft_s=0.5, view="service"))
    assert not meets_slo(late, SloSpec(e2el_s=1.0, view="user"))
    assert meets_slo(late, SloSpec(tpot_s=0.11))
    assert not meets_slo(late, SloSpec(tpot_s=0.05))


def test_slo_thresholds_that_cannot_apply_are_not_held_against_a_request() -> None:
    one_token = make(chunks=[0.1], n_out=1)
    assert meets_slo(one_token, SloSpec(tpot_s=0.001))
    non_streamed = make(chunks=[])
    non_streamed.t_last = non_streamed.t_done = 0.5
    non_streamed.stream = False
    assert meets_slo(non_streamed, SloSpec(ttft_s=0.001, e2el_s=1.0))
    assert not meets_slo(non_streamed, SloSpec(e2el_s=0.1))


def test_rates_and_client_lag_flag() -> None:
    records = [make(t_sched=i * 0.1, t_send=i * 0.1 + 0.001, chunks=[i * 0.1 + 0.01]) for i in range(11)]
    summary = summarize(records, target_rate_rps=10.0)
    assert summary["offered_rate_rps"] == pytest.approx(10.0)
    assert summary["send_rate_rps"] == pytest.approx(10.0)
    assert summary["target_rate_rps"] == 10.0
    assert not summary["client_lagging"]
    late = [make(t_sched=i * 0.1, t_send=i * 0.1 + 0.050, chunks=[i * 0.1 + 0.06]) for i in range(11)]
    assert summarize(late)["client_lagging"]


def test_rejections_with_and_without_retry_after() -> None:
    retried = make()
    retried.num_429, retried.num_429_retry_after, retried.retry_wait_s = 2, 1, 1.5
    rejected = make(chunks=[], error="http_429")
    rejected.num_429 = 1
    summary = summarize([retried, rejected])
    rejections = summary["rejections_429"]
    assert rejections["num_responses"] == 3
    assert rejections["num_with_retry_after"] == 1
    assert rejections["num_without_retry_after"] == 2
    assert rejections["num_requests_retried"] == 1
    assert rejections["num_requests_rejected"] == 1
    assert rejections["retry_wait_s_total"] == pytest.approx(1.5)


def test_client_counted_n_out_is_flagged() -> None:
    r = make()
    r.n_out_source = N_OUT_FROM_CHUNKS
    assert summarize([r])["tokens"]["num_n_out_client_counted"] == 1


def test_summarize_run_excludes_warmup_and_groups_by_tenant_and_class() -> None:
    records = [
        make(tenant="a", request_class="x", t_sched=0.0, warmup=True, chunks=[5.0]),
        make(tenant="a", request_class="x", t_sched=1.0, t_send=1.0, chunks=[1.1]),
        make(tenant="a", request_class="y", t_sched=2.0, t_send=2.0, chunks=[2.3]),
        make(tenant="b", request_class="x", t_sched=3.0, t_send=3.0, chunks=[3.2]),
    ]
    spec = MetricSpec(slos={}, target_rates={("a", None): 2.0, ("a", "x"): 1.0, ("b", None): 1.0})
    summary = summarize_run(records, spec)
    assert summary["overall"]["num_requests"] == 3
    assert summary["overall"]["target_rate_rps"] == 3.0
    assert set(summary["tenants"]) == {"a", "b"}
    tenant_a = summary["tenants"]["a"]
    assert tenant_a["num_requests"] == 2
    assert set(tenant_a["classes"]) == {"x", "y"}
    assert tenant_a["classes"]["x"]["latency"]["ttft_s"]["p50"] == pytest.approx(0.1)
    assert tenant_a["classes"]["x"]["target_rate_rps"] == 1.0
    assert tenant_a["classes"]["y"]["target_rate_rps"] is None
    assert summary["tenants"]["b"]["latency"]["ttft_user_s"]["p50"] == pytest.approx(0.2)
    assert not math.isnan(summary["overall"]["latency"]["e2el_s"]["mean"])
