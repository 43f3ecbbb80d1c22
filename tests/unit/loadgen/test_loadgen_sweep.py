"""Sweep logic on canned summaries (no server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tessera_loadgen.sweep import SweepPoint, evaluate, geometric_rates, max_good_rate, run_sweep
from tessera_loadgen.workload import Workload

WORKLOAD = Workload.model_validate(
    {
        "duration_s": 1,
        "tenants": [
            {"name": "a", "arrival": {"rate_rps": 1}, "slo": {"ttft_s": 0.5, "attainment_target": 0.9}},
            {"name": "b", "arrival": {"rate_rps": 3}},
        ],
    }
)


def fake_summary(target: float, achieved: float, attainment_a: float, lag_p99: float = 0.001) -> dict[str, Any]:
    dist = {"p99": 0.1}
    overall = {
        "achieved_rate_rps": achieved,
        "target_rate_rps": target,
        "client_lagging": lag_p99 > 0.005,
        "num_completed": 10,
        "num_failed": 0,
        "goodput_rps": achieved,
        "slo_attainment": attainment_a,
        "latency": {"ttft_user_s": dist, "e2el_user_s": dist},
        "schedule_lag_s": {"p99": lag_p99},
    }
    return {
        "overall": overall,
        "tenants": {"a": {"slo_attainment": attainment_a}, "b": {"slo_attainment": 0.1}},
    }


def test_geometric_rates() -> None:
    assert geometric_rates(10, 2, 80) == [10, 20, 40, 80]
    assert geometric_rates(10, 1.5, 30) == [10, 15, 22.5]
    with pytest.raises(ValueError):
        geometric_rates(10, 1, 20)


def test_evaluate_uses_each_tenants_attainment_target_and_saturation() -> None:
    assert evaluate(4, "d", fake_summary(4, 4, 0.95), WORKLOAD).ok  # b has no SLO: ignored
    assert not evaluate(4, "d", fake_summary(4, 4, 0.85), WORKLOAD).meets_slo
    saturated = evaluate(4, "d", fake_summary(4, 3.0, 0.95), WORKLOAD)
    assert saturated.meets_slo and saturated.saturated and not saturated.ok
    assert evaluate(4, "d", fake_summary(4, 4, 0.95, lag_p99=0.02), WORKLOAD).saturated


def point(rate: float, ok: bool) -> SweepPoint:
    return SweepPoint(rate, "", rate, rate, 1.0, 0.1, 0.1, 0.0, 0, ok, False)


def test_max_good_rate_is_below_the_first_failure() -> None:
    assert max_good_rate([point(10, True), point(20, True), point(40, False), point(80, True)]) == 20
    assert max_good_rate([point(10, False)]) is None


def test_run_sweep_stops_at_the_first_failure_and_bisects(tmp_path: Path) -> None:
    capacity = 33.0
    seen: list[float] = []

    def run_point(scaled: Workload, run_dir: Path) -> dict[str, Any]:
        rate = scaled.open_loop_rate_rps()
        seen.append(rate)
        attainment = 0.99 if rate <= capacity else 0.5
        return fake_summary(rate, rate, attainment)

    _, best = run_sweep(WORKLOAD, [10, 20, 40, 80], tmp_path, run_point, refine_steps=2)
    assert seen[:3] == [10, 20, 40]  # 80 never runs
    assert seen[3:] == [30, 35]
    assert best == 30
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["max_rate_meeting_slo_rps"] == 30
    assert [p["rate_rps"] for p in data["points"]] == [10, 20, 30, 35, 40]
    assert (tmp_path / "sweep.csv").read_text().startswith("rate_rps,")
