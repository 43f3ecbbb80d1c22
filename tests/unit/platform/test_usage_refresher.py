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
