"""uvicorn's ``Server`` for the gateway's workers, waking once a second rather than ten times.

uvicorn's main loop ticks every 0.1 s, so an idle worker wakes ten times a second (about 1.3 ms/s of CPU on
this project's VMs, more than everything else an idle gateway does). Its tick does three things:

- refreshes the ``date`` header once a second: it still does, on every tick here, so the header is right to
  the second as uvicorn's is;
- notices a shutdown signal (uvicorn's handler only sets ``should_exit``): a worker now starts its graceful
  shutdown within ``SERVER_TICK_S`` of SIGTERM/SIGINT instead of 0.1 s;
- counts requests for ``limit_max_requests``, which the gateway does not set.

The tick falls on the refreshers' grid (``refresher.py``: multiples of the period on the monotonic clock), so
an idle process that still refreshes its caches wakes once for all of them. ``make bench-gateway-cpu``
measures a worker's idle CPU.
"""

from __future__ import annotations

import asyncio
import time

import uvicorn
from uvicorn.supervisors import multiprocess

# A worker's housekeeping period (the date header, the shutdown check), seconds.
SERVER_TICK_S = 1.0
# uvicorn's ``on_tick`` refreshes the date header when its counter is a multiple of 10 (ten 0.1 s ticks).
_TICKS_PER_DATE = 10
_COUNTER_WRAP = 864_000


class LeanServer(uvicorn.Server):
    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            await asyncio.sleep(SERVER_TICK_S - time.monotonic() % SERVER_TICK_S)
            counter = (counter + _TICKS_PER_DATE) % _COUNTER_WRAP
            should_exit = await self.on_tick(counter)


class LeanWorker(multiprocess.Process):
    """A worker process of uvicorn's supervisor (``--workers`` > 1) that serves with ``LeanServer``."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = LeanServer(config=self.config)
        return self._server


__all__ = ["SERVER_TICK_S", "LeanServer", "LeanWorker"]
