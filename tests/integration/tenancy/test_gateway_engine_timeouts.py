"""Nothing holds a request forever: a replica that goes quiet mid-stream, a request that outruns the total
limit, and a non-streamed request whose client left each end the engine call (the replica sees its caller
go), release the tenant's concurrency lease and are billed for what was generated; the client that is still
there gets an error that says what happened. A real gateway process and Redis; the replica is the fake one
(tests/support/fake_engine.py) because these faults need an engine that stalls or runs slow on purpose."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tessera.redis_conn import EmbeddedRedis
from tests.support.fake_engine import FakeEngine, running_fake_engine
from tests.support.gateways import GatewayProcess, running_gateways
from tests.support.poll import wait_until
from tests.support.tenancy import GATEWAY_ENV, TenantHandle, admin_headers, create_tenant

pytestmark = pytest.mark.adversarial

TIMEOUT_ENV = {**GATEWAY_ENV, "TESSERA_ENGINE_IDLE_TIMEOUT_S": "0.5", "TESSERA_ENGINE_TOTAL_TIMEOUT_S": "2"}


@pytest.fixture
def slow_engine(redis_server: EmbeddedRedis, small_model_dir: Path, request: pytest.FixtureRequest,
                ) -> Iterator[tuple[FakeEngine, str]]:
    """A registered fake replica writing one line every ``param`` seconds, under a model of its own."""
    model = f"timeouts-{time.monotonic_ns()}"
    with running_fake_engine(redis_server.url, model, small_model_dir, line_gap_s=request.param) as engine:
        yield engine, model


@pytest.fixture
def gateway(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[GatewayProcess]:
    with running_gateways(1, redis_server.url, tmp_path, TIMEOUT_ENV) as (process,):
        yield process


def _one_at_a_time(gateway: GatewayProcess) -> TenantHandle:
    return create_tenant(gateway, {"maxConcurrentRequests": 1}, prefix="timeouts")


def _usage(gateway: GatewayProcess, tenant: TenantHandle) -> dict[str, int]:
    response = httpx.get(f"{gateway.url}/admin/tenants/{tenant.name}/usage", headers=admin_headers(), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("slow_engine", [30.0], indirect=True)
def test_a_replica_that_goes_quiet_ends_the_stream_with_an_error(slow_engine: tuple[FakeEngine, str],
                                                                  gateway: GatewayProcess) -> None:
    _, model = slow_engine
    tenant = _one_at_a_time(gateway)
    body = {"model": model, "prompt": "stall", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=tenant.headers,
                      timeout=20) as response:
        assert response.status_code == 200
        events = [orjson.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == " w0"  # the line before the stall reached the client
    error = events[-1]["error"]
    assert error["code"] == "engine_unavailable" and "sent nothing for 0.5 s" in error["message"], error
    # The lease is back: the tenant's one slot serves the next request at once (no 429).
    again = httpx.post(f"{gateway.url}/v1/completions", json={**body, "stream": False}, headers=tenant.headers,
                       timeout=20)
    assert again.status_code == 503, again.text  # the same stall, answered, not refused for concurrency


@pytest.mark.parametrize("slow_engine", [0.05], indirect=True)
def test_a_request_past_the_total_limit_is_504_and_billed(slow_engine: tuple[FakeEngine, str],
                                                         gateway: GatewayProcess) -> None:
    engine, model = slow_engine
    tenant = _one_at_a_time(gateway)
    body = {"model": model, "prompt": "long", "max_tokens": 400}  # 20 s of lines against a 2 s limit
    started = time.monotonic()
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=tenant.headers, timeout=30)
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "engine_timeout"
    assert time.monotonic() - started < 10
    wait_until(lambda: engine.num_open == 0, 10, "the engine call closed at the limit")
    sent = sum(engine.tokens_sent.values())
    wait_until(lambda: _usage(gateway, tenant).get("requests", 0) == 1, 10, "the request billed")
    assert 0 < int(_usage(gateway, tenant)["completion_tokens"]) <= sent


@pytest.mark.parametrize("slow_engine", [0.05], indirect=True)
def test_a_non_streamed_request_whose_client_left_stops_the_engine(slow_engine: tuple[FakeEngine, str],
                                                                   gateway: GatewayProcess) -> None:
    engine, model = slow_engine
    tenant = _one_at_a_time(gateway)
    body = {"model": model, "prompt": "leave", "max_tokens": 30}  # 1.5 s: inside the total limit
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers=tenant.headers, timeout=0.5)
    left = time.monotonic()
    wait_until(lambda: engine.num_open == 0, 10, "the engine call closed after the client left")
    assert time.monotonic() - left < 1.2  # before the 1.5 s the engine would have taken to finish
    assert max(engine.tokens_sent.values()) < 30
    wait_until(lambda: _usage(gateway, tenant).get("requests", 0) == 1, 10, "the request billed")
