"""Stopping the controller while its supervisor is itself stopping a control loop (an engine that left the
registry): the supervisor's own cancellation is not swallowed with the loop's, so ``stop()`` returns; nor when a
Redis call of the supervisor or of a control loop swallowed it (tessera/swallowed_cancel.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tessera.redis_conn import EmbeddedRedis
from tessera.registry import EngineRecord
from tessera_operators.kvcontrol.controller import KVController
from tessera_operators.kvcontrol.loop import EngineControlLoop
from tessera_operators.kvcontrol.settings import KVControlSettings
from tests.support.swallowed_cancel import cancelled_while_in_call, sleeps_raising, swallowing


async def _slow_to_stop() -> None:
    try:
        await asyncio.sleep(100)
    finally:
        await asyncio.sleep(0.2)  # a loop releasing its flags takes a moment


def test_a_caller_cancelled_while_it_stops_a_loop_is_cancelled() -> None:
    async def scenario() -> tuple[bool, bool]:
        controller = KVController(KVControlSettings(redis_url="redis://127.0.0.1:1/0"))
        controller.loops["e1"] = object()  # type: ignore[assignment]
        loop_task = asyncio.create_task(_slow_to_stop())
        controller._tasks["e1"] = loop_task
        await asyncio.sleep(0)
        stopper = asyncio.create_task(controller._stop_loop("e1"))
        await asyncio.sleep(0.05)  # the stopper waits on the loop's release
        stopper.cancel()
        try:
            await asyncio.wait_for(stopper, 5)
        except asyncio.CancelledError:
            pass
        return stopper.cancelled(), loop_task.done()

    assert asyncio.run(scenario()) == (True, True)


def test_stopping_a_loop_on_its_own_ends_it_quietly() -> None:
    async def scenario() -> bool:
        controller = KVController(KVControlSettings(redis_url="redis://127.0.0.1:1/0"))
        controller.loops["e1"] = object()  # type: ignore[assignment]
        controller._tasks["e1"] = asyncio.create_task(_slow_to_stop())
        await asyncio.sleep(0)
        await controller._stop_loop("e1")  # no exception: the loop's cancellation ends there
        return "e1" not in controller.loops and not controller._tasks

    assert asyncio.run(scenario())


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = EmbeddedRedis().start()
    yield server.url
    server.stop()


async def test_the_supervisor_ends_though_a_discovery_swallowed_its_cancellation(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop()`` cancels the supervisor and waits for it: a discovery whose Redis call swallowed the
    cancellation (swallowed_cancel.py) left the controller's shutdown waiting for good."""
    controller = await KVController(KVControlSettings(redis_url=redis_url,
                                                      kvcontrol_discovery_interval_s=0.05)).start()
    in_call = asyncio.Event()
    monkeypatch.setattr(controller, "discover", swallowing(controller.discover, in_call))
    assert controller._supervisor is not None
    try:
        await cancelled_while_in_call(controller._supervisor, in_call, sleeps_raising(monkeypatch))
    finally:
        monkeypatch.undo()
        await controller.stop()


async def test_a_control_loop_ends_though_a_tick_swallowed_its_cancellation(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    controller = await KVController(KVControlSettings(redis_url=redis_url, kvcontrol_poll_interval_s=0.05)).start()
    assert controller.ctx is not None
    loop = EngineControlLoop(EngineRecord("swallowed-0", "http://127.0.0.1:1", "m", 32, 100, 2048), controller.ctx)

    async def quiet_tick() -> list[object]:
        return []  # the tick's own calls are beside the point: one swallows the cancellation, as below

    in_call = asyncio.Event()
    monkeypatch.setattr(loop, "tick", swallowing(quiet_tick, in_call))
    try:
        await cancelled_while_in_call(asyncio.create_task(loop._control()), in_call, sleeps_raising(monkeypatch))
    finally:
        monkeypatch.undo()
        await controller.stop()
