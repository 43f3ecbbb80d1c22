"""Plots: latency axes in milliseconds with plain tick labels (no ``5.3×10⁻²``, no offset, no exponent)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tessera_loadgen.plot_ticks import plain_number
from tessera_loadgen.plots import latency_cdf_figure, ttft_over_time_figure, write_plots
from tessera_loadgen.records import RequestRecord

PLAIN = re.compile(r"^-?[0-9][0-9,]*(\.[0-9]+)?$")


def records(latencies_s: list[float]) -> list[RequestRecord]:
    rows = []
    for i, latency in enumerate(latencies_s):
        r = RequestRecord(f"r{i}", "ab"[i % 2], "c", "chat", True, t_sched=100.0 + i * 0.1)
        r.t_send_first = r.t_send = r.t_sched
        r.t_first = r.t_sched + latency
        r.t_last = r.t_done = r.t_first + 0.01
        r.chunk_times = [r.t_first, r.t_last]
        r.n_out = 2
        rows.append(r)
    return rows


def tick_labels(fig: Any, axis_name: str) -> list[str]:
    fig.canvas.draw()
    labels = []
    for ax in fig.axes:
        axis = ax.xaxis if axis_name == "x" else ax.yaxis
        labels += [t.get_text() for t in axis.get_ticklabels(which="both") if t.get_text()]
        assert axis.get_offset_text().get_text() == ""
    return labels


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.053, "0.053"),
        (0.5, "0.5"),
        (2.25, "2.25"),
        (5, "5"),
        (12.5, "12.5"),
        (20, "20"),
        (1500, "1,500"),
        (100_000, "100,000"),
        (0, "0"),
        (0.0001234, "0.000123"),
    ],
)
def test_plain_number(value: float, text: str) -> None:
    assert plain_number(value) == text


@pytest.mark.parametrize("spread_s", [(0.040, 0.070), (0.001, 20.0)])  # within a decade, and over four
def test_latency_cdf_is_in_milliseconds_with_plain_ticks(spread_s: tuple[float, float]) -> None:
    low, high = spread_s
    rows = records([low + (high - low) * i / 49 for i in range(50)])
    fig = latency_cdf_figure(rows)
    assert [ax.get_xlabel() for ax in fig.axes] == ["TTFT, user view (ms)", "E2E latency, user view (ms)"]
    labels = tick_labels(fig, "x")
    assert labels and all(PLAIN.match(label.replace("\u2212", "-")) for label in labels), labels
    # The data are in milliseconds: the labelled ticks lie around low..high × 1000.
    values = [float(label.replace(",", "")) for label in labels]
    assert min(values) < high * 1000 and max(values) > low * 1000 / 10


def test_ttft_over_time_is_in_milliseconds_without_an_offset() -> None:
    # Large and close together: matplotlib's default labels would be an offset (+2e4) and small numbers.
    rows = records([20.0 + i * 1e-6 for i in range(30)])
    fig = ttft_over_time_figure(rows, t0=100.0)
    assert fig.axes[0].get_ylabel() == "TTFT, user view (ms)"
    labels = tick_labels(fig, "y")
    assert labels and all(PLAIN.match(label.replace("\u2212", "-")) for label in labels), labels
    assert all(float(label) == pytest.approx(20_000, abs=1) for label in labels)
    assert len(set(labels)) == len(labels)


def test_write_plots_writes_three_pngs(tmp_path: Path) -> None:
    paths = write_plots(tmp_path, records([0.05, 0.06, 0.07, 0.2]), t0=100.0)
    assert [p.name for p in paths] == ["latency_cdf.png", "ttft_over_time.png", "throughput_over_time.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_a_log_axis_over_more_than_a_decade_labels_only_2s_and_5s_between_powers_of_ten() -> None:
    # 3 s .. 45 s: labels 3,000 4,000 ... 40,000 would run into each other.
    rows = records([3.0 + 42.0 * i / 49 for i in range(50)])
    labels = tick_labels(latency_cdf_figure(rows), "x")
    leading = {label.replace(",", "").rstrip("0") for label in labels}
    assert leading <= {"1", "2", "5"}, labels
