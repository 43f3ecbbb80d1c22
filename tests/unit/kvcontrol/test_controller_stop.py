"""Stopping the controller while its supervisor is itself stopping a control loop (an engine that left the
registry): the supervisor's own cancellation is not swallowed with the loop's, so ``stop()`` returns."""

from __future__ import annotations

import asyncio

from tessera_operators.kvcontrol.controller import KVController
from tessera_operators.kvcontrol.settings import KVControlSettings


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
