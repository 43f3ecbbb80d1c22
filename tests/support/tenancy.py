"""The tenancy tests' clients: tenants and keys made through the admin API, request bodies, concurrent posts,
and the OpenAI-style error body; with the settings the shared gateways run with."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.gateways import GatewayProcess

ADMIN_TOKEN = "tenancy-admin-token"
MODEL = "tenancy-small"
# NOTE: this machine is shared and oversubscribed (load far above its cores), so a gateway process can stall
# for seconds. The shared gateways get a lease TTL and a Redis read timeout that ride out such stalls; the
# tests of the lease TTL itself start their own gateway with SHORT_LEASE_TTL_S.
LEASE_TTL_S = 20.0
SHORT_LEASE_TTL_S = 10.0
# How long create_tenant retries a gateway answering 503 (its Redis just restarted by an earlier test).
STORE_BACK_WITHIN_S = 15.0
GATEWAY_ENV = {"TESSERA_ADMIN_TOKEN": ADMIN_TOKEN, "TESSERA_LEASE_TTL_S": str(LEASE_TTL_S),
               "TESSERA_KEY_CACHE_TTL_S": "1.0", "TESSERA_REDIS_TIMEOUT_S": "2.0"}
SHORT_LEASE_ENV = {**GATEWAY_ENV, "TESSERA_LEASE_TTL_S": str(SHORT_LEASE_TTL_S)}



@dataclass
class TenantHandle:
    name: str
    key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_TOKEN}"}


def create_tenant(gateway: GatewayProcess, policy: dict[str, Any] | None = None, prefix: str = "t") -> TenantHandle:
    """A fresh tenant and key, made through the admin API."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    # The package's Redis may have just been restarted by an earlier test (the fault and crash tests): a
    # gateway's first call on a pooled connection to the old server is a 503 "retry shortly", so retry, briefly.
    deadline = time.monotonic() + STORE_BACK_WITHIN_S
    while True:
        created = httpx.post(f"{gateway.url}/admin/tenants", json={"name": name, "policy": policy or {}},
                             headers=admin_headers(), timeout=10)
        if created.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert created.status_code == 201, created.text
    issued = httpx.post(f"{gateway.url}/admin/tenants/{name}/keys", headers=admin_headers(), timeout=10)
    assert issued.status_code == 201, issued.text
    return TenantHandle(name, issued.json()["key"], issued.json()["key_id"])


def completion_body(max_tokens: int = 1, prompt: Any = "hello tenancy", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}


async def post_all(urls: list[str], path: str, tenant: TenantHandle, bodies: list[dict[str, Any]],
                   timeout_s: float = 180.0) -> list[httpx.Response]:
    """Sends every body at once, spread round-robin over the gateways; returns the responses in order."""
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=len(bodies) + 10)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return list(await asyncio.gather(*(
            client.post(f"{urls[i % len(urls)]}{path}", json=body, headers=tenant.headers)
            for i, body in enumerate(bodies))))


async def post_burst(urls: list[str], path: str, tenant: TenantHandle, bodies: list[dict[str, Any]],
                     retries: int = 5) -> tuple[list[httpx.Response], int]:
    """``post_all``, as a client that honours Retry-After on 503 ``store_unavailable``: a gateway starved of
    CPU on this 2-core machine may time out on Redis and fail closed. Returns the final responses and how many
    503s were retried. A retried 503 may still have used a slot (the admission script ran and only its reply
    was late), so limits hold as "at most"; each retry may account for one slot fewer."""
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=len(bodies) + 10)
    retried = 0

    async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
        nonlocal retried
        for _ in range(retries):
            response = await client.post(f"{url}{path}", json=body, headers=tenant.headers)
            if response.status_code != 503 or error_of(response)["code"] != "store_unavailable":
                return response
            retried += 1
            await asyncio.sleep(float(response.headers["retry-after"]))
        return response

    async with httpx.AsyncClient(timeout=180.0, limits=limits) as client:
        responses = list(await asyncio.gather(*(one(client, urls[i % len(urls)], body)
                                                for i, body in enumerate(bodies))))
    return responses, retried


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "code", "param"} <= set(body["error"]), body
    return dict(body["error"])
