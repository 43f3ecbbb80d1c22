"""wake_grid.py: the grid's instants, and a sleep that a shutdown ends early."""

from __future__ import annotations

import asyncio
import math
import threading
import time

from tessera.wake_grid import GRID_S, WakeableSleep, until_next


def test_until_next_lands_on_a_multiple_of_the_period() -> None:
    for period_s in (0.5, GRID_S, 2.0):
        before = time.monotonic()
        delay = until_next(period_s)
        after = time.monotonic()
        assert 0 < delay <= period_s
        # The clock was read between ``before`` and ``after``: a multiple of the period lies in that window + delay.
        multiple = math.floor((after + delay) / period_s) * period_s
        assert before + delay - 1e-6 <= multiple <= after + delay + 1e-6


async def test_a_sleep_lasts_its_delay_unless_woken() -> None:
    sleep = WakeableSleep()
    started = time.monotonic()
    await sleep.sleep(0.05)
    assert time.monotonic() - started >= 0.04
    sleeper = asyncio.create_task(sleep.sleep(30.0))
    await asyncio.sleep(0.01)
    sleep.wake()
    await asyncio.wait_for(sleeper, 1.0)


async def test_a_signal_handler_or_another_thread_ends_it() -> None:
    sleep = WakeableSleep()
    sleep.wake_threadsafe()  # before any sleep: nothing to end
    sleeper = asyncio.create_task(sleep.sleep(30.0))
    await asyncio.sleep(0.01)
    threading.Thread(target=sleep.wake_threadsafe).start()
    await asyncio.wait_for(sleeper, 1.0)
