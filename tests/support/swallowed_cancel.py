"""A call that swallows a cancellation as Python 3.11's ``asyncio.wait_for`` inside redis-py does, and the check that
a loop cancelled during it still ends (tessera/swallowed_cancel.py): for the tests of every loop that calls Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import pytest
from redis.asyncio.connection import Connection

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


def write_cancelling(monkeypatch: pytest.MonkeyPatch, victim: Callable[[], asyncio.Task[Any] | None]) -> None:
    """redis-py's socket write (the call its ``send_packed_command`` wraps in ``wait_for``) made to cancel the task
    ``victim()`` names as the write completes, once: Python 3.11's real ``wait_for`` then swallows the
    cancellation. Only the moment is arranged; the write, the server and ``wait_for`` are real."""
    real = Connection._send_packed_command
    armed = [True]

    async def write_then_cancel(self: Connection, command: Iterable[bytes]) -> None:
        await real(self, command)
        task = victim()
        if armed[0] and task is not None:
            armed[0] = False
            task.cancel()

    monkeypatch.setattr(Connection, "_send_packed_command", write_then_cancel)
