"""The gateway workers' uvicorn Server: one housekeeping tick every two seconds (one where a short stall limit
needs it), the date header still refreshed on each, a shutdown signal noticed at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import uvicorn
from uvicorn.supervisors import multiprocess

from tessera.gateway import lean_server
from tessera.gateway.lean_server import LeanServer, LeanWorker
from tessera.gateway.metrics import FLUSH_STATE_KEY


async def test_it_ticks_once_a_second_refreshing_the_date_and_exits_within_a_tick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lean_server, "SERVER_TICK_S", 0.1)  # the same loop, ten times faster
    server = LeanServer(uvicorn.Config(app=lambda *_: None))
    server.server_state.default_headers = []
    counters: list[int] = []
    real_tick = server.on_tick

    async def on_tick(counter: int) -> bool:
        counters.append(counter)
        return await real_tick(counter)

    server.on_tick = on_tick  # type: ignore[method-assign]
    loop = asyncio.ensure_future(server.main_loop())
    await asyncio.sleep(0.45)
    assert 4 <= len(counters) <= 6  # one per tick (uvicorn's loop would have ticked ~45 times at 0.01 s)
    assert all(c % 10 == 0 for c in counters)  # uvicorn refreshes the date header on multiples of 10
    assert [name for name, _ in server.server_state.default_headers] == [b"date"]
    server.should_exit = True
    stopped = time.monotonic()
    await asyncio.wait_for(loop, 1.0)
    assert time.monotonic() - stopped <= 0.1 + 0.05


async def test_each_tick_beats_the_loop_watchdog_and_shutdown_disarms_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lean_server, "SERVER_TICK_S", 0.05)
    server = LeanServer(uvicorn.Config(app=lambda *_: None), watch_in_thread=False)
    server.server_state.default_headers = []
    beats: list[float] = []
    beat = server.watchdog.beat

    def counted_beat() -> None:
        beats.append(time.monotonic())
        beat()

    server.watchdog.beat = counted_beat  # type: ignore[method-assign]
    assert not server.watchdog.armed  # not before the first tick: startup may take its time
    loop = asyncio.ensure_future(server.main_loop())
    await asyncio.sleep(0.3)
    assert len(beats) >= 4 and server.watchdog.armed
    server.handle_exit(15, None)  # SIGTERM: the drain may keep the loop busy, the watchdog stands down
    assert not server.watchdog.armed
    await asyncio.wait_for(loop, 1.0)
    assert not server.watchdog.armed


async def test_each_tick_writes_the_requests_completed_since_the_last_to_the_metrics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lean_server, "SERVER_TICK_S", 0.05)
    server = LeanServer(uvicorn.Config(app=lambda *_: None), watch_in_thread=False)
    server.server_state.default_headers = []
    flushes: list[float] = []
    # What the gateway's lifespan startup leaves (app.py): the metrics' flush, under its key.
    server.lifespan = SimpleNamespace(state={FLUSH_STATE_KEY: lambda: flushes.append(time.monotonic())})
    loop = asyncio.ensure_future(server.main_loop())
    await asyncio.sleep(0.3)
    assert len(flushes) >= 4
    server.should_exit = True
    await asyncio.wait_for(loop, 1.0)


def test_the_ticks_fall_on_the_refreshers_grid() -> None:
    """The refreshers wake at multiples of their period (1 s); every server tick is one of those instants."""
    from tessera.routing.router import REGISTRY_CACHE_S

    for limit_s in (0.0, 2.0, 5.0, 10.0, 60.0):
        assert lean_server.tick_period_s(limit_s) % REGISTRY_CACHE_S == 0


@pytest.mark.parametrize(("limit_s", "period_s"), [(0.0, 2.0), (10.0, 2.0), (8.0, 2.0), (7.9, 1.0), (5.0, 1.0),
                                                   (1.0, 1.0)])
def test_the_tick_beats_at_least_four_times_within_the_stall_limit_where_it_can(limit_s: float,
                                                                                 period_s: float) -> None:
    assert lean_server.tick_period_s(limit_s) == period_s


async def test_a_shutdown_signal_ends_the_ticks_sleep_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lean_server, "tick_period_s", lambda _limit_s: 60.0)  # the next tick a minute away
    server = LeanServer(uvicorn.Config(app=lambda *_: None), watch_in_thread=False)
    server.server_state.default_headers = []
    loop = asyncio.ensure_future(server.main_loop())
    await asyncio.sleep(0.2)
    signalled = time.monotonic()
    server.handle_exit(15, None)  # SIGTERM, as uvicorn's signal handler calls it
    await asyncio.wait_for(loop, 5.0)  # (without the wake-up: the minute's sleep, and a timeout here)
    assert time.monotonic() - signalled < 1.0


def test_a_worker_makes_its_server_before_its_ping_thread_can(monkeypatch: pytest.MonkeyPatch) -> None:
    # Made lazily by both threads at once, the ping thread could keep a server that never runs, whose loop
    # watchdog never beats: a stuck worker was then never replaced.
    worker = LeanWorker(uvicorn.Config(app=lambda *_: None), [])
    when_ping_thread_made: list[object] = []

    class RecordingThread:
        def __init__(self, target: object, daemon: bool) -> None:
            when_ping_thread_made.append(worker._server)

        def start(self) -> None:
            pass

    monkeypatch.setattr(multiprocess, "threading", SimpleNamespace(Thread=RecordingThread))
    ran: list[object] = []
    monkeypatch.setattr(LeanServer, "run", lambda self, sockets=None: ran.append(self))
    worker.target([])
    assert isinstance(when_ping_thread_made[0], LeanServer)
    assert ran == when_ping_thread_made == [worker.server]  # one server: the one that runs is the one pinged
