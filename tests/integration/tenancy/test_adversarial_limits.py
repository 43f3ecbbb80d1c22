"""Issue #15 items 3, 4 and 5 from the attacker's side, against real gateway processes, the real engine and Redis:
one client trying to exhaust a gateway (oversized heads, slow heads, connections and requests held open),
a tenant reading every tenant's numbers off ``/metrics``, and a tenant probing another's prompts through
``approx_prefix``'s route reason. Each fails without its defence (gateway/connection_limits.py, the metrics
port of gateway/metrics.py, routing/policies.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from tessera.engine.host import EngineHost
from tests.support.gateways import GatewayProcess, spawn_gateway
from tests.support.hostile_http import connect, exchange, head, read_answer, wait_closed
from tests.support.poll import wait_until
from tests.support.tenancy import GATEWAY_ENV, completion_body, create_tenant
from tests.support.valkey import RestartableRedis

pytestmark = pytest.mark.adversarial

HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 12
MAX_IN_FLIGHT = 4
# How long a test waits for the gateway to do what it must (poll deadlines, not timings under test).
PATIENCE_S = 20.0


@pytest.fixture(scope="module")
def limited(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with small caps (so crossing them takes a dozen sockets) and the approx_prefix policy."""
    env = {**GATEWAY_ENV, "TESSERA_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
           "TESSERA_MAX_CONNECTIONS_PER_WORKER": str(MAX_CONNECTIONS),
           "TESSERA_MAX_IN_FLIGHT_PER_WORKER": str(MAX_IN_FLIGHT), "TESSERA_ROUTING_POLICY": "approx_prefix"}
    gateway = spawn_gateway(tenancy_redis.url, tmp_path_factory.mktemp("limited-gateway"), env)
    try:
        gateway.wait_healthy()
        yield gateway
    finally:
        gateway.stop()


def still_serves(gateway: GatewayProcess) -> None:
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{gateway.url}/v1/models", timeout=10).status_code == 401


# Item 3: memory and connections

