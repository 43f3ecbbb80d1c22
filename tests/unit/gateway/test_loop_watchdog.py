"""The loop watchdog (gateway/loop_watchdog.py): the decision, and a real event loop that stops turning."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tessera.gateway.loop_watchdog import MAX_CHECK_PERIOD_S, LoopWatchdog, beat_to_judge, check_period_s, is_stalled


@pytest.mark.parametrize(("last_beat", "now", "limit_s", "stalled"), [
    (None, 100.0, 10.0, False),  # not armed: before the first tick, or shutting down
    (95.0, 100.0, 10.0, False),
    (90.0, 100.0, 10.0, False),  # exactly the limit: not yet
    (89.9, 100.0, 10.0, True),
    (0.0, 100.0, 0.0, False),  # a limit of 0 turns the watchdog off
])
def test_is_stalled(last_beat: float | None, now: float, limit_s: float, stalled: bool) -> None:
    assert is_stalled(last_beat, now, limit_s) is stalled


@pytest.mark.parametrize(("last_beat", "last_check", "now", "judged"), [
    (None, 99.5, 100.0, None),  # not armed
    (90.0, None, 100.0, 90.0),  # the first check
    (90.0, 99.5, 100.0, 90.0),  # the checker runs on time: the loop is judged by its own beat
    (90.0, 95.0, 100.0, 90.0),  # a checker late by half the limit: still on time
    (90.0, 94.0, 100.0, 100.0),  # the checker itself was off the CPU for 6 s: the process was starved
])
def test_a_starved_process_is_not_taken_for_a_stuck_loop(last_beat: float | None, last_check: float | None,
                                                         now: float, judged: float | None) -> None:
    assert beat_to_judge(last_beat, last_check, now, limit_s=10.0) == judged


def test_a_stall_is_reported_once_and_a_disarmed_watchdog_reports_none() -> None:
    now = [0.0]
    stalls: list[float] = []
    watchdog = LoopWatchdog(2.0, on_stall=lambda stalled_s, _limit: stalls.append(stalled_s), clock=lambda: now[0])
    assert not watchdog.check()
    watchdog.beat()
    for now[0] in (0.5, 1.0, 1.5, 2.0):  # the checker every 0.5 s, as the supervisor's pings come
        assert not watchdog.check()
    now[0] = 2.5
    assert watchdog.check() and stalls == [2.5]
    now[0] = 3.0
    assert not watchdog.check(), "one report per stall"
    watchdog.beat()
    watchdog.disarm()
    now[0] = 20.0
    assert not watchdog.check() and stalls == [2.5]


def test_a_process_off_the_cpu_gets_a_full_limit_when_it_is_back() -> None:
    now = [0.0]
    stalls: list[float] = []
    watchdog = LoopWatchdog(2.0, on_stall=lambda stalled_s, _limit: stalls.append(stalled_s), clock=lambda: now[0])
    watchdog.beat()
    assert not watchdog.check()
    now[0] = 8.0  # neither the loop nor the checker ran for 8 s
    assert not watchdog.check()
    for now[0] in (8.5, 9.0, 9.5, 10.0):
        assert not watchdog.check()
    now[0] = 10.5  # the checker ran on time since, and the loop never beat: stuck
    assert watchdog.check() and stalls == [2.5]


def test_a_loop_blocked_past_the_limit_is_caught_from_the_watch_thread() -> None:
    """A real loop beating every 50 ms, then stuck in a blocking call: the watchdog's own thread reports the
    stall (with the limit at 0.5 s) while the loop is still stuck, and not before."""
    stalls: list[tuple[float, float]] = []
    reported = threading.Event()

    def on_stall(stalled_s: float, limit_s: float) -> None:
        stalls.append((stalled_s, limit_s))
        reported.set()

    watchdog = LoopWatchdog(0.5, on_stall=on_stall)

    async def serve() -> bool:
        stop = watchdog.watch_in_thread()
        try:
            for _ in range(20):  # 1 s of a loop that turns: no report
                watchdog.beat()
                await asyncio.sleep(0.05)
            assert not reported.is_set()
            watchdog.beat()
            # The loop is stuck here (the fault under test), until the watchdog reports it: 10 s at most.
            return reported.wait(10)
        finally:
            stop()

    assert asyncio.run(serve()), "the stall was not reported while the loop was stuck"
    assert len(stalls) == 1 and stalls[0][1] == 0.5 and 0.5 < stalls[0][0] < 10


@pytest.mark.parametrize(("limit_s", "period_s"), [(10.0, 2.5), (5.0, 1.25), (0.5, 0.125), (60.0, MAX_CHECK_PERIOD_S),
                                                   (0.0, MAX_CHECK_PERIOD_S)])
def test_checks_come_a_quarter_of_the_limit_apart_and_at_most_the_cap(limit_s: float, period_s: float) -> None:
    assert check_period_s(limit_s) == period_s


@pytest.mark.parametrize("limit_s", [0.2, 2.0, 5.0, 10.0, 30.0])
def test_checks_come_well_within_half_the_limit(limit_s: float) -> None:
    # beat_to_judge takes a check more than half a limit after the last for a starved process: a stall
    # would then never be caught.
    assert check_period_s(limit_s) < limit_s / 2
