"""Errors, rejections and retries against the mock server's injected faults; trace context per request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tessera_loadgen.client import Target
from tessera_loadgen.metrics import summarize_run
from tessera_loadgen.records import RequestRecord
from tessera_loadgen.runner import Runner, run_in_loop
from tessera_loadgen.workload import Workload


def run(url: str, n: int = 40, retry: dict[str, Any] | None = None, **extra: Any) -> list[RequestRecord]:
    workload = Workload.model_validate(
        {
            "num_requests": n,
            "model": "mock-model",
            "retry": retry or {},
            "request_timeout_s": 20,
            "tenants": [
                {
                    "name": "t",
                    "arrival": {"process": "constant", "rate_rps": 100},
                    "classes": [{"name": "c", "output_tokens": 8, "prompt": {"tokens": 8}}],
                }
            ],
            **extra,
        }
    )
    return run_in_loop(Runner(workload, Target.parse(url)).run()).records


def test_429_retry_after_respected(mock_server: Callable[..., str]) -> None:
    url = mock_server(reject_rate=0.5, retry_after_s=0.02, seed=3)
    records = run(url, retry={"on_429": "respect", "max_retries": 30})
    assert all(r.ok for r in records)
    rejections = summarize_run(records)["overall"]["rejections_429"]
    assert rejections["num_responses"] > 0
    assert rejections["num_with_retry_after"] == rejections["num_responses"]
    assert rejections["num_requests_rejected"] == 0
    for r in records:
        assert r.retry_wait_s == pytest.approx(r.num_429 * 0.02)
        if r.num_429:
            assert r.t_send is not None and r.t_send_first is not None
            assert r.t_send - r.t_send_first >= r.retry_wait_s  # Retry-After is never cut short


def test_429_counted_and_moved_on(mock_server: Callable[..., str]) -> None:
    url = mock_server(reject_rate=0.5, retry_after_s="none", seed=4)
    records = run(url, retry={"on_429": "count"})
    overall = summarize_run(records)["overall"]
    rejected = overall["errors"].get("http_429", 0)
    assert 0 < rejected < len(records)
    assert overall["rejections_429"]["num_without_retry_after"] == rejected
    assert overall["rejections_429"]["num_with_retry_after"] == 0
    assert overall["num_completed"] == len(records) - rejected
    assert overall["slo_attainment"] == (len(records) - rejected) / len(records)


def test_errors_and_broken_streams_are_counted_by_kind(mock_server: Callable[..., str]) -> None:
    url = mock_server(error_rate=0.25, error_status=503, break_rate=0.3, itl_s=0.001, seed=5)
    records = run(url, n=60)
    errors = summarize_run(records)["overall"]["errors"]
    assert set(errors) == {"http_503", "broken_stream"}
    assert sum(errors.values()) < len(records)
    broken = [r for r in records if r.error_kind == "broken_stream"]
    assert all(r.t_first is not None for r in broken), "partial timing of a cut stream is kept"
    assert all(r.t_done is not None for r in records)


def test_every_request_carries_a_traceparent_and_records_ids(
    mock_server: Callable[..., str], mock_stats: Callable[[str], dict[str, int]]
) -> None:
    url = mock_server()
    records = run(url, n=30)
    stats = mock_stats(url)
    assert stats["requests"] == 30
    assert stats["valid_traceparents"] == 30
    assert len({r.trace_id for r in records}) == 30
    assert all(len(r.trace_id) == 32 for r in records)
    assert sorted(r.server_request_id or "" for r in records) == sorted(f"mock-{i}" for i in range(1, 31))


def test_connection_refused_is_a_connect_error() -> None:
    records = run("http://127.0.0.1:9", n=3)
    assert {r.error_kind for r in records} == {"connect"}
