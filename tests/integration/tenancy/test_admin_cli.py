"""The admin API (through a real gateway process) and the ``tessera tenants`` / ``tessera keys`` CLI."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tessera.cli import app as cli_app
from tests.support.gateways import GatewayProcess, start_gateways
from tests.support.tenancy import admin_headers, completion_body, create_tenant, error_of
from tests.support.valkey import RestartableRedis


def name() -> str:
    return f"adm-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def admin(gateways: list[GatewayProcess]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateways[0].url, headers=admin_headers(), timeout=30) as client:
        yield client


@pytest.fixture
def tokenless_gateway(tenancy_redis: RestartableRedis, tmp_path: Path) -> Iterator[GatewayProcess]:
    (gateway,) = start_gateways(1, tenancy_redis.url, tmp_path, {"TESSERA_ADMIN_TOKEN": ""})
    yield gateway
    gateway.stop()


def test_admin_token_is_required(gateways: list[GatewayProcess], tokenless_gateway: GatewayProcess) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic Zm9vOmJhcg=="}):
        response = httpx.get(f"{gateways[0].url}/admin/tenants", headers=headers)
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_admin_token"
    # A tenant's API key is not an admin token.
    tenant = create_tenant(gateways[0])
    assert httpx.get(f"{gateways[0].url}/admin/tenants", headers=tenant.headers).status_code == 401
    # Without a configured admin token the admin API is off for everyone.
    disabled = httpx.get(f"{tokenless_gateway.url}/admin/tenants", headers=admin_headers())
    assert disabled.status_code == 403 and error_of(disabled)["code"] == "admin_disabled"


def test_tenant_lifecycle(admin: httpx.Client) -> None:
    tenant = name()
    created = admin.post("/admin/tenants", json={"name": tenant, "policy": {"requestsPerMinute": 60,
                                                                            "priorityClass": "high"}})
    assert created.status_code == 201
    assert created.json()["policy"]["requests_per_minute"] == 60
    assert admin.post("/admin/tenants", json={"name": tenant}).status_code == 409
    assert tenant in [t["name"] for t in admin.get("/admin/tenants").json()["data"]]
    assert admin.get(f"/admin/tenants/{tenant}").json()["policy"]["priority_class"] == "high"

    patched = admin.patch(f"/admin/tenants/{tenant}", json={"policy": {"tokensPerMinute": 5000}})
    assert patched.status_code == 200
    assert (patched.json()["policy"]["tokens_per_minute"], patched.json()["policy"]["requests_per_minute"]) == (
        5000, 60)

    assert admin.delete(f"/admin/tenants/{tenant}").json() == {"deleted": tenant}
    assert admin.get(f"/admin/tenants/{tenant}").status_code == 404
    assert admin.delete(f"/admin/tenants/{tenant}").status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"name": "Bad_Name"}, None),
    ({"policy": {}}, None),
    ({"name": "x", "policy": {"requestsPerMinute": 0}}, "requestsPerMinute"),
    ({"name": "x", "policy": {"kvQuota": 3}}, "kvQuota"),
    ({"name": "x", "policy": {"rpm": 5}}, "rpm"),
])
def test_invalid_tenants_are_400(admin: httpx.Client, body: dict[str, Any], param: str | None) -> None:
    response = admin.post("/admin/tenants", json=body)
    assert response.status_code == 400, response.text
    if param:
        assert error_of(response)["param"] == param


@pytest.mark.adversarial
@pytest.mark.parametrize("method, path, code", [
    ("POST", "/admin/tenants/{owner}:keys/keys", "invalid_tenant_name"),  # was Redis's WRONGTYPE: a 500
    ("GET", "/admin/tenants/{owner}:keys", "invalid_tenant_name"),
    ("GET", "/admin/tenants/{owner}:keys/usage", "invalid_tenant_name"),
    ("DELETE", "/admin/tenants/x*", "invalid_tenant_name"),
    ("DELETE", "/admin/keys/{owner}:keys", "invalid_key_id"),
])
def test_names_in_admin_paths_are_checked_before_redis(admin: httpx.Client, method: str, path: str,
                                                      code: str) -> None:
    owner = name()
    admin.post("/admin/tenants", json={"name": owner})
    admin.post(f"/admin/tenants/{owner}/keys")  # the owner's key set exists: '<owner>:keys' would address it
    response = admin.request(method, path.format(owner=owner))
    assert response.status_code == 400, response.text
    assert error_of(response)["code"] == code


def test_invalid_updates_are_400_and_change_nothing(admin: httpx.Client) -> None:
    tenant = name()
    admin.post("/admin/tenants", json={"name": tenant, "policy": {"requestsPerMinute": 5}})
    for change in ({"nope": 1}, {"requestsPerMinute": -1}, {"priorityClass": "vip"}):
        assert admin.patch(f"/admin/tenants/{tenant}", json={"policy": change}).status_code == 400
    assert admin.patch(f"/admin/tenants/{tenant}", json={"policy": 5}).status_code == 400
    assert admin.get(f"/admin/tenants/{tenant}").json()["policy"]["requests_per_minute"] == 5
    assert admin.patch(f"/admin/tenants/{name()}", json={"policy": {}}).status_code == 404


def test_keys_are_shown_once_listed_by_prefix_and_revocable(admin: httpx.Client,
                                                            gateways: list[GatewayProcess]) -> None:
    tenant = name()
    admin.post("/admin/tenants", json={"name": tenant})
    issued = [admin.post(f"/admin/tenants/{tenant}/keys").json() for _ in range(2)]
    assert all(re.fullmatch(r"tsk-[0-9a-f]{12}-\S+", k["key"]) for k in issued)
    listed = admin.get(f"/admin/tenants/{tenant}/keys")
    assert sorted(k["key_id"] for k in listed.json()["data"]) == sorted(k["key_id"] for k in issued)
    for key in issued:
        assert key["key"] not in listed.text and key["key"].split("-", 2)[2] not in listed.text
    assert {k["prefix"] for k in listed.json()["data"]} == {f"tsk-{k['key_id']}-…" for k in issued}

    revoked = admin.delete(f"/admin/keys/{issued[0]['key_id']}")
    assert revoked.json() == {"revoked": issued[0]["key_id"], "tenant": tenant}
    states = {k["key_id"]: k["revoked"] for k in admin.get(f"/admin/tenants/{tenant}/keys").json()["data"]}
    assert states == {issued[0]["key_id"]: True, issued[1]["key_id"]: False}
    assert admin.delete("/admin/keys/000000000000").status_code == 404
    assert admin.post(f"/admin/tenants/{name()}/keys").status_code == 404
    time.sleep(1.2)  # past the key cache of the replicas
    auth = [httpx.get(f"{gateways[1].url}/v1/models", headers={"authorization": f"Bearer {k['key']}"}).status_code
            for k in issued]
    assert auth == [401, 200]


def test_usage_per_period(admin: httpx.Client, gateways: list[GatewayProcess]) -> None:
    tenant = create_tenant(gateways[0], {"budgetPeriod": "day", "tokenBudget": 10_000})
    for _ in range(3):
        response = httpx.post(f"{gateways[1].url}/v1/completions", json=completion_body(max_tokens=2),
                              headers=tenant.headers, timeout=60)
        assert response.status_code == 200
    deadline = time.monotonic() + 5
    reports: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        reports = {p: admin.get(f"/admin/tenants/{tenant.name}/usage", params={"period": p}).json()
                   for p in ("hour", "day", "month")}
        if all(r["requests"] == 3 for r in reports.values()):
            break
        time.sleep(0.1)
    for period, report in reports.items():
        assert (report["tenant"], report["period"], report["requests"], report["completion_tokens"]) == (
            tenant.name, period, 3, 6), report
        assert report["total_tokens"] == report["prompt_tokens"] + 6
    assert reports["day"]["token_budget"] == 10_000 and "token_budget" not in reports["hour"]
    assert admin.get(f"/admin/tenants/{tenant.name}/usage").json()["period"] == "day"  # the budget period
    assert admin.get(f"/admin/tenants/{tenant.name}/usage", params={"period": "year"}).status_code == 400
    assert admin.get(f"/admin/tenants/{name()}/usage").status_code == 404


def test_a_policy_change_takes_effect_on_every_replica(admin: httpx.Client, gateways: list[GatewayProcess]) -> None:
    tenant = create_tenant(gateways[0], {"maxTokensCap": 100})
    body = completion_body(max_tokens=50)
    assert httpx.post(f"{gateways[1].url}/v1/completions", json=body, headers=tenant.headers,
                      timeout=60).status_code == 200
    admin.patch(f"/admin/tenants/{tenant.name}", json={"policy": {"maxTokensCap": 10}})
    time.sleep(1.2)  # the replicas cache a key's tenant for TESSERA_KEY_CACHE_TTL_S = 1 s
    for gateway in gateways:
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=tenant.headers, timeout=60)
        assert response.status_code == 400 and error_of(response)["code"] == "max_tokens_too_large"


# ---- CLI -------------------------------------------------------------------------------------------


@pytest.fixture
def cli(tenancy_redis: RestartableRedis) -> Iterator[Any]:
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(cli_app, list(args), env={"TESSERA_REDIS_URL": tenancy_redis.url})

    yield invoke


def test_cli_manages_tenants_and_keys(cli: Any, gateways: list[GatewayProcess]) -> None:
    tenant = name()
    created = cli("tenants", "create", tenant, "--policy", '{"requestsPerMinute": 7}')
    assert created.exit_code == 0, created.output
    key = re.search(r"key: (tsk-\S+)", created.output).group(1)  # type: ignore[union-attr]
    assert httpx.get(f"{gateways[0].url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200

    listed = cli("tenants", "list", "--json")
    assert listed.exit_code == 0
    assert {t["name"]: t["policy"]["requests_per_minute"] for t in json.loads(listed.output)}[tenant] == 7
    assert tenant in cli("tenants", "list").output

    updated = cli("tenants", "update", tenant, "--policy", '{"priorityClass": "high"}')
    assert updated.exit_code == 0, updated.output
    policy = json.loads(updated.output)
    assert (policy["priority_class"], policy["requests_per_minute"]) == ("high", 7)
    for bad in ('{"nope": 1}', '{"requestsPerMinute": 0}', "not json", "[1]"):
        failed = cli("tenants", "update", tenant, "--policy", bad)
        assert failed.exit_code == 2 and "error" in failed.output, (bad, failed.output)

    issued = cli("keys", "issue", tenant)
    assert issued.exit_code == 0
    second_key = re.search(r"key: (tsk-\S+)", issued.output).group(1)  # type: ignore[union-attr]
    key_id = second_key.split("-")[1]
    keys = cli("keys", "list", tenant)
    assert keys.exit_code == 0 and f"tsk-{key_id}-…" in keys.output
    assert key not in keys.output and second_key not in keys.output
    assert cli("keys", "revoke", key_id).exit_code == 0
    assert re.search(rf"tsk-{key_id}-…\s+revoked", cli("keys", "list", tenant).output)
    assert cli("keys", "revoke", "000000000000").exit_code == 2

    usage = cli("tenants", "usage", tenant, "--period", "day")
    assert usage.exit_code == 0 and json.loads(usage.output)["requests"] == 0
    assert cli("tenants", "usage", tenant, "--period", "week").exit_code == 2

    assert cli("tenants", "delete", tenant).exit_code == 0
    assert cli("keys", "list", tenant).exit_code == 2
    assert cli("tenants", "create", "Bad_Name").exit_code == 2
