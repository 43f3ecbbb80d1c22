"""Phase ``authenticate``: the bearer key's tenant (401 without one). The key cache and its fail-open
behaviour are ``auth.Authenticator``'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.gateway.errors import unauthorized

if TYPE_CHECKING:
    from tessera.gateway.auth import Authenticator
    from tessera.gateway.request.context import RequestContext
    from tessera.tenancy.store import Tenant


async def authenticate(ctx: RequestContext, auth: Authenticator) -> None:
    ctx.tenant = await require_tenant(auth, ctx.headers)
    ctx.notes.attributes["tessera.tenant"] = ctx.tenant.name


async def require_tenant(auth: Authenticator, headers: dict[str, str]) -> Tenant:
    """The tenant of the request's key (also for the gateway's other tenant routes), else 401."""
    tenant = await auth.tenant_for(headers.get("authorization"))
    if tenant is None:
        raise unauthorized()
    return tenant
