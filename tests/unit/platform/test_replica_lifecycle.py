"""The replica lifecycle every engine host shares (engine/replica_lifecycle.py), with a backend that is only a
tiny ASGI app: start returns once the endpoint listens, a failed start says why and frees the port, the loops
beside the server end before the loop closes, and a drain cuts what is still open at its deadline."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import httpx
import pytest

from tessera.asgi import Receive, Scope, Send, respond_json
from tessera.engine.config import EngineConfig
from tessera.engine.in_flight import InFlightRequests
from tessera.engine.ports import reserve_port
from tessera.engine.replica_lifecycle import ThreadedReplicaHost


class ToyHost(ThreadedReplicaHost):
    kind = "toy engine"

    def __init__(self, fail_with: BaseException | None = None) -> None:
        super().__init__(EngineConfig(model="/m"), redis_url=None, engine_id="toy-0", advertise_host="127.0.0.1")
        self.in_flight = InFlightRequests()
        self.fail_with = fail_with
        self.events: list[str] = []
        self.closed_in_loop = threading.Event()

    async def _serve(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        await self._serve_http(self._app, [])

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond_json(send, 200, {"engine_id": self.engine_id})

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._beside()]

    async def _beside(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.events.append("background ended")

    async def _close_in_loop(self) -> None:
        asyncio.get_running_loop()  # raises outside a running loop
        self.events.append("closed in loop")
        self.closed_in_loop.set()


def test_start_returns_once_the_endpoint_listens_and_stop_ends_the_loops_first() -> None:
    host = ToyHost().start(timeout_s=10)
    try:
        assert httpx.get(f"{host.url}/anything", timeout=5).json() == {"engine_id": "toy-0"}
        assert host.kv_events_endpoint == ""
    finally:
        host.stop()
    assert host.closed_in_loop.is_set()
    assert host.events == ["background ended", "closed in loop"]
    reserve_port("127.0.0.1", f"{host.port}-{host.port}").close()  # raises while the port is held


def test_a_failed_start_names_the_replica_and_its_cause_and_frees_the_port() -> None:
    host = ToyHost(fail_with=ValueError("no such model"))
    with pytest.raises(RuntimeError, match=r"toy engine toy-0 could not start: ValueError\('no such model'\)") as err:
        host.start(timeout_s=10)
    assert isinstance(err.value.__cause__, ValueError)
    # start raises as soon as the thread says why; the thread then closes the socket and the loop.
    assert host._thread is not None
    host._thread.join(timeout=10)
    assert host.closed_in_loop.is_set()  # closed inside the loop even when serving never began
    reserve_port("127.0.0.1", f"{host.port}-{host.port}").close()  # raises while the port is held


def test_a_drain_cuts_what_is_open_at_its_deadline_then_stops() -> None:
    host = ToyHost().start(timeout_s=10)
    host.in_flight.start("req-1", tenant="t", priority=0)
    outcome = host.drain(timeout_s=0.3)
    assert outcome is not None
    assert outcome.num_cut == 1 and outcome.waited_s >= 0.3
    assert host.events == ["background ended", "closed in loop"]
    assert host._thread is not None and not host._thread.is_alive()


def test_a_host_that_never_started_drains_to_none() -> None:
    host = ToyHost()
    try:
        assert host.drain(timeout_s=0.1) is None
    finally:
        host._http_socket.close()
