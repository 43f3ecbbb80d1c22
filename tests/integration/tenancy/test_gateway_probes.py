"""Gateway probes and metrics: liveness (/health) answers while the process serves; readiness (/ready) only
while Redis answers and an engine is registered, 503 naming what is missing otherwise; /metrics sums the
worker processes, on the metrics port only."""

from __future__ import annotations

from pathlib import Path

import httpx

from tessera.engine.host import EngineHost
from tessera.redis_conn import EmbeddedRedis
from tests.support.gateways import GatewayProcess, running_gateways
from tests.support.poll import wait_until
from tests.support.tenancy import GATEWAY_ENV, completion_body, create_tenant
from tests.support.valkey import RestartableRedis


def test_ready_with_redis_and_an_engine(gateways: list[GatewayProcess]) -> None:
    ready = httpx.get(f"{gateways[0].url}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "problems": []}
    assert httpx.get(f"{gateways[0].url}/health", timeout=10).status_code == 200


def test_not_ready_without_an_engine_or_without_redis(tmp_path: Path) -> None:
    redis = EmbeddedRedis().start()
    with running_gateways(1, redis.url, tmp_path) as (gateway,):
        empty = httpx.get(f"{gateway.url}/ready", timeout=10)
        assert empty.status_code == 503 and empty.json()["problems"] == ["no engine replica is registered"]
        redis.stop()
        down = httpx.get(f"{gateway.url}/ready", timeout=10)
        assert down.status_code == 503 and "Redis is unreachable" in down.json()["problems"][0]
        # Alive all the same: restarting the gateway would not bring Redis back.
        assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200


def test_metrics_are_summed_across_worker_processes(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost,
                                                    tmp_path: Path) -> None:
    """Two uvicorn workers: a scrape, whichever worker answers it, counts every worker's requests."""
    with running_gateways(1, tenancy_redis.url, tmp_path, GATEWAY_ENV, workers=2) as (gateway,):
        tenant = create_tenant(gateway, prefix="metrics")
        num_requests = 8
        for _ in range(num_requests):  # a new connection each: the kernel spreads them over the workers
            response = httpx.post(f"{gateway.url}/v1/completions", json=completion_body(), headers=tenant.headers,
                                  timeout=60)
            assert response.status_code == 200
        def counted(text: str) -> list[float]:
            return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("tessera_gateway_requests_total{") and f'"{tenant.name}"' in line]

        # A worker writes its completions to the series on its server tick, once a second (metrics.py).
        wait_until(lambda: counted(httpx.get(gateway.metrics_url, timeout=10).text) == [num_requests], 10,
                   "every worker's requests in the series", every_s=0.2)
        for _ in range(10):
            text = httpx.get(gateway.metrics_url, timeout=10).text
            assert counted(text) == [num_requests], text[:2000]
            ttft = [line for line in text.splitlines()
                    if line.startswith("tessera_gateway_ttft_seconds_count{") and f'"{tenant.name}"' in line]
            assert ttft and float(ttft[0].rsplit(" ", 1)[1]) == num_requests
        # Each worker froze its startup heap (tessera.telemetry.gc_heap): the summed count is well above one worker's
        # imports, and the collector's pauses are counted.
        frozen = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("tessera_gc_frozen_objects")]
        assert frozen and frozen[0] > 2 * 20_000, text[:2000]
        assert any(line.startswith('tessera_gc_pause_seconds_count{generation="0"}') for line in text.splitlines())