def test_a_header_of_megabytes_is_431_not_read_whole(gateways: list[GatewayProcess]) -> None:
    """Before: an 8 MiB header value was read and accepted (then 401 for the missing key)."""
    gateway = gateways[0]
    bomb = [b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\nx-bomb: "] + [b"a" * 65536] * 128 + [b"\r\n\r\n"]
    answer = exchange(gateway.port, bomb)
    assert answer.status == 431 and answer.error_code == "headers_too_large", answer
    assert answer.headers.get("connection") == "close"
    still_serves(gateway)


def test_thousands_of_headers_are_431(gateways: list[GatewayProcess]) -> None:
    headers = [(f"x-h{i}".encode(), b"v" * 8) for i in range(5000)]
    answer = exchange(gateways[0].port, [head(headers=headers)])
    assert answer.status == 431 and answer.error_code == "headers_too_large", answer


def test_a_url_over_the_limit_is_414(gateways: list[GatewayProcess]) -> None:
    answer = exchange(gateways[0].port, [head(target="/v1/models?q=" + "a" * 9000)])
    assert answer.status == 414 and answer.error_code == "url_too_long", answer
    # Just under the limit is served as usual (401: no key).
    assert exchange(gateways[0].port, [head(target="/v1/models?q=" + "a" * 7000)]).status == 401


def test_a_head_that_never_ends_is_cut_off(limited: GatewayProcess) -> None:
    """Slowloris: headers begun and never finished, a byte at a time. Before: held open for ever."""
    with connect(limited.port) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\n")
        stop = threading.Event()

        def trickle() -> None:
            while not stop.is_set():
                try:
                    sock.sendall(b"x")
                except OSError:
                    return
                stop.wait(0.2)

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            got = wait_closed(sock, PATIENCE_S)
        finally:
            stop.set()
            sender.join()
    assert got.startswith(b"HTTP/1.1 408") and b"header_timeout" in got, got[:300]


def test_a_connection_that_sends_nothing_is_closed(limited: GatewayProcess) -> None:
    with connect(limited.port) as sock:
        got = wait_closed(sock, PATIENCE_S)
    assert got.startswith(b"HTTP/1.1 408"), got[:300]


def test_connections_beyond_the_cap_are_503_and_liveness_still_answers(limited: GatewayProcess) -> None:
    with ExitStack() as stack:
        for _ in range(MAX_CONNECTIONS):  # kept alive after one request each
            sock = stack.enter_context(connect(limited.port))
            sock.sendall(head(target="/health"))
            assert read_answer(sock).status == 200
        answer = exchange(limited.port, [head()])
        assert answer.status == 503 and answer.error_code == "too_many_connections", answer
        assert answer.headers.get("retry-after") == "1" and str(MAX_CONNECTIONS) in answer.body.decode()
        assert exchange(limited.port, [head(target="/health")]).status == 200
    # The held connections closed: a new one is served again.
    wait_until(lambda: exchange(limited.port, [head()]).status == 401, PATIENCE_S, "a connection under the cap")


def test_requests_held_open_beyond_the_in_flight_cap_are_503(limited: GatewayProcess) -> None:
    """Requests whose body never finishes stay in flight: past the cap the next request is refused at
    once, naming the limit, instead of queueing behind them."""
    partial = head("POST", "/v1/completions", [(b"content-type", b"application/json"), (b"content-length", b"100")])
    with ExitStack() as stack:
        for _ in range(MAX_IN_FLIGHT):
            stack.enter_context(connect(limited.port)).sendall(partial + b'{"model": ')
        refused: list[int] = []

        def at_cap() -> bool:
            answer = exchange(limited.port, [head()])
            refused.append(answer.status or 0)
            return answer.status == 503 and answer.error_code == "too_many_requests_in_flight"

        wait_until(at_cap, PATIENCE_S, "the in-flight cap")
        assert set(refused) <= {401, 503}
        assert exchange(limited.port, [head(target="/health")]).status == 200
    wait_until(lambda: exchange(limited.port, [head()]).status == 401, PATIENCE_S, "requests under the cap")


# Item 4: /metrics

def test_metrics_are_not_on_the_tenant_api(gateways: list[GatewayProcess]) -> None:
    """Before: GET /metrics on the API port listed every tenant's names, requests, tokens and latencies."""
    gateway = gateways[0]
    tenant = create_tenant(gateway, prefix="metrics-probe")
    assert httpx.post(f"{gateway.url}/v1/completions", json=completion_body(), headers=tenant.headers,
                      timeout=60).status_code == 200
    for headers in ({}, tenant.headers):
        response = httpx.get(f"{gateway.url}/metrics", headers=headers, timeout=10)
        assert response.status_code == 404 and tenant.name not in response.text
    # A worker writes its completed requests to the series on its server tick, once a second (metrics.py).
    wait_until(lambda: f'tenant="{tenant.name}"' in httpx.get(gateway.metrics_url, timeout=10).text, 10,
               "the request in the metrics port's series", every_s=0.2)
    assert httpx.get(gateway.metrics_url, timeout=10).status_code == 200
    # The metrics port serves nothing of the API.
    assert httpx.get(gateway.metrics_url.replace("/metrics", "/v1/models"), headers=tenant.headers,
                     timeout=10).status_code == 404


# Item 5: approx_prefix

def test_approx_prefix_tells_no_tenant_about_anothers_prompts(limited: GatewayProcess,
                                                              gateways: list[GatewayProcess]) -> None:
    """Before: a prober sending a victim's prompt saw ``approx_prefix matched_chunks=N`` in the route
    reason (a wrong guess saw ``miss``), since the chunks were hashed without the tenant's salt."""
    victim, prober = create_tenant(gateways[0], prefix="victim"), create_tenant(gateways[0], prefix="prober")
    secret = "Quarterly numbers, internal only: " + "revenue line " * 40
    guess_wrong = "Quarterly figures, public draft: " + "expense line " * 40

    def reason(tenant_headers: dict[str, str], prompt: str) -> str:
        response = httpx.post(f"{limited.url}/v1/completions", json=completion_body(prompt=prompt),
                              headers=tenant_headers, timeout=60)
        assert response.status_code == 200, response.text
        return response.headers["x-tessera-route-reason"]

    reason(victim.headers, secret)
    assert reason(prober.headers, secret) == reason(prober.headers, guess_wrong) == "approx_prefix"
