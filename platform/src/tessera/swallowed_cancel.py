"""A cancellation that redis-py swallowed: mended where it is lost, and guarded where loops turn.

Python 3.11's ``asyncio.wait_for`` returns the awaited result, instead of raising, when a cancellation lands
as the awaited call completes; redis-py wraps each command's socket write in one (``socket_timeout``), its
only ``wait_for`` on a command's path. The command then goes on to read its reply and returns, the
cancellation is gone from the task's next awaits, and whoever cancelled it waits: a loop that calls Redis and
sleeps went on for good (a hung `make test`, an engine host that never finished stopping), and a request
cancelled by its deadline (``asyncio.timeout``) ran past it. The cancellation is still counted on the task
(``Task.cancelling()``: ``wait_for`` never un-cancels it), which both mends below read.

- At the source: ``connect`` (redis_conn.py) gives its pools connections whose write compares the task's
  count of cancellation requests before and after redis-py's; a rise with no exception is a swallowed one,
  so the connection is dropped (its reply would be read by the next command on it) and ``CancelledError`` is
  raised, as if ``wait_for`` had. Cleanup that runs under a cancellation on purpose (an ``except
  CancelledError`` or ``finally`` that flushes, deregisters) starts with the count already raised, so its
  commands go through.
- At each background loop's turn, ``raise_if_cancelled``: the second line, for a cancellation lost anywhere
  else (another library's ``wait_for``, a connection not made by ``connect``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection


def raise_if_cancelled() -> None:
    """Raises ``CancelledError`` where the running task was cancelled and the cancellation was lost on the way
    (see the module's doc); a no-op otherwise, and outside a task. Call it where a loop's iteration starts, never
    in a ``finally`` or an ``except CancelledError`` that runs its cleanup under a cancellation on purpose."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


Packed = bytes | str | Iterable[bytes]


class RaisesASwallowedCancel(AbstractConnection):
    """Put first among a redis-py connection class's bases: its write raises a cancellation redis-py's own write
    swallowed (see the module's doc), after dropping the connection, whose reply would go to the next command."""

    async def send_packed_command(self, command: Packed, check_health: bool = True) -> None:
        task = asyncio.current_task()
        before = task.cancelling() if task is not None else 0
        await super().send_packed_command(command, check_health)
        if task is not None and task.cancelling() > before:
            await self.disconnect(nowait=True)  # the command's reply is on its way and would go unread
            raise asyncio.CancelledError


class HonouringConnection(RaisesASwallowedCancel, Connection):
    pass


class HonouringSSLConnection(RaisesASwallowedCancel, SSLConnection):
    pass


class HonouringUnixDomainSocketConnection(RaisesASwallowedCancel, UnixDomainSocketConnection):
    pass


# redis-py's connection class for a URL's scheme -> the same connection honouring a swallowed cancellation.
HONOURING: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: HonouringConnection, SSLConnection: HonouringSSLConnection,
    UnixDomainSocketConnection: HonouringUnixDomainSocketConnection}
