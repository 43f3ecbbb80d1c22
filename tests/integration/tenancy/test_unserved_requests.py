"""A request admitted while no engine of its model is live is answered 503 and costs the tenant nothing: its
slot in the requests-per-minute window goes back and nothing is billed (an outage must not spend a tenant's
limits: after a Sentinel failover the replicas' registry entries can lapse for seconds, and every retry the
clients sent then used to fill the window, 429 for the rest of the minute). A request an engine was called
for is billed as before. Real gateway process and Redis; the replica is the fake one (no vLLM needed)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tessera.redis_conn import EmbeddedRedis
from tests.support.fake_engine import running_fake_engine
from tests.support.gateways import running_gateways
from tests.support.poll import wait_until
from tests.support.tenancy import GATEWAY_ENV, admin_headers, create_tenant

RPM_LIMIT = 2
UNSERVED_TRIES = 5  # more than the limit: each would have been a 429 once two were spent


def test_requests_no_engine_served_give_their_rate_slot_back_and_are_not_billed(
        redis_server: EmbeddedRedis, small_model_dir: Path, tmp_path: Path) -> None:
    model = f"unserved-{time.monotonic_ns()}"
    body = {"model": model, "prompt": "one two three", "max_tokens": 2}
    with running_gateways(1, redis_server.url, tmp_path, GATEWAY_ENV) as (gateway,):
        tenant = create_tenant(gateway, {"requestsPerMinute": RPM_LIMIT}, prefix="unserved")

        def complete() -> httpx.Response:
            return httpx.post(f"{gateway.url}/v1/completions", json=body, headers=tenant.headers, timeout=20)

        def usage() -> dict[str, int]:
            response = httpx.get(f"{gateway.url}/admin/tenants/{tenant.name}/usage", headers=admin_headers(),
                                 timeout=10)
            assert response.status_code == 200, response.text
            return response.json()  # type: ignore[no-any-return]

        with running_fake_engine(redis_server.url, model, small_model_dir, line_gap_s=0.0):
            served = complete()
            assert served.status_code == 200, served.text
        # The replica deregistered and closed its port on its way out; the model stays known (its tokenizer
        # is registered). Until the gateway's view of the registry catches up it routes to the departed
        # replica and is refused the connection; either way no engine sees these requests.
        for _ in range(UNSERVED_TRIES):
            response = complete()
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_unavailable"
            assert "retry-after" in response.headers

        with running_fake_engine(redis_server.url, model, small_model_dir, line_gap_s=0.0):
            # One slot of two is used (the served request): once the gateway sees the new replica the next
            # request is served — the 503s while it did not yet cost nothing either.
            wait_until(lambda: complete().status_code == 200, 10.0, "a request served by the new replica")
            refused = complete()
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "requests_per_minute"
        assert usage()["requests"] == 2, "only the two served requests are billed"
