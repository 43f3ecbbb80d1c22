"""Tenancy through the whole platform as `make run` starts it (Ray Serve engine, gateway workers): the
admin API, limits with Retry-After, the tenant's own models and usage, revocation, cache isolation and
priority at the deployed engine."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tessera.local.platform import LocalPlatform
from tests.support.data_plane import ENGINE_AUTH

ADMIN_TOKEN = "e2e-admin-token"  # the platform_stack fixture's (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def admin(platform_stack: LocalPlatform) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=platform_stack.base_url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                      timeout=60) as client:
        yield client


def new_tenant(admin: httpx.Client, policy: dict[str, Any]) -> tuple[str, dict[str, str], str]:
    name = f"e2e-{uuid.uuid4().hex[:10]}"
    assert admin.post("/admin/tenants", json={"name": name, "policy": policy}).status_code == 201
    issued = admin.post(f"/admin/tenants/{name}/keys").json()
    return name, {"authorization": f"Bearer {issued['key']}"}, issued["key_id"]


def test_admin_limits_usage_and_revocation(platform_stack: LocalPlatform, admin: httpx.Client) -> None:
    name, headers, key_id = new_tenant(admin, {"requestsPerMinute": 3, "allowedModels": [platform_stack.model]})
    body = {"model": platform_stack.model, "prompt": "one two three", "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=platform_stack.base_url, headers=headers, timeout=60) as client:
        statuses = [client.post("/v1/completions", json=body) for _ in range(4)]
        assert [r.status_code for r in statuses] == [200, 200, 200, 429]
        assert statuses[3].json()["error"]["code"] == "requests_per_minute"
        assert 1 <= int(statuses[3].headers["retry-after"]) <= 60
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [platform_stack.model]
        deadline = time.monotonic() + 5
        while client.get("/v1/usage").json()["requests"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        usage = client.get("/v1/usage", params={"period": "day"}).json()
        assert (usage["tenant"], usage["requests"], usage["completion_tokens"]) == (name, 3, 6)
        assert admin.get(f"/admin/tenants/{name}/usage", params={"period": "day"}).json()["requests"] == 3

        assert admin.delete(f"/admin/keys/{key_id}").status_code == 200
        revoked_at = time.monotonic()
        while client.get("/v1/models").status_code != 401:
            assert time.monotonic() - revoked_at < 2.0, "the revoked key still works"
            time.sleep(0.05)


def test_cache_isolation_and_priority_at_the_deployed_engine(platform_stack: LocalPlatform,
                                                             admin: httpx.Client, engine_url: str) -> None:
    prompt = [random.Random(time.monotonic_ns()).randrange(3, 700) for _ in range(130)]
    name_a, a, _ = new_tenant(admin, {"priorityClass": "critical"})
    _, b, _ = new_tenant(admin, {"priorityClass": "batch"})

    def cached(headers: dict[str, str]) -> int:
        response = httpx.post(f"{platform_stack.base_url}/v1/completions", headers=headers, timeout=60,
                              json={"model": platform_stack.model, "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert (cached(a), cached(a), cached(b)) == (0, 128, 0)

    url = engine_url
    body = {"model": platform_stack.model, "prompt": prompt, "max_tokens": 800, "ignore_eos": True,
            "temperature": 1.0, "stream": True}
    seen: dict[str, int] = {}
    with httpx.stream("POST", f"{platform_stack.base_url}/v1/completions", json=body, headers=a,
                      timeout=60) as stream:
        assert stream.status_code == 200
        for _ in stream.iter_bytes():
            listing = httpx.get(f"{url}/requests", auth=ENGINE_AUTH).json()
            seen.update({r["tenant"]: int(r["priority"]) for r in listing})
            if name_a in seen:
                break
    assert seen[name_a] == 0  # the critical class is vLLM priority 0
