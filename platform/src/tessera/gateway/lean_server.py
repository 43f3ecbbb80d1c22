"""uvicorn's ``Server`` for the gateway's workers, waking once a second rather than ten times.

uvicorn's main loop ticks every 0.1 s, so an idle worker wakes ten times a second (about 1.3 ms/s of CPU on
this project's VMs, more than everything else an idle gateway does). Its tick does three things:

- refreshes the ``date`` header once a second: it still does, on every tick here, so the header is right to
  the second as uvicorn's is;
- notices a shutdown signal (uvicorn's handler only sets ``should_exit``): a worker now starts its graceful
  shutdown within ``SERVER_TICK_S`` of SIGTERM/SIGINT instead of 0.1 s;
- counts requests for ``limit_max_requests``, which the gateway does not set.

It also drives the worker's drain (``drain.py``): the signal itself begins it (``/ready`` goes 503 before
the listening socket closes), and uvicorn's graceful shutdown runs beside the cut at the deadline.

The tick falls on the refreshers' grid (``refresher.py``: multiples of the period on the monotonic clock), so
an idle process that still refreshes its caches wakes once for all of them. ``make bench-gateway-cpu``
measures a worker's idle CPU.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from uvicorn.supervisors import multiprocess

from tessera.gateway.drain import DRAIN_STATE_KEY, GatewayDrain
from tessera.gateway.metrics import gc_pause_exporter
from tessera.telemetry.gc_heap import freeze_startup_heap, process_gc_pauses

# A worker's housekeeping period (the date header, the shutdown check), seconds.
SERVER_TICK_S = 1.0
# uvicorn's ``on_tick`` refreshes the date header when its counter is a multiple of 10 (ten 0.1 s ticks).
_TICKS_PER_DATE = 10
_COUNTER_WRAP = 864_000


class LeanServer(uvicorn.Server):
    # Set at startup: writes the collector's pauses since the last call to the workers' histogram
    # (gc_heap.GcPauses.take_pending, metrics.gc_pause_exporter).
    _export_gc_pauses: Callable[[], None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Once the app has started (its lifespan ran), what the worker holds is its startup heap: frozen, a
        # full collection no longer walks it (gc_heap.py; ~45 ms per collection unfrozen).
        freeze_startup_heap()
        pauses, export = process_gc_pauses(keep_pending=True), gc_pause_exporter()
        self._export_gc_pauses = lambda: export(pauses.take_pending())

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            await asyncio.sleep(SERVER_TICK_S - time.monotonic() % SERVER_TICK_S)
            counter = (counter + _TICKS_PER_DATE) % _COUNTER_WRAP
            # The collector's pauses since the last tick, written here, in ordinary code (gc_heap.GcPauses).
            if self._export_gc_pauses is not None:
                self._export_gc_pauses()
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The signal handler: the drain (and its deadline) starts now, not at the next tick.
        drain = self._drain()
        if drain is not None:
            drain.begin()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown (stop accepting, let open responses finish, lifespan shutdown), with
        the drain's cut at its deadline running beside it."""
        drain = self._drain()
        if drain is None:
            await super().shutdown(sockets)
            return
        drain.begin()
        cutter = asyncio.create_task(drain.cut_at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            cutter.cancel()

    def _drain(self) -> GatewayDrain | None:
        """The app's drain, which it left in the lifespan state at startup (None before, or for another app)."""
        state = getattr(getattr(self, "lifespan", None), "state", None)
        drain = state.get(DRAIN_STATE_KEY) if isinstance(state, dict) else None
        return drain if isinstance(drain, GatewayDrain) else None


class LeanSupervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor of ``--workers`` > 1, which closes its copy of the listening socket before it
    signals the workers: the socket stays open while any process holds it, and a connection then waits in
    the kernel's backlog, never accepted, until the whole gateway exits, instead of being refused at once
    (a client then retries elsewhere)."""

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()


class LeanWorker(multiprocess.Process):
    """A worker process of uvicorn's supervisor (``--workers`` > 1) that serves with ``LeanServer``."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = LeanServer(config=self.config)
        return self._server


__all__ = ["SERVER_TICK_S", "LeanServer", "LeanSupervisor", "LeanWorker"]
