"""When the soak samples a window (bench/longrun/quiet_sample.py): pure, no process started."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from longrun.quiet_sample import quiet_sample_offset, window_arrivals


def test_the_sample_falls_in_the_widest_gap_near_the_end_after_its_request_started() -> None:
    # Arrivals every 0.25 s, but one 2 s gap opened at 280 s and a 5 s gap far before the searched span.
    arrivals = [t / 4 for t in range(0, 1200) if not 1120 < t < 1128 and not 400 < t < 420]
    at = quiet_sample_offset(arrivals, 300.0, search_s=60.0, settle_s=0.15)
    assert at == pytest.approx(280.15)
    # Not at the boundary, where requests arrive every 0.25 s: nothing arrives for 1.8 s after it.
    assert not any(at - 0.1 < t < at + 1.8 for t in arrivals)


def test_a_sample_in_a_poisson_schedule_has_no_arrival_near_it() -> None:
    rng = random.Random(7)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(4.0)) < 300.0:
        arrivals.append(t)
    at = quiet_sample_offset(arrivals, 300.0)
    following = min(a for a in [*arrivals, arrivals[0] + 300.0] if a > at)
    # The widest of ~240 gaps at 4/s is ~1 s or more; the sample has most of it before the next arrival.
    assert following - at > 0.6
    assert max(a for a in arrivals if a < at) == pytest.approx(at - 0.15)


def test_the_last_gap_runs_into_the_next_window() -> None:
    # 299 -> 310 (the next window's first arrival) beats 295 -> 299.
    assert quiet_sample_offset([10.0, 295.0, 299.0], 300.0, search_s=60.0, settle_s=0.1) == pytest.approx(299.1)
    # 250 -> 299 beats 299 -> 301.
    assert quiet_sample_offset([1.0, 250.0, 299.0], 300.0, search_s=60.0, settle_s=0.1) == pytest.approx(250.1)


def test_a_narrow_gap_is_entered_halfway_and_an_empty_span_samples_at_the_end() -> None:
    assert quiet_sample_offset([299.9], 300.0, settle_s=0.15) == pytest.approx(299.9 + 0.15)
    assert quiet_sample_offset([290.0, 290.1], 300.0, search_s=5.0) == pytest.approx(300.0)
    assert quiet_sample_offset([], 300.0) == 300.0
    at = quiet_sample_offset([280.0, 280.2, 280.4], 300.0, search_s=30.0, settle_s=0.15)
    assert at == pytest.approx(280.4 + 0.15)
    with pytest.raises(ValueError, match="arrivals must lie"):
        quiet_sample_offset([300.0], 300.0)


def test_window_arrivals_shift_the_first_period_by_the_warmup() -> None:
    assert window_arrivals([0.0, 10.0, 40.0, 305.0], period_s=300.0, warmup_s=30.0) == [10.0, 270.0, 280.0]
