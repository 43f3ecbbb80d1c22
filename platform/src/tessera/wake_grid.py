"""The instants a process's periodic work shares: whole multiples of a period on the monotonic clock.

On this project's VMs a process pays 90-220 µs of CPU for each wake-up (docs/performance.md section 9,
"Wake-ups"), more than most of the work it wakes for. So a gateway worker's periodic work does not keep timers
of its own phase: the cache refreshers wake at multiples of their intervals (0.5, 1 and 5 s), the server's tick
and the settler every two seconds, and the lean Redis connection reads its unhurried replies by the next whole
second, all of them instants of one grid, where one wake-up serves them all.
"""

from __future__ import annotations

import asyncio
import time

# The grid's step: the whole seconds every period above is a multiple or a divisor of.
GRID_S = 1.0


def until_next(period_s: float) -> float:
    """Seconds from now to the next multiple of ``period_s`` on the monotonic clock (``period_s`` > 0)."""
    return period_s - time.monotonic() % period_s


def instant_at_or_after(at_s: float, period_s: float) -> float:
    """The grid's first multiple of ``period_s`` at or after ``at_s`` (monotonic seconds; ``period_s`` > 0): where a
    timer that must wait at least until ``at_s`` goes off (``until_next`` is the next one after now)."""
    return at_s + (-at_s % period_s)


class WakeableSleep:
    """A sleep on the event loop that ``wake`` ends early (from the loop's thread; ``wake_threadsafe`` from a
    signal handler or another thread): a server's tick that a shutdown must not wait out."""

    __slots__ = ("_loop", "_wake")

    def __init__(self) -> None:
        self._wake: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def sleep(self, delay_s: float) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._wake = wake = loop.create_future()
        timer = loop.call_later(delay_s, _resolve, wake)
        try:
            await wake
        finally:
            timer.cancel()

    def wake(self) -> None:
        if self._wake is not None:
            _resolve(self._wake)

    def wake_threadsafe(self) -> None:
        if self._wake is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_resolve, self._wake)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
