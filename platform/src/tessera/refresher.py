"""Keeps a per-process cache fresh off the request path while requests use it (the gateway's key cache and
model catalog, the router's engine registry).

A cache that refreshes inline on expiry puts a Redis round trip on the request that finds it expired, and at
low request rates that is nearly every request (a 1 s TTL and one request a second). A ``UsageRefresher``
re-reads in the background every ``interval_s`` for as long as the cache was used within ``idle_s``; an idle
gateway leaves Redis alone. The request path still reads inline when the copy is older than its own
bound (the first request, or a refresher that Redis stalls), so staleness stays bounded by the cache's TTL.

Every refresher wakes on a grid of its interval on the monotonic clock (a multiple of ``interval_s``), not
``interval_s`` after its last read: refreshers whose intervals divide each other (the key cache's 0.5 s, the
registry's 1 s, the catalog's 5 s) then come due in the same event-loop iteration, and the process wakes
once for all of them. On this project's VMs a wake-up of an idle process costs about as much CPU as the
Redis call it makes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from tessera.wake_grid import until_next

logger = logging.getLogger(__name__)

# The refresher stops after this long without a request.
REFRESHER_IDLE_S = 10.0
# However short the period asked for, the loop yields this long between reads (a period of 0 must not spin).
MIN_INTERVAL_S = 0.005


class UsageRefresher:
    def __init__(self, name: str, refresh: Callable[[], Awaitable[None]], interval_s: float,
                 idle_s: float = REFRESHER_IDLE_S) -> None:
        self._name = name
        self._refresh = refresh
        self.interval_s = max(interval_s, MIN_INTERVAL_S)
        self._idle_s = idle_s
        self._used_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def used(self) -> None:
        """Called on every cache read: (re)starts the background loop when it is not running (never once
        closed)."""
        self._used_at = time.monotonic()
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        # NOTE: the flag, not only the cancel. On Python 3.11 ``asyncio.wait_for`` (redis-py wraps each socket
        # write in one) can swallow a cancellation that lands as the write completes; the loop then went on
        # until ``idle_s`` passed, and closing a router took ~10 s about one time in fifteen. ``connect``'s
        # connections raise such a cancellation now (swallowed_cancel.py); the flag ends the loop whatever lost it.
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._closed and time.monotonic() - self._used_at < self._idle_s:
            await asyncio.sleep(until_next(self.interval_s))
            if self._closed:
                return
            try:
                await self._refresh()
            except (RedisError, OSError) as exc:
                # The request path notices the copy's age and answers according to the fail mode.
                logger.debug("%s refresh failed: %s", self._name, exc)
