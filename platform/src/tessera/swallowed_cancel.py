"""A background loop's guard against a cancellation that redis-py swallowed.

Python 3.11's ``asyncio.wait_for`` returns the awaited result, instead of raising, when a cancellation lands
as the awaited call completes; redis-py wraps each command's socket write in one (``socket_timeout``). The
cancellation is then gone from the loop's next awaits, and a loop that calls Redis and sleeps goes on for good
while whoever cancelled it waits (a hung `make test`, an engine host that never finishes stopping). The
cancellation is still counted on the task (``Task.cancelling()``: ``wait_for`` never un-cancels it), so a loop
that calls ``raise_if_cancelled`` once an iteration ends at its next turn, as it would have.
"""
from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raises ``CancelledError`` where the running task was cancelled and the cancellation was lost on the way
    (see the module's doc); a no-op otherwise, and outside a task. Call it where a loop's iteration starts, never
    in a ``finally`` or an ``except CancelledError`` that runs its cleanup under a cancellation on purpose."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
