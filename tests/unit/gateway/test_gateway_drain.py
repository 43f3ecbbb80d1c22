"""The gateway's drain (gateway/drain.py) on its own: which open request is cut and how it answers, never
before the deadline, never one whose response is complete; readiness and new requests once it has begun;
the server's side (the signal begins it, the app hands it over in the lifespan state). Real processes drain
in tests/integration/tenancy/test_gateway_drain.py."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import orjson
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import RequestResponseCycle as H11Cycle
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttptoolsCycle

from tessera.gateway.app import Gateway
from tessera.gateway.drain import (
    DRAIN_STATE_KEY,
    CutAnswer,
    GatewayDrain,
    ResponseProgress,
    answer_cut,
    cut_answer,
    response_progress,
)
from tessera.gateway.lean_server import LeanServer
from tessera.settings import TesseraSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sent:
    """An ASGI ``send`` that keeps what it was sent."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)


def test_the_answer_follows_what_the_response_had_sent() -> None:
    assert cut_answer(ResponseProgress(started=True, complete=False)) is CutAnswer.ERROR_EVENT
    assert cut_answer(ResponseProgress(started=False, complete=False)) is CutAnswer.ERROR_RESPONSE
    # Complete: the request is settling (its usage on the way to Redis); cutting it could lose that.
    assert cut_answer(ResponseProgress(started=True, complete=True)) is CutAnswer.LEAVE


@pytest.mark.parametrize("cycle_class", [HttptoolsCycle, H11Cycle])
def test_progress_is_read_from_uvicorns_request_cycle(cycle_class: type[Any]) -> None:
    """The NOTE in response_progress: uvicorn's send is its cycle's bound method, which keeps both flags."""
    cycle = object.__new__(cycle_class)
    cycle.response_started, cycle.response_complete = True, False
    assert response_progress(cycle.send) == ResponseProgress(True, False)
    cycle.response_started, cycle.response_complete = True, True
    assert response_progress(cycle.send) == ResponseProgress(True, True)
    source = cycle_class.__init__.__code__.co_names
    assert {"response_started", "response_complete"} <= set(source)


async def test_no_cut_before_the_deadline_then_every_open_request_but_a_complete_one() -> None:
    clock = Clock()
    drain = GatewayDrain(timeout_s=30.0, clock=clock)
    streaming, waiting, settling = (asyncio.create_task(asyncio.sleep(60)) for _ in range(3))
    progress = {streaming: (True, False), waiting: (False, False), settling: (True, True)}
    for task, (started, complete) in progress.items():
        send = Sent()
        send.response_started, send.response_complete = started, complete  # type: ignore[attr-defined]
        drain.track(task, send.__call__)  # a bound method, as uvicorn's is
    drain.begin()
    clock.now += 29.9
    assert drain.seconds_to_deadline() == pytest.approx(0.1)
    with pytest.raises(AssertionError, match="cut before the deadline"):
        drain.cut()
    clock.now += 0.1
    assert drain.cut() == 2
    await asyncio.sleep(0)
    assert streaming.cancelled() and waiting.cancelled() and not settling.done()
    assert drain.take_cut(streaming) is CutAnswer.ERROR_EVENT
    assert drain.take_cut(waiting) is CutAnswer.ERROR_RESPONSE
    assert drain.take_cut(settling) is None  # its CancelledError, if it had one, would not be the drain's
    settling.cancel()


async def test_the_deadline_counts_from_the_first_signal() -> None:
    clock = Clock()
    drain = GatewayDrain(timeout_s=10.0, clock=clock)
    assert not drain.draining
    drain.begin()
    clock.now += 4.0
    drain.begin()  # a second SIGTERM, or the server's shutdown a tick later
    assert drain.draining and drain.seconds_to_deadline() == 6.0


async def test_wait_closed_waits_for_the_open_requests_up_to_its_bound() -> None:
    drain = GatewayDrain(timeout_s=1.0)
    quick, stuck = asyncio.create_task(asyncio.sleep(0.1)), asyncio.create_task(asyncio.sleep(60))
    drain.track(quick, Sent())
    drain.track(stuck, Sent())
    quick.add_done_callback(drain.untrack)
    assert await drain.wait_closed(0.5) == 1
    stuck.cancel()


async def test_a_cut_stream_ends_with_one_error_event_a_waiting_request_with_a_503() -> None:
    event, response = Sent(), Sent()
    await answer_cut(event.__call__, CutAnswer.ERROR_EVENT, 30.0, "req-1")
    ((message,),) = [event.messages]
    assert message["type"] == "http.response.body" and message["more_body"] is False
    body = message["body"]
    assert body.startswith(b"data: ") and body.endswith(b"\n\n")
    error = orjson.loads(body.removeprefix(b"data: "))["error"]
    assert error["code"] == "gateway_draining" and error["type"] == "service_unavailable"
    await answer_cut(response.__call__, CutAnswer.ERROR_RESPONSE, 30.0, "req-2")
    assert response.messages[0]["status"] == 503
    assert orjson.loads(response.messages[1]["body"])["error"]["code"] == "gateway_draining"


def _gateway() -> Gateway:
    # Nothing connects to Redis until a command runs; these paths run none once the drain has begun.
    return Gateway(TesseraSettings(redis_url="redis://127.0.0.1:1", trace_exporter="none"))


async def _call(app: Gateway, method: str, path: str) -> tuple[int, dict[str, Any]]:
    sent = Sent()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    await app(scope, receive, sent)
    return sent.messages[0]["status"], orjson.loads(sent.messages[1]["body"])


async def test_once_draining_readiness_is_503_and_a_new_generation_request_is_refused() -> None:
    app = _gateway()
    app.drain.begin()
    status, ready = await _call(app, "GET", "/ready")
    assert status == 503 and ready["status"] == "draining"
    status, refused = await _call(app, "POST", "/v1/chat/completions")
    assert status == 503 and refused["error"]["code"] == "gateway_draining"


async def test_the_app_hands_its_drain_to_the_server_and_the_signal_begins_it() -> None:
    app = _gateway()
    state: dict[str, Any] = {}
    messages = iter([{"type": "lifespan.startup"}])

    async def receive() -> dict[str, Any]:
        return next(messages)

    sent = Sent()
    starting = asyncio.create_task(app({"type": "lifespan", "state": state}, receive, sent))
    await asyncio.sleep(0.01)
    assert sent.messages == [{"type": "lifespan.startup.complete"}]
    assert state[DRAIN_STATE_KEY] is app.drain
    starting.cancel()

    server = LeanServer(uvicorn.Config(app=app))
    server.lifespan = type("Lifespan", (), {"state": state})()  # type: ignore[assignment]
    server.handle_exit(signal.SIGTERM, None)
    assert app.drain.draining and server.should_exit
