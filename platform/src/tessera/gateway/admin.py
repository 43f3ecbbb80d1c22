"""The admin API (``/admin/...``), protected by a separate admin token (``TESSERA_ADMIN_TOKEN``).

  POST   /admin/tenants                    {"name", "policy"?}         → 201 tenant
  GET    /admin/tenants                                                → tenants
  GET    /admin/tenants/<name>                                         → tenant
  PATCH  /admin/tenants/<name>             {"policy": {...partial}}    → tenant (validated merge)
  DELETE /admin/tenants/<name>                                         → 200, keys deleted
  POST   /admin/tenants/<name>/keys                                    → 201 {"key" (shown once), "key_id"}
  GET    /admin/tenants/<name>/keys                                    → key ids and prefixes only
  DELETE /admin/keys/<key_id>                                          → 200, revoked on every gateway ≤ 2 s
  GET    /admin/tenants/<name>/usage?period=hour|day|month             → usage of the current period

A tenant reads its own usage with its API key at ``GET /v1/usage`` (``usage_report`` below); a missing or
wrong admin token is 401, an admin API without a configured token answers 403 to everyone.
"""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import parse_qs

import orjson
from pydantic import ValidationError

from tessera.asgi import Receive, Scope, Send
from tessera.gateway.errors import APIError, bad_request, invalid_field
from tessera.gateway.responses import request_body, respond
from tessera.tenancy.admission import Admission
from tessera.tenancy.keys import KEY_ID_HEX_CHARS, is_key_id
from tessera.tenancy.periods import check_period
from tessera.tenancy.policy import TenantPolicy, validate_tenant_name
from tessera.tenancy.store import Tenant, TenantExistsError, TenantNotFoundError, TenantStore

# Admin bodies are a tenant name and a policy: small.
MAX_ADMIN_BODY_BYTES = 65536


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"name": tenant.name, "policy": tenant.policy.model_dump(mode="json"), "created_at": tenant.created_at}


class AdminAPI:
    def __init__(self, store: TenantStore, admission: Admission, admin_token: str | None) -> None:
        self._store = store
        self._admission = admission
        self._token = admin_token

    async def handle(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str],
                     request_id: str) -> None:
        self._authorize(headers.get("authorization"))
        method = scope["method"]
        parts = [p for p in scope["path"].split("/") if p][1:]  # drop "admin"
        body = await request_body(receive, headers, MAX_ADMIN_BODY_BYTES) if method in ("POST", "PATCH") else b""
        try:
            status, payload = await self._dispatch(method, parts, body, scope.get("query_string", b""))
        except TenantNotFoundError as exc:
            raise APIError(404, str(exc.args[0]), "tenant_not_found") from None
        except TenantExistsError as exc:
            raise APIError(409, str(exc), "tenant_exists") from None
        except ValidationError as exc:
            raise invalid_field(exc.errors(), "invalid_policy") from None  # type: ignore[arg-type]
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        await respond(send, status, payload, request_id)

    def _authorize(self, authorization: str | None) -> None:
        if not self._token:
            raise APIError(403, "The admin API is disabled: set TESSERA_ADMIN_TOKEN on the gateway.", "admin_disabled")
        supplied = authorization[7:] if authorization and authorization.startswith("Bearer ") else ""
        if not hmac.compare_digest(supplied.encode(), self._token.encode()):
            raise APIError(401, "Invalid admin token.", "invalid_admin_token")

    async def _dispatch(self, method: str, parts: list[str], body: bytes, query: bytes) -> tuple[int, Any]:
        check_path_names(parts)
        data = _json_object(body) if body else {}
        if parts == ["tenants"] and method == "POST":
            name = data.get("name")
            if not isinstance(name, str):
                raise ValueError("body needs 'name' (string)")
            policy = TenantPolicy.model_validate(data.get("policy") or {})
            return 201, tenant_json(await self._store.create_tenant(name, policy))
        if parts == ["tenants"] and method == "GET":
            return 200, {"data": [tenant_json(t) for t in await self._store.list_tenants()]}
        if len(parts) == 2 and parts[0] == "tenants":
            name = parts[1]
            if method == "GET":
                return 200, tenant_json(await self._store.require_tenant(name))
            if method == "PATCH":
                current = await self._store.require_tenant(name)
                changes = data.get("policy")
                if not isinstance(changes, dict):
                    raise ValueError("body needs 'policy' (object of fields to change)")
                return 200, tenant_json(await self._store.set_policy(name, current.policy.updated(changes)))
            if method == "DELETE":
                await self._store.delete_tenant(name)
                return 200, {"deleted": name}
        if len(parts) == 3 and parts[0] == "tenants" and parts[2] == "keys":
            if method == "POST":
                issued = await self._store.issue_key(parts[1])
                return 201, {"key": issued.plaintext, "key_id": issued.key_id, "tenant": parts[1]}
            if method == "GET":
                keys = await self._store.list_keys(parts[1])
                return 200, {"data": [{"key_id": k.key_id, "prefix": k.display_prefix, "revoked": k.revoked,
                                       "created_at": k.created_at} for k in keys]}
        if len(parts) == 3 and parts[0] == "tenants" and parts[2] == "usage" and method == "GET":
            tenant = await self._store.require_tenant(parts[1])
            return 200, await usage_report(self._admission, tenant, query)
        if len(parts) == 2 and parts[0] == "keys" and method == "DELETE":
            try:
                tenant_name = await self._store.revoke_key(parts[1])
            except KeyError:
                raise APIError(404, f"key {parts[1]!r} does not exist", "key_not_found") from None
            return 200, {"revoked": parts[1], "tenant": tenant_name}
        raise APIError(404, f"No admin route {method} /admin/{'/'.join(parts)}.", "not_found")


def check_path_names(parts: list[str]) -> None:
    """A tenant name or key id in the path must be one: it becomes part of a Redis key, and a name such as
    ``foo:keys`` would address another record (a 500 from Redis's WRONGTYPE, or worse, the wrong data)."""
    if len(parts) >= 2 and parts[0] == "tenants":
        try:
            validate_tenant_name(parts[1])
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_tenant_name", "name") from None
    if len(parts) == 2 and parts[0] == "keys" and not is_key_id(parts[1]):
        raise bad_request(f"key id {parts[1][:80]!r} is not {KEY_ID_HEX_CHARS} lowercase hex characters (the "
                          "key_id an issued key came with)", "invalid_key_id", "key_id")


async def usage_report(admission: Admission, tenant: Tenant, query: bytes) -> dict[str, Any]:
    """The tenant's usage in the current ``?period=`` (default: its budget period), with its budget."""
    period = parse_qs(query.decode("latin-1")).get("period", [tenant.policy.budget_period])[0]
    try:
        check_period(period)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_period", "period") from None
    report: dict[str, Any] = {"tenant": tenant.name, **(await admission.usage(tenant.name, period))}
    if period == tenant.policy.budget_period:
        report["token_budget"] = tenant.policy.token_budget
    return report


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    return data
