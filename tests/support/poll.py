"""Waiting for a condition instead of sleeping for a guessed time: poll it until it holds or a deadline
passes, then fail saying what did not happen."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.05) -> None:
    """Returns once ``predicate()`` is truthy; raises ``AssertionError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


async def async_wait_until(predicate: Callable[[], Awaitable[object] | object], timeout_s: float, what: str,
                           every_s: float = 0.05) -> None:
    """``wait_until`` for the event loop: ``predicate`` may be a plain or an async callable."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(every_s)
