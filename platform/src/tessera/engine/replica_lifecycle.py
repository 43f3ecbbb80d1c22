"""An engine replica's lifecycle, the same for every backend: a host thread with its own event loop that serves
the replica's HTTP endpoint, started, stopped and drained from outside that thread.

``ThreadedReplicaHost`` is the base of ``EngineHost`` (engine/host.py, vLLM) and ``SimReplicaHost``
(engine/sim/serve_replica.py, the simulated engine). It owns:

  - the HTTP port, reserved when the host is made and held until the server listens on it (ports.py);
  - the host thread: a uvloop loop that runs the subclass's ``_serve`` and records why it could not start;
  - ``start`` (returns once the endpoint listens, or raises why it did not), ``stop`` and ``drain``
    (out of the registry, the open requests finished up to a deadline, then stopped: drain.py);
  - the HTTP server and the loops beside it (``_serve_http``): on the way out they end before the replica
    leaves the registry (heartbeat.py).

What differs is left to the subclass: ``_serve`` (make the engine, then ``_serve_http``), ``_background``
(the loops beside the server), ``_close_in_loop`` (what must be closed inside the loop once it has served)
and ``_start_error`` (how a failed start is reported).

NOTE: nothing this module imports loads vLLM: the simulated replica, which never loads it, shares it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, Self

import uvicorn
import uvloop

from tessera.asgi import Receive, Scope, Send
from tessera.engine.config import EngineConfig
from tessera.engine.drain import DrainOutcome, drain
from tessera.engine.heartbeat import deregister
from tessera.engine.in_flight import InFlightRequests
from tessera.engine.ports import reserve_port
from tessera.settings import load_settings

logger = logging.getLogger(__name__)

# How long a stopping replica waits for its cancelled loops before it leaves the registry anyway, seconds.
BACKGROUND_EXIT_TIMEOUT_S = 5.0


async def _end(tasks: list[asyncio.Task[None]]) -> None:
    """Cancels ``tasks`` and waits at most BACKGROUND_EXIT_TIMEOUT_S for them. NOTE: bounded: Python 3.11's
    ``asyncio.wait_for`` (inside redis-py) can swallow a cancellation, and a loop that ran on kept a stopped
    replica in the registry past its owner's join (make test, test_precise_routing)."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=BACKGROUND_EXIT_TIMEOUT_S)
    for task in pending:
        logger.warning("replica loop %s did not end within %.0f s of its cancellation", task.get_name(),
                       BACKGROUND_EXIT_TIMEOUT_S)

