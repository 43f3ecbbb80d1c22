"""A call that swallows a cancellation as Python 3.11's ``asyncio.wait_for`` inside redis-py does, and the check that
a loop cancelled during it still ends (tessera/swallowed_cancel.py): for the tests of every loop that calls Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

REPLY_IN_FLIGHT_S = 0.2


def swallowing(real: Callable[..., Awaitable[Any]], in_call: asyncio.Event) -> Callable[..., Awaitable[Any]]:
    """``real`` made to swallow a cancellation that lands while its reply is in flight, as ``wait_for`` does."""

    async def call(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)
        in_call.set()
        try:
            await asyncio.sleep(REPLY_IN_FLIGHT_S)
        except asyncio.CancelledError:
            pass  # the result came with the cancellation: wait_for returns it, the cancellation is gone
        return result

    return call


async def cancelled_while_in_call(task: asyncio.Task[Any], in_call: asyncio.Event,
                                  end: Callable[[], None]) -> None:
    """Cancels ``task`` while its call is in flight; asserts the loop ended, cancelled, without a second cancel.
    ``end()`` then stops a loop that went on (so a failure cannot hang the test), and the task is awaited."""
    try:
        await asyncio.wait_for(in_call.wait(), 10)
        task.cancel()
        await asyncio.wait({task}, timeout=3)  # waits without cancelling it again
        assert task.done(), "the loop went on after its cancellation was swallowed"
        assert task.cancelled()
    finally:
        end()
        await asyncio.wait({task}, timeout=5)


def sleeps_raising(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """An ``end`` for a loop that sleeps between its calls: its next sleep raises."""

    async def raising_sleep(*_: Any, **__: Any) -> None:
        raise asyncio.CancelledError

    return lambda: monkeypatch.setattr(asyncio, "sleep", raising_sleep)
