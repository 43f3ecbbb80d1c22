"""uvicorn's ``Server`` for the gateway's workers, waking every two seconds rather than ten times a second.

uvicorn's main loop ticks every 0.1 s, so an idle worker wakes ten times a second (about 1.3 ms/s of CPU on
this project's VMs, more than everything else an idle gateway does). Its tick does three things:

- refreshes the ``date`` header once a second: it still does on every tick here, and between ticks the first
  request head of each new second does (``response_date.py``), so the header is right to the second as
  uvicorn's is;
- notices a shutdown signal (uvicorn's handler only sets ``should_exit``): ``handle_exit`` wakes the loop
  at once here, so a worker starts its graceful shutdown as SIGTERM/SIGINT comes, not at the next tick;
- counts requests for ``limit_max_requests``, which the gateway does not set.

Why two seconds (``SERVER_TICK_S``; one was the period until 2026-12-06): a tick is a wake-up, which on this
project's VMs costs more CPU than the tick's work, and nothing the tick does needs it more often (the metrics
and spans it writes are read every few seconds at best). Side by side at bench-stack's 4 req/s pace, two
workers: ~0.15 ms a request and ~0.25 ms/s idle less (docs/performance.md, section 9). It stays a multiple of
the refreshers' one-second grid, so a busy worker's tick shares their wake-up, and a short loop-stall limit
(under four ticks) brings it back to one second (``tick_period_s``).

It also drives the worker's drain (``drain.py``): the signal itself begins it (``/ready`` goes 503 before
the listening socket closes), and uvicorn's graceful shutdown runs beside the cut at the deadline.

Each tick also writes the requests the worker completed since the last one to its metric series
(``metrics.GatewayMetrics.flush``) and its request spans' lines (``span_lines.SpanLines.flush_from_caller``),
both as the app left them in the lifespan state, and the collector's pauses.

Each tick also beats the worker's loop watchdog (``loop_watchdog.py``): a worker whose loop stops turning
for ``TESSERA_LOOP_STALL_LIMIT_S`` writes its threads' stacks to stderr and exits, and the supervisor starts
a new one. ``LeanWorker.pong`` checks it, in the thread that answers the supervisor's pings; a one-worker
gateway checks from a thread of its own.

The tick falls on the refreshers' grid (``refresher.py``: multiples of the period on the monotonic clock), so
an idle process that still refreshes its caches wakes once for all of them. ``make bench-gateway-cpu``
measures a worker's idle CPU.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_objects
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.supervisors import multiprocess

from tessera.gateway.drain import DRAIN_STATE_KEY, GatewayDrain
from tessera.gateway.loop_watchdog import LoopWatchdog, check_period_s
from tessera.gateway.metrics import FLUSH_STATE_KEY, gc_pause_exporter
from tessera.settings import load_settings
from tessera.telemetry.gc_heap import freeze_startup_heap, process_gc_pauses
from tessera.wake_grid import GRID_S, WakeableSleep, until_next

# A worker's housekeeping period (the date header, metrics, spans, the watchdog's beat), seconds: a multiple of
# the refreshers' grid (wake_grid.py), so a busy worker's tick falls on their wake-up.
SERVER_TICK_S = 2.0


def tick_period_s(stall_limit_s: float) -> float:
    """The tick's period for a loop-stall limit (0: none): SERVER_TICK_S where the watchdog still sees at least four
    beats within the limit, else GRID_S (the period before SERVER_TICK_S grew)."""
    return SERVER_TICK_S if stall_limit_s <= 0 or stall_limit_s / 4 >= SERVER_TICK_S else GRID_S


# uvicorn's ``on_tick`` refreshes the date header when its counter is a multiple of 10 (ten 0.1 s ticks).
_TICKS_PER_DATE = 10
_COUNTER_WRAP = 864_000

logger = logging.getLogger("uvicorn.error")


class LeanServer(uvicorn.Server):
    # Set at startup: writes the collector's pauses since the last call to the workers' histogram
    # (gc_heap.GcPauses.take_pending, metrics.gc_pause_exporter).
    _export_gc_pauses: Callable[[], None] | None = None

    def __init__(self, config: uvicorn.Config, watch_in_thread: bool = True) -> None:
        """``watch_in_thread``: check the loop watchdog from a thread of its own (a gateway of one worker);
        False under uvicorn's supervisor, whose ping thread checks it (``LeanWorker.pong``)."""
        super().__init__(config)
        self.watchdog = LoopWatchdog(load_settings().loop_stall_limit_s)
        self._watch_in_thread = watch_in_thread
        # The tick's sleep, which ``handle_exit`` ends early.
        self._tick_sleep = WakeableSleep()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Once the app has started (its lifespan ran), what the worker holds is its startup heap: frozen, a
        # full collection no longer walks it (gc_heap.py; ~45 ms per collection unfrozen).
        freeze_startup_heap()
        pauses, export = process_gc_pauses(keep_pending=True), gc_pause_exporter()
        self._export_gc_pauses = lambda: export(pauses.take_pending())

    async def main_loop(self) -> None:
        counter = 0
        watchdog = self.watchdog
        watchdog.beat()
        stop_watching = watchdog.watch_in_thread() if self._watch_in_thread else None
        period_s = tick_period_s(watchdog.limit_s)
        try:
            should_exit = await self.on_tick(counter)
            while not should_exit:
                await self._tick_sleep.sleep(until_next(period_s))
                if not self.should_exit:  # a signal came: the watchdog stays down (handle_exit)
                    watchdog.beat()
                counter = (counter + _TICKS_PER_DATE) % _COUNTER_WRAP
                # The collector's pauses since the last tick, written here, in ordinary code (gc_heap.GcPauses).
                if self._export_gc_pauses is not None:
                    self._export_gc_pauses()
                flush = self._lifespan_state().get(FLUSH_STATE_KEY)
                if flush is not None:
                    flush()
                should_exit = await self.on_tick(counter)
        finally:
            # Shutdown ticks no more; the drain's deadline and uvicorn's backstop bound it instead.
            watchdog.disarm()
            if stop_watching is not None:
                stop_watching()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The signal handler: the drain (and its deadline) starts now, and the tick's sleep ends, so uvicorn's
        # graceful shutdown starts now too, not at the next tick.
        self.watchdog.disarm()
        drain = self._drain()
        if drain is not None:
            drain.begin()
        super().handle_exit(sig, frame)
        self._tick_sleep.wake_threadsafe()

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

    def _lifespan_state(self) -> dict[str, Any]:
        """What the app left in the lifespan state at startup (empty before, or for an app without one)."""
        state = getattr(getattr(self, "lifespan", None), "state", None)
        return state if isinstance(state, dict) else {}

    def _drain(self) -> GatewayDrain | None:
        """The app's drain, which it left in the lifespan state at startup (None before, or for another app)."""
        drain = self._lifespan_state().get(DRAIN_STATE_KEY)
        return drain if isinstance(drain, GatewayDrain) else None


class LeanSupervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor of ``--workers`` > 1, which

    - closes its copy of the listening socket before it signals the workers: the socket stays open while
      any process holds it, and a connection then waits in the kernel's backlog, never accepted, until the
      whole gateway exits, instead of being refused at once (a client then retries elsewhere);
    - sleeps until a worker exits, a signal comes, or it is time to ping the workers, where uvicorn's wakes
      every 0.5 s to look (four wake-ups a second, the supervisor's and each worker's ping thread, with two
      idle workers: ~0.8 ms/s of a gateway's ~3 ms/s idle CPU on this project's VMs). A dead worker is
      replaced as soon as it exits, a signal handled as soon as it comes, and the pings, which also check
      each worker's loop (``LeanWorker.pong``), come every ``loop_watchdog.check_period_s``."""

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()

    def run(self) -> None:
        logger.info("Started parent process [%d]", os.getpid())
        self.init_processes()
        period_s = check_period_s(load_settings().loop_stall_limit_s)
        # A signal's handler (uvicorn's: it queues the signal) runs only once the main thread wakes: the
        # interpreter writes each signal's number to this socket, which the sleep below watches.
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        previous_fd = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
        try:
            while not self.should_exit.is_set():
                sentinels = [process.process.sentinel for process in self.processes]
                if wait_for_objects([wake_read, *sentinels], timeout=period_s):
                    _read_all(wake_read)
                self.handle_signals()
                self.keep_subprocess_alive()
        finally:
            signal.set_wakeup_fd(previous_fd)
            wake_read.close()
            wake_write.close()
        self.terminate_all()
        self.join_all()
        logger.info("Stopping parent process [%d]", os.getpid())


def _read_all(sock: socket.socket) -> None:
    """Empties a non-blocking socket (the signals' wake-up bytes: which signals came is uvicorn's queue)."""
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass


class LeanWorker(multiprocess.Process):
    """A worker process of uvicorn's supervisor (``--workers`` > 1) that serves with ``LeanServer``, and
    whose answer to the supervisor's ping (every ``check_period_s``, from a thread of the worker's) also
    checks that the worker's event loop still turns: uvicorn's own answer comes from that thread whatever
    the loop does."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = LeanServer(config=self.config, watch_in_thread=False)
        return self._server

    def target(self, sockets: list[socket.socket] | None = None) -> None:
        # NOTE: made here, before uvicorn's target starts the ping thread: both threads would otherwise make it
        # lazily through ``server`` at once when a ping is already waiting, and the ping thread could keep a
        # second LeanServer that never runs, whose watchdog never beats, and a stuck loop would go unnoticed.
        self.server  # noqa: B018
        super().target(sockets)

    def pong(self) -> None:
        super().pong()
        server = self._server
        if isinstance(server, LeanServer):
            server.watchdog.check()  # a stuck loop: stacks to stderr, exit; the supervisor starts a new worker


__all__ = ["SERVER_TICK_S", "LeanServer", "LeanSupervisor", "LeanWorker", "tick_period_s"]
