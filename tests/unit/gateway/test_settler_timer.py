"""The settler's timer (gateway/settler.py ``next_pass_in``): a pass falls on the server tick's grid, where the
process already wakes, within the jittered interval."""

from __future__ import annotations

import math

import pytest

from tessera.gateway.lean_server import SERVER_TICK_S
from tessera.gateway.settler import next_pass_in
from tessera.wake_grid import instant_at_or_after


@pytest.mark.parametrize("now", [0.0, 0.25, 1234.5678, 98765.999999])
@pytest.mark.parametrize("fraction", [0.5, 0.73, 0.999])
def test_a_pass_falls_on_the_grid_within_the_interval_and_a_step(now: float, fraction: float) -> None:
    wait = next_pass_in(now, 5.0, fraction)
    at = now + wait
    assert abs(at - round(at / SERVER_TICK_S) * SERVER_TICK_S) < 1e-6  # on the tick's grid
    assert 5.0 * fraction - 1e-9 <= wait < 5.0 * fraction + SERVER_TICK_S


def test_an_interval_shorter_than_the_grid_is_its_own_step() -> None:  # (tests' settlers)
    wait = next_pass_in(10.03, 0.1, 0.5)
    assert 0.05 <= wait < 0.15 and math.isclose((10.03 + wait) / 0.1, round((10.03 + wait) / 0.1), abs_tol=1e-6)


def test_two_workers_drawing_apart_ask_at_different_ticks_about_half_the_time() -> None:
    # The draw spreads a pass over the ticks of half the interval (2.5-5 s of 5 s: 102.7-105.2, two ticks).
    instants = [round(100.2 + next_pass_in(100.2, 5.0, f / 100)) for f in range(50, 100)]
    assert sorted(set(instants)) == [104, 106]
    assert max(instants.count(i) for i in set(instants)) <= 35


@pytest.mark.parametrize(("at", "period", "expected"), [(4.0, 2.0, 4.0), (4.1, 2.0, 6.0), (0.03, 0.1, 0.1)])
def test_the_grids_instant_at_or_after_a_time(at: float, period: float, expected: float) -> None:
    assert instant_at_or_after(at, period) == pytest.approx(expected)
