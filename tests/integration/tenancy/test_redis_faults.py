"""Redis faults with real gateway processes: stopped Redis → 503 within 250 ms and never a 500 (fail
closed), or served and counted (fail open); Redis back on the same port → enforcement resumes by itself
(redis-py reconnects), and usage of requests served during the outage is recorded.

The package Redis persists to an append-only file, so the restart keeps tenants, keys and limiter state,
as a production Redis with persistence does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tessera.engine.host import EngineHost
from tests.support.gateways import GatewayProcess, start_gateways
from tests.support.probe import run_probe
from tests.support.tenancy import GATEWAY_ENV, TenantHandle, completion_body, create_tenant, post_all
from tests.support.valkey import RestartableRedis

FAIL_CLOSED_LATENCY_S = 0.25
# NOTE: the client-side bound is looser: the probe process shares an oversubscribed machine, so its own
# scheduling delays land in what it measures; the gateway's side is held to the 250 ms exactly.
CLIENT_MEDIAN_S, CLIENT_MAX_S = 0.25, 1.0
RESUME_WITHIN_S = 10.0


@pytest.fixture
def fail_open_gateway(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost,
                      tmp_path: Path) -> Iterator[GatewayProcess]:
    (gateway,) = start_gateways(1, tenancy_redis.url, tmp_path, {**GATEWAY_ENV, "TESSERA_REDIS_FAIL_OPEN": "1"})
    yield gateway
    gateway.stop()


def fail_open_count(gateway: GatewayProcess, tenant: TenantHandle) -> float:
    for line in httpx.get(gateway.metrics_url, timeout=10).text.splitlines():
        if line.startswith("tessera_gateway_fail_open_total{") and f'tenant="{tenant.name}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def completion_tokens_billed(gateway: GatewayProcess, tenant: TenantHandle) -> int:
    response = httpx.get(f"{gateway.url}/v1/usage", params={"period": "day"}, headers=tenant.headers, timeout=10)
    return int(response.json()["completion_tokens"]) if response.status_code == 200 else -1


async def outage_spans(trace_dir: Path, since: float, until: float, expected: int) -> list[float]:
    """Durations (s) of the gateway.request spans that failed between ``since`` and ``until`` (wall clock).
    (Not filtered by tenant: once the key cache expires, authentication itself fails, before the tenant
    is known.)"""
    durations: list[float] = []
    deadline = time.monotonic() + 10  # the exporter writes in batches
    while time.monotonic() < deadline:
        durations = []
        for path in trace_dir.glob("spans-*.jsonl"):
            for line in path.read_text().splitlines():
                span = orjson.loads(line)
                if (span["name"] == "gateway.request" and span["status"] == "ERROR"
                        and since * 1e9 <= span["start_ns"] <= until * 1e9):
                    durations.append((span["end_ns"] - span["start_ns"]) / 1e9)
        if len(durations) >= expected:
            return durations
        await asyncio.sleep(0.2)
    raise AssertionError(f"found {len(durations)} failed request spans, expected {expected}")


async def test_redis_outage_and_recovery(tenancy_redis: RestartableRedis, gateways: list[GatewayProcess],
                                         fail_open_gateway: GatewayProcess, gateway_trace_dir: Path) -> None:
    urls = [g.url for g in gateways]
    limited = create_tenant(gateways[0], {"requestsPerMinute": 5})
    unlimited = create_tenant(gateways[0])
    before = await post_all(urls, "/v1/completions", limited, [completion_body()] * 6)
    assert sorted(r.status_code for r in before) == [200] * 5 + [429]
    # The fail-open gateway has served this tenant once: it knows the key, the model and a route.
    warm = httpx.post(f"{fail_open_gateway.url}/v1/completions", json=completion_body(), headers=unlimited.headers,
                      timeout=60)
    assert warm.status_code == 200, warm.text

    tenancy_redis.stop()
    stopped_at = time.time()
    try:
        # Fail closed: one request at a time from a separate process, each timed on its own.
        outage = run_probe([f"{u}/v1/completions" for u in urls], limited.headers, completion_body(),
                           duration_s=3.0, interval_s=0.02)
        probed_until = time.time()
        assert len(outage) >= 10
        assert all(r.status == 503 and r.code == "store_unavailable" for r in outage), \
            {(r.status, r.code) for r in outage}
        latencies = sorted(r.latency_s for r in outage)
        assert latencies[len(latencies) // 2] <= CLIENT_MEDIAN_S and latencies[-1] <= CLIENT_MAX_S, latencies
        # An uncached key is not let in either, also by a fail-open gateway: no auth without Redis.
        stranger = httpx.post(f"{fail_open_gateway.url}/v1/completions", json=completion_body(),
                              headers={"authorization": "Bearer tsk-0123456789ab-unknown"}, timeout=10)
        assert stranger.status_code == 503

        # Fail open: a known tenant is served by the real engine and counted.
        served = httpx.post(f"{fail_open_gateway.url}/v1/completions", json=completion_body(max_tokens=4),
                            headers=unlimited.headers, timeout=60)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4
        assert fail_open_count(fail_open_gateway, unlimited) == 1.0
    finally:
        tenancy_redis.start()
        restarted_at = time.monotonic()
    # Each 503 as the gateway saw it: its gateway.request span, from the first byte to the error.
    server_side = await outage_spans(gateway_trace_dir, stopped_at, probed_until, len(outage))
    assert max(server_side) <= FAIL_CLOSED_LATENCY_S, f"slowest 503 took {max(server_side) * 1000:.0f} ms"

    # Enforcement resumes on both gateways by itself: the minute's 5 requests are still on record.
    pending = set(urls)
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=30) as client:
        while pending:
            assert time.monotonic() - restarted_at < RESUME_WITHIN_S, f"no enforcement yet on {pending}: {statuses}"
            for url in sorted(pending):
                response = await client.post(f"{url}/v1/completions", json=completion_body(), headers=limited.headers)
                statuses.append(response.status_code)
                assert response.status_code in (429, 503), response.text
                if response.status_code == 429 and response.json()["error"]["code"] == "requests_per_minute":
                    pending.discard(url)
            await asyncio.sleep(0.1)
        assert 500 not in statuses
        # And serving resumes for everyone else (once the engine's next heartbeat re-registers it).
        served: set[str] = set()
        while served != set(urls):
            assert time.monotonic() - restarted_at < 2 * RESUME_WITHIN_S, f"not serving again: {served}"
            for url in set(urls) - served:
                response = await client.post(f"{url}/v1/completions", json=completion_body(),
                                             headers=unlimited.headers)
                assert response.status_code in (200, 503), response.text
                if response.status_code == 200:
                    served.add(url)
            await asyncio.sleep(0.1)

    # The request served during the outage is billed once Redis is back: 1 (warm-up) + 4 (outage) + 1 + 1.
    deadline = time.monotonic() + 15
    while completion_tokens_billed(gateways[0], unlimited) < 7 and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    billed = completion_tokens_billed(gateways[0], unlimited)
    assert billed == 7, (billed, billing_log_lines(fail_open_gateway))


def billing_log_lines(gateway: GatewayProcess) -> list[str]:
    """What a gateway logged about finishes it could not record at once (why a test's usage is short)."""
    text = gateway.log_path.read_text(errors="replace") if gateway.log_path.exists() else ""
    return [line for line in text.splitlines() if "usage of lease" in line or "finish" in line.lower()][-20:]
