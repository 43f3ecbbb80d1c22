"""Result files (versioned JSON, JSONL round trip, CSV) and the live progress line."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tessera_loadgen.metrics import METRICS_VERSION, summarize_run
from tessera_loadgen.progress import LiveStats, render, snapshot
from tessera_loadgen.records import RequestRecord
from tessera_loadgen.results import (
    RunInfo,
    build_result,
    csv_columns,
    format_table,
    load_result,
    read_jsonl,
    write_run_dir,
)


def records(t0: float) -> list[RequestRecord]:
    ok = RequestRecord("a-0", "a", "c", "chat", True, t_sched=t0 + 1.0, trace_id="ab" * 16, server_request_id="s1")
    ok.t_send_first = ok.t_send = t0 + 1.001
    ok.chunk_times = [t0 + 1.1, t0 + 1.12, t0 + 1.2]
    ok.chunk_tokens = [1, 1, 2]
    ok.t_first, ok.t_last, ok.t_done = t0 + 1.1, t0 + 1.2, t0 + 1.201
    ok.n_in, ok.n_out = 10, 4
    failed = RequestRecord("b-1", "b", "c", "completions", True, t_sched=t0 + 2.0, warmup=False)
    failed.t_send_first = failed.t_send = t0 + 2.0
    failed.fail("http_500", "boom", t0 + 2.5)
    return [ok, failed]


def test_run_dir_round_trip(tmp_path: Path) -> None:
    t0 = 5000.0
    rows = records(t0)
    summary = summarize_run(rows)
    info = RunInfo("http://x:1", 1.7e9, 3.0, 1, {"a": "m", "b": "m"})
    result = build_result({"name": "w"}, info, summary)
    write_run_dir(tmp_path, result, rows, t0)

    loaded = load_result(tmp_path)
    assert loaded["format_version"] == 1
    assert loaded["metrics_version"] == METRICS_VERSION
    assert loaded["summary"]["tenants"]["a"]["latency"]["ttft_s"]["p50"] == pytest.approx(0.099)

    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["trace_id"] == "ab" * 16 and first["server_request_id"] == "s1"
    assert first["t_sched"] == 1.0
    assert first["chunk_offsets_s"] == [0.0, 0.02, 0.1]
    # Recomputing from the JSONL gives the same summary as the live records.
    again = summarize_run(read_jsonl(tmp_path / "requests.jsonl"))
    assert again["overall"]["latency"]["tpot_s"]["p50"] == pytest.approx(summary["overall"]["latency"]["tpot_s"]["p50"])
    assert again["overall"]["errors"] == {"http_500": 1}

    with (tmp_path / "summary.csv").open() as src:
        table = list(csv.DictReader(src))
    assert list(table[0]) == list(csv_columns())
    assert [(r["scope"], r["tenant"], r["request_class"]) for r in table] == [
        ("overall", "", ""),
        ("tenant", "a", ""),
        ("class", "a", "c"),
        ("tenant", "b", ""),
        ("class", "b", "c"),
    ]
    assert "ttft_s_p99.9" in table[0]
    assert "a/c" in format_table(summary)


def test_load_result_rejects_other_files(tmp_path: Path) -> None:
    (tmp_path / "result.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a tessera-loadgen-result"):
        load_result(tmp_path)


def test_progress_snapshot_and_line() -> None:
    stats = LiveStats()
    for r in records(0.0):
        stats.on_sent()
        stats.on_done(r)
    stats.on_sent()
    snap = snapshot(stats, now=3.0, t0=0.0, previous=None)
    assert (snap.num_sent, snap.num_done, snap.num_failed, snap.in_flight) == (3, 2, 1, 1)
    assert snap.ttft_p50_s == pytest.approx(0.1)
    later = snapshot(stats, now=4.0, t0=0.0, previous=snap)
    assert later.send_rate_rps == 0.0
    assert math.isnan(snapshot(stats, now=100.0, t0=0.0, previous=None).ttft_p99_s)  # window moved on
    line = render(snap)
    assert "in-flight 1" in line and "TTFT p50 100ms" in line
    assert len(stats.new_samples()) == 1 and stats.new_samples() == []
