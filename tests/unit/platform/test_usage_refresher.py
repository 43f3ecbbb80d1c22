"""UsageRefresher: refreshes while used, stops when idle, survives a failing Redis, restarts on use."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.refresher import MIN_INTERVAL_S, UsageRefresher


class CountingRefresh:
    """A refresh that only counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


async def test_it_refreshes_while_used_and_stops_when_idle() -> None:
    counter = CountingRefresh()
    refresher = UsageRefresher("test", counter, interval_s=0.02, idle_s=0.2)
    assert not refresher.running  # nothing runs before the first use
    refresher.used()
    await asyncio.sleep(0.1)
    assert refresher.running and counter.calls >= 1
    for _ in range(200):  # stops on its own once unused for idle_s
        if not refresher.running:
            break
        await asyncio.sleep(0.02)
    assert not refresher.running
    stopped_at = counter.calls
    await asyncio.sleep(0.1)
    assert counter.calls == stopped_at
    refresher.used()  # the next use starts it again
    await asyncio.sleep(0.1)
    assert refresher.running and counter.calls > stopped_at
    await refresher.close()
    assert not refresher.running


async def test_a_failing_refresh_does_not_end_the_loop() -> None:
    outcomes: list[str] = []

    async def refresh() -> None:
        if len(outcomes) < 2:
            outcomes.append("failed")
            raise RedisConnectionError("redis went away")
        outcomes.append("ok")

    refresher = UsageRefresher("test", refresh, interval_s=0.01, idle_s=5.0)
    refresher.used()
    for _ in range(200):
        if "ok" in outcomes:
            break
        await asyncio.sleep(0.01)
    await refresher.close()
    assert outcomes[:3] == ["failed", "failed", "ok"]


async def test_a_zero_period_does_not_spin() -> None:
    counter = CountingRefresh()
    refresher = UsageRefresher("test", counter, interval_s=0.0, idle_s=5.0)
    refresher.used()
    await asyncio.sleep(0.1)
    await refresher.close()
    assert 1 <= counter.calls <= 0.1 / MIN_INTERVAL_S + 1


class SwallowingRefresh:
    """A refresh whose await swallows one cancellation, as Python 3.11's ``asyncio.wait_for`` can when the
    awaited write completes as the cancel lands (redis-py wraps its socket writes in one)."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = asyncio.Event()

    async def __call__(self) -> None:
        self.calls += 1
        self.entered.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # swallowed: the task goes on as if nothing happened


async def test_close_stops_the_loop_even_when_a_refresh_swallows_the_cancellation() -> None:
    refresh = SwallowingRefresh()
    refresher = UsageRefresher("test", refresh, interval_s=0.01, idle_s=30.0)
    refresher.used()
    await asyncio.wait_for(refresh.entered.wait(), 5)
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(refresher.close(), 5)  # without the closed flag: the loop runs on for idle_s
    assert asyncio.get_running_loop().time() - started < 1.0 and not refresher.running
    calls = refresh.calls
    refresher.used()  # a late request after close starts nothing
    await asyncio.sleep(0.05)
    assert refresh.calls == calls and not refresher.running