__all__ = ["ThreadedReplicaHost"]

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ThreadedReplicaHost(abc.ABC):
    """One replica's host thread, HTTP server and registry exit; subclasses bring the engine."""

    kind: ClassVar[str] = "engine"  # what the replica is called in errors and logs
    in_flight: InFlightRequests  # the requests open here (a drain waits for them); set by the subclass

    def __init__(self, config: EngineConfig, redis_url: str | None, engine_id: str, advertise_host: str) -> None:
        self.config = config
        self.redis_url = redis_url
        self.engine_id = engine_id
        self.advertise_host = advertise_host
        # The replica's HTTP endpoint and its KV-event publisher listen on the address it is called at (the pod
        # IP in the chart, loopback locally), never on every interface, unless the config says so.
        self.bind_host = config.http_host or advertise_host
        # Held from here until the server listens on it (see reserve_port).
        self._http_socket = (reserve_port(self.bind_host, f"{config.http_port}-{config.http_port}")
                             if config.http_port else
                             reserve_port(self.bind_host, os.environ.get("TESSERA_ENGINE_PORT_RANGE")))
        self.port = int(self._http_socket.getsockname()[1])
        self.kv_events_port = 0  # where the replica publishes its KV events, 0 where it does not
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the host thread's loop, once it runs
        self._background_tasks: list[asyncio.Task[None]] = []  # heartbeat, index feed, ...: see _background
        # Set as the replica leaves the registry (a drain's first step): its heartbeat beats no more
        # (heartbeat.py ``leaving``), whether or not its loop saw the cancellation.
        self.leaving = False

    # ---- what the replica is ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.advertise_host}:{self.kv_events_port}" if self.kv_events_port else ""

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> Self:
        """Starts the host thread; returns once the endpoint listens (raises why it did not)."""
        self._thread = threading.Thread(target=self._thread_main, name=f"tessera-{self.engine_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self.kind} {self.engine_id} did not start within {timeout_s} s")
        if self._startup_error is not None:
            raise self._start_error(self._startup_error) from self._startup_error
        return self

    def stop(self, force: bool = False) -> None:
        """Stops the server: it closes its socket and finishes the responses under way (``force``: cuts them)."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = force
        if self._thread is not None:
            self._thread.join(timeout=30)

    def drain(self, timeout_s: float | None = None) -> DrainOutcome | None:
        """Leaves the registry, finishes the open requests (at most ``timeout_s``, default the config's
        drainTimeoutS) and stops (drain.py). Blocks the caller; None where the host was not running."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive() or self._server is None:
            self.stop()
            return None
        max_age_s = load_settings().registry_max_age_s
        running = asyncio.run_coroutine_threadsafe(
            drain(lambda: len(self.in_flight), self._leave_registry, max_age_s, timeout_s), loop)
        outcome = running.result(timeout=timeout_s + 30)
        if outcome.drained:
            logger.info("%s %s drained in %.1f s", self.kind, self.engine_id, outcome.waited_s)
        else:
            logger.warning("%s %s: drain timed out after %.1f s (drainTimeoutS) with %d requests open; "
                           "they are cut", self.kind, self.engine_id, outcome.waited_s, outcome.num_cut)
        self.stop(force=not outcome.drained)
        return outcome

    async def _leave_registry(self) -> None:
        """Leaves the registry and prefix index at once, and the background loops end (no heartbeat, index feed
        or speculation control after this); once they have (or the wait for them gave up), it leaves again: a
        beat already on its way when they were told to stop registers the replica anew. Waiting for the loops
        first kept a drained replica in the registry for as long as one ignored its cancellation (Python 3.11's
        ``asyncio.wait_for`` inside redis-py can swallow one) and went on beating."""
        self.leaving = True  # the heartbeat beats no more from here, cancelled or not
        if self.redis_url:
            await deregister(self.redis_url, self.engine_id)
        await _end(self._background_tasks)
        if self.redis_url:
            await deregister(self.redis_url, self.engine_id)

    def _thread_main(self) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._startup_error = self._startup_error or exc
            logger.exception("%s host %s stopped with an error", self.kind, self.engine_id)
        finally:
            self._ready.set()
            self._http_socket.close()  # no-op once the server owns and closed it
            loop.run_until_complete(self._close_in_loop())
            loop.close()

    async def _serve_http(self, app: ASGIApp, side_tasks: list[asyncio.Task[None]]) -> None:
        """Serves ``app`` on the reserved socket until stopped, with the ``_background`` loops beside it; on the
        way out those and ``side_tasks`` end, then the replica leaves the registry."""
        # NOTE: uvicorn installs no signal handlers off the main thread: the host's owner handles signals.
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=self.bind_host, port=self.port, loop="none", http="httptools", log_level="warning",
            access_log=False, lifespan="off", timeout_keep_alive=300, interface="asgi3", proxy_headers=False))
        self._background_tasks = [asyncio.create_task(coro) for coro in self._background()]
        tasks = [asyncio.create_task(self._ready_when_listening()), *side_tasks, *self._background_tasks]
        try:
            await self._server.serve(sockets=[self._http_socket])
        finally:
            self.leaving = True
            await _end(tasks)
            if self.redis_url:
                await deregister(self.redis_url, self.engine_id)

    async def _ready_when_listening(self) -> None:
        assert self._server is not None
        while not self._server.started:
            await asyncio.sleep(0.02)
        self._ready.set()

    # ---- what a backend brings -------------------------------------------------------------------

    @abc.abstractmethod
    async def _serve(self) -> None:
        """Runs in the host thread's loop: makes the engine, then serves (``_serve_http``) until stopped; an
        exception before the endpoint listens is the start-up error ``start`` raises."""

    @abc.abstractmethod
    def _background(self) -> list[Coroutine[Any, Any, None]]:
        """The loops that run beside the server (registry heartbeat, prefix-index feed, ...)."""

    async def _close_in_loop(self) -> None:
        """What must be closed inside the host thread's loop once ``_serve`` has returned or raised."""
        return None  # nothing by default

    def _start_error(self, cause: BaseException) -> Exception:
        """The error ``start`` raises (from ``cause``) when ``_serve`` failed before the endpoint listened."""
        return RuntimeError(f"{self.kind} {self.engine_id} could not start: {cause!r}")
