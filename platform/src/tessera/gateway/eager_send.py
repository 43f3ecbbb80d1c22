"""Calling an ASGI ``send`` from a synchronous callback, without a task in between.

The gateway relays each engine delta from inside the engine connection's ``data_received`` callback (see
``http_wire.StreamResponse.relay``), where nothing can be awaited. ASGI's ``send`` is a coroutine, but
uvicorn's completes without suspending unless the client's socket buffer is full (it then waits for the
transport to drain before writing). So the coroutine is run on the spot, as Python 3.12's eager tasks run
a task's first step: in the usual case it finishes there and nothing else happens; when it suspends, the
rest of it continues as a task and the caller gets that task to wait on (and stops reading the engine).
A task per chunk would cost a future, a scheduled wakeup and one more event-loop iteration per token.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any


def send_now(coro: Awaitable[None]) -> asyncio.Future[None] | None:
    """Runs ``coro`` until it returns or first suspends. None: it returned. Otherwise a task that runs
    the rest of it. An exception it raises before suspending is raised here. (An awaitable that is not a
    coroutine, which an ASGI server may return, simply becomes a task.)"""
    # The exact type first: the ABC's isinstance costs more, once per streamed chunk.
    if type(coro) is not types.CoroutineType and not isinstance(coro, Coroutine):
        return asyncio.ensure_future(coro)
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_rest(coro, yielded))


async def _rest(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    await _resume(coro, yielded)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, None], yielded: Any) -> Generator[Any, Any, None]:
    """Hands what ``coro`` yielded (a future it waits on) to the task running this, and feeds the task's
    answers (results, exceptions, cancellation) back into ``coro`` until it returns."""
    while True:
        try:
            value = yield yielded
        except BaseException as exc:  # every exception, cancellation too, belongs to coro
            try:
                yielded = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                yielded = coro.send(value)
            except StopIteration:
                return
