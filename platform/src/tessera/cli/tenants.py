"""``tessera tenants`` and ``tessera keys``: manage tenants straight in Redis (the admin API does the same
over HTTP). Redis is ``TESSERA_REDIS_URL``, or the local platform that ``make run`` started.

NOTE: the Redis client, the settings and the tenancy modules are imported when a command runs, not when
the ``tessera`` command is built: the Redis client alone pulls OpenTelemetry, and ``--help`` needs none of it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from tessera.cli.json_args import json_object

if TYPE_CHECKING:
    from pydantic import ValidationError

    from tessera.tenancy.admission import Admission
    from tessera.tenancy.policy import TenantPolicy
    from tessera.tenancy.store import TenantStore

tenants_app = typer.Typer(no_args_is_help=True, help="Create, list, update and delete tenants.")
keys_app = typer.Typer(no_args_is_help=True, help="Issue, list and revoke API keys.")
T = TypeVar("T")


def redis_url() -> str:
    from tessera.settings import load_settings

    settings = load_settings()
    if settings.redis_url:
        return settings.redis_url
    local = settings.state_dir / "run" / "redis_url"
    if local.exists():
        return local.read_text().strip()
    raise typer.BadParameter("no Redis: set TESSERA_REDIS_URL or start the local platform with 'make run'")


def run_with_store(fn: Callable[[TenantStore, Admission], Awaitable[T]]) -> T:
    from tessera.redis_conn import connect
    from tessera.tenancy.admission import Admission
    from tessera.tenancy.store import TenantExistsError, TenantNotFoundError, TenantStore

    async def main() -> T:
        redis = connect(redis_url(), timeout_s=5.0)
        try:
            return await fn(TenantStore(redis), Admission(redis))
        finally:
            await redis.aclose()

    try:
        return asyncio.run(main())
    except (TenantNotFoundError, TenantExistsError, KeyError, ValueError) as exc:
        typer.echo(f"error: {exc.args[0] if exc.args else exc}", err=True)
        raise typer.Exit(2) from None


def read_policy_changes(policy_json: str | None, policy_file: Path | None) -> dict[str, Any]:
    """Policy fields from --policy-file, then --policy (which wins); a JSON object either way."""
    data: dict[str, Any] = {}
    for source, text in (("--policy-file", policy_file.read_text() if policy_file else None),
                         ("--policy", policy_json)):
        data.update(json_object(text, source, "a JSON object of policy fields") or {})
    return data


def policy_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return f"invalid policy: {'.'.join(map(str, first['loc']))}: {first['msg']}"


def parse_policy(policy_json: str | None, policy_file: Path | None) -> TenantPolicy:
    from pydantic import ValidationError

    from tessera.tenancy.policy import TenantPolicy

    data = read_policy_changes(policy_json, policy_file)
    try:
        return TenantPolicy.model_validate(data)
    except ValidationError as exc:
        typer.echo(f"error: {policy_error(exc)}", err=True)
        raise typer.Exit(2) from None


@tenants_app.command("create")
def create(name: str, policy: str = typer.Option(None, help="Policy as JSON, e.g. '{\"requestsPerMinute\": 60}'."),
           policy_file: Path = typer.Option(None, help="Policy JSON file.")) -> None:
    """Create a tenant and print its first API key (shown once; only its hash is stored)."""
    parsed = parse_policy(policy, policy_file)

    async def go(store: TenantStore, _: Admission) -> str:
        await store.create_tenant(name, parsed)
        return (await store.issue_key(name)).plaintext

    key = run_with_store(go)
    typer.echo(f"tenant {name} created\nkey: {key}\n(store it now: it is not shown again)")


@tenants_app.command("list")
def list_tenants(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List tenants and their policies."""
    tenants = run_with_store(lambda store, _: store.list_tenants())
    if as_json:
        rows = [{"name": t.name, "policy": t.policy.model_dump(mode="json")} for t in tenants]
        typer.echo(json.dumps(rows, indent=2))
        return
    for t in tenants:
        p = t.policy
        typer.echo(f"{t.name:24} priority={p.priority_class:8} rpm={p.requests_per_minute} "
                   f"tpm={p.tokens_per_minute} concurrency={p.max_concurrent_requests} kv_quota={p.kv_quota}")


@tenants_app.command("update")
def update(name: str, policy: str = typer.Option(None, help="Fields to change, as JSON."),
           policy_file: Path = typer.Option(None, help="Fields to change, JSON file.")) -> None:
    """Change some policy fields of a tenant (the rest stay)."""
    from pydantic import ValidationError

    changes = read_policy_changes(policy, policy_file)

    async def go(store: TenantStore, _: Admission) -> TenantPolicy:
        current = await store.require_tenant(name)
        try:
            merged = current.policy.updated(changes)
        except ValidationError as exc:
            raise ValueError(policy_error(exc)) from None
        return (await store.set_policy(name, merged)).policy

    typer.echo(run_with_store(go).model_dump_json(indent=2))


@tenants_app.command("delete")
def delete(name: str) -> None:
    """Delete a tenant; its keys stop working on every gateway within 2 s."""
    run_with_store(lambda store, _: store.delete_tenant(name))
    typer.echo(f"tenant {name} deleted")


@tenants_app.command("usage")
def usage(name: str, period: str = typer.Option("month", help="hour, day or month.")) -> None:
    """Requests and tokens of the current period."""
    async def go(store: TenantStore, admission: Admission) -> dict[str, Any]:
        await store.require_tenant(name)
        return await admission.usage(name, period)

    typer.echo(json.dumps(run_with_store(go), indent=2))


@keys_app.command("issue")
def issue(tenant: str) -> None:
    """Issue a new key for a tenant (printed once)."""
    issued = run_with_store(lambda store, _: store.issue_key(tenant))
    typer.echo(f"key: {issued.plaintext}\nkey id: {issued.key_id}")


@keys_app.command("list")
def list_keys(tenant: str) -> None:
    """List a tenant's keys by prefix (the keys themselves are not stored)."""
    for k in run_with_store(lambda store, _: store.list_keys(tenant)):
        typer.echo(f"{k.display_prefix:24} {'revoked' if k.revoked else 'active'}")


@keys_app.command("revoke")
def revoke(key_id: str) -> None:
    """Revoke a key by its id (the 12 hex characters after 'tsk-')."""
    tenant = run_with_store(lambda store, _: store.revoke_key(key_id))
    typer.echo(f"key {key_id} of tenant {tenant} revoked")
