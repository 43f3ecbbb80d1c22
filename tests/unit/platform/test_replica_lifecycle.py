"""The replica lifecycle every engine host shares (engine/replica_lifecycle.py), with a backend that is only a
tiny ASGI app: start returns once the endpoint listens, a failed start says why and frees the port, the loops
beside the server end before the loop closes, a drain cuts what is still open at its deadline, and a drain
leaves the registry at once even when a loop beside the server ignores its cancellation (and the heartbeat
stops on ``leaving`` without one)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import httpx
import pytest

from tessera.asgi import Receive, Scope, Send, respond_json
from tessera.engine.config import EngineConfig
from tessera.engine.heartbeat import heartbeat_loop
from tessera.engine.in_flight import InFlightRequests
from tessera.engine.ports import reserve_port
from tessera.engine.replica_lifecycle import ThreadedReplicaHost
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry, ModelInfo


class ToyHost(ThreadedReplicaHost):
    kind = "toy engine"

    def __init__(self, fail_with: BaseException | None = None, redis_url: str | None = None,
                 stubborn_s: float = 0.0) -> None:
        """``stubborn_s``: the loop beside the server ignores its cancellation for that long, as one whose
        cancellation redis-py's ``asyncio.wait_for`` swallowed goes on."""
        super().__init__(EngineConfig(model="/m"), redis_url=redis_url, engine_id="toy-0",
                         advertise_host="127.0.0.1")
        self.in_flight = InFlightRequests()
        self.fail_with = fail_with
        self.stubborn_s = stubborn_s
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
        except asyncio.CancelledError:
            if self.stubborn_s:
                await asyncio.sleep(self.stubborn_s)  # the cancellation swallowed: it goes on a while
            raise
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


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = EmbeddedRedis().start()
    yield server.url
    server.stop()


def _record(engine_id: str = "toy-0") -> EngineRecord:
    return EngineRecord(engine_id, "http://127.0.0.1:1", "m", 32, 100, 2048)


def test_a_drain_leaves_the_registry_at_once_though_a_loop_ignores_its_cancellation(redis_url: str) -> None:
    # It waited for its loops first: one that ignored its cancellation (5 s at most) kept the draining replica
    # in the registry all that time, and the gateways routed to it.
    host = ToyHost(redis_url=redis_url, stubborn_s=3.0).start(timeout_s=10)

    async def registered() -> bool:
        redis = connect(redis_url, timeout_s=5.0)
        try:
            return "toy-0" in {r.engine_id for r in await EngineRegistry(redis).live_engines()}
        finally:
            await redis.aclose()

    async def beat() -> None:
        redis = connect(redis_url, timeout_s=5.0)
        await EngineRegistry(redis).heartbeat(_record())
        await redis.aclose()

    asyncio.run(beat())
    assert asyncio.run(registered())
    draining = threading.Thread(target=host.drain, kwargs={"timeout_s": 10.0})
    began = time.monotonic()
    draining.start()
    while asyncio.run(registered()):
        assert time.monotonic() - began < 2.0, "the draining replica is still in the registry"
        time.sleep(0.05)
    assert host.leaving
    draining.join(timeout=30)
    assert not asyncio.run(registered())


async def test_the_heartbeat_stops_when_the_replica_leaves_without_a_cancellation(redis_url: str) -> None:
    # A cancellation the loop did not see must not leave it beating: it registered a drained replica again.
    leaving = False
    beat = asyncio.create_task(heartbeat_loop(redis_url, 0.05, ModelInfo("m", "tok", 2048, 32), lambda: True,
                                              lambda: _record("beating-0"), lambda: leaving))
    redis = connect(redis_url, timeout_s=5.0)
    registry = EngineRegistry(redis)
    try:
        for _ in range(100):
            if "beating-0" in {r.engine_id for r in await registry.live_engines()}:
                break
            await asyncio.sleep(0.02)
        leaving = True
        await registry.deregister("beating-0")
        await asyncio.sleep(0.3)  # six intervals
        assert "beating-0" not in {r.engine_id for r in await registry.live_engines()}
        assert beat.done() and beat.exception() is None  # ended by itself, not cancelled
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await redis.aclose()
