"""Admission, the demotion flag and the prefix lookup share one Redis round trip (the gateway's ``Admitter``
over ``tenancy.admission_trip``), against real Redis: the pipelined answers equal the standalone ones, a
recently rejected tenant's admissions carry no lookup, a demotion shows from the next request on, and a
Redis that lost its scripts (NOSCRIPT) still admits exactly once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tessera.gateway.app import Gateway
from tessera.gateway.failopen import FailOpen
from tessera.gateway.request.admit import Admitter
from tessera.gateway.request.route import decide
from tessera.redis_conn import EmbeddedRedis
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing.hashing import block_hash_chain
from tessera.routing.prefix_index import PrefixIndex
from tessera.routing.snapshot import RouteRequest
from tessera.settings import TesseraSettings
from tessera.tenancy.admission import Lease, Rejection
from tessera.tenancy.admission_trip import build_trip, parse_trip
from tessera.tenancy.demotion import clear_demoted, set_demoted
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import Tenant

BLOCK = 32


@pytest.fixture
async def gateway(redis_server: EmbeddedRedis) -> AsyncIterator[Gateway]:
    gw = Gateway(TesseraSettings(redis_url=redis_server.url, trace_exporter="none", prefix_index="redis"))
    yield gw
    await gw.router.close()
    await gw.wire.close()
    await gw.redis.aclose()


def _admitter(gw: Gateway) -> Admitter:
    return Admitter(gw.admission, gw.wire, gw.router, gw.metrics, FailOpen(False))


async def _setup(gw: Gateway, policy: TenantPolicy) -> tuple[Tenant, RouteRequest, tuple[int, ...]]:
    """A tenant, two live engines of a fresh model, and a prompt whose first 2 blocks engine -a holds."""
    suffix = uuid.uuid4().hex[:8]
    tenant = await gw.store.create_tenant(f"rt-{suffix}", policy)
    model = f"rt-model-{suffix}"
    registry = EngineRegistry(gw.redis)
    for name in ("a", "b"):
        await registry.heartbeat(EngineRecord(f"rt-{suffix}-{name}", f"http://127.0.0.1:1/{name}", model, BLOCK,
                                              64, 4096))
    prompt = list(range(100, 100 + 3 * BLOCK))
    chain = block_hash_chain(prompt, BLOCK, tenant.cache_salt)
    await PrefixIndex(gw.redis).apply(f"rt-{suffix}-a", [("store", h) for h in chain[:2]])
    request = RouteRequest(tenant=tenant.name, model=model, num_prompt_tokens=len(prompt), block_hashes=chain,
                           prompt_prefix="", session_id=None)
    return tenant, request, chain


def _forbid(obj: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def called(*_: Any, **__: Any) -> None:
        raise AssertionError(f"{name} made a round trip of its own")
    monkeypatch.setattr(obj, name, called)


async def test_an_admitted_request_gets_its_prefix_lookup_in_the_same_round_trip(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    flow = _admitter(gateway)
    tenant, request, _ = await _setup(gateway, TenantPolicy(requests_per_minute=10))
    plan = await gateway.router.plan(request)
    standalone = await gateway.router.lookup(plan)
    assert standalone == {f"{request.model.replace('rt-model', 'rt')}-a": 2}
    await flow.admit(tenant, 500, plan)  # a fresh Redis has no scripts yet: the first admission loads them
    _forbid(gateway.admission, "admit", monkeypatch)
    _forbid(gateway.router, "lookup", monkeypatch)
    decision, cached, _ = await flow.admit(tenant, 500, plan)
    assert isinstance(decision, Lease)
    assert cached == standalone
    route, _ = gateway.router.decide(plan, cached)
    assert route.ranked[0].endswith("-a") and route.expected_cached_tokens == 2 * BLOCK
    assert await gateway.admission.in_flight(tenant.name) == 2


async def test_a_recently_rejected_tenant_is_admitted_without_the_lookup(gateway: Gateway) -> None:
    flow = _admitter(gateway)
    tenant, request, _ = await _setup(gateway, TenantPolicy(requests_per_minute=1))
    plan = await gateway.router.plan(request)
    first, cached, _ = await flow.admit(tenant, 100, plan)
    assert isinstance(first, Lease) and cached is not None
    second, cached, _ = await flow.admit(tenant, 100, plan)
    assert isinstance(second, Rejection) and second.limit == "requests_per_minute"
    flow.note_rejected(tenant.name)  # as a rejection in Admitter.run records it
    third, cached, _ = await flow.admit(tenant, 100, plan)
    assert isinstance(third, Rejection) and cached is None  # no lookup rode along


async def test_lost_scripts_still_admit_once_and_route_later(gateway: Gateway) -> None:
    flow = _admitter(gateway)
    tenant, request, _ = await _setup(gateway, TenantPolicy(requests_per_minute=2))
    plan = await gateway.router.plan(request)
    await gateway.redis.script_flush()  # a restarted Redis: neither script is loaded
    decision, cached, _ = await flow.admit(tenant, 100, plan)
    assert isinstance(decision, Lease)
    assert cached is None  # the lookup failed with NOSCRIPT: the route does its own
    route, _ = await decide(gateway.router, FailOpen(False), request, plan, cached)
    assert route.ranked[0].endswith("-a")
    # Admitted exactly once: one more fits under 2/min, the next does not.
    assert isinstance(await gateway.admission.admit(tenant.name, tenant.policy, 100), Lease)
    assert isinstance(await gateway.admission.admit(tenant.name, tenant.policy, 100), Rejection)


async def test_a_prompt_without_full_blocks_needs_no_lookup(gateway: Gateway) -> None:
    flow = _admitter(gateway)
    tenant, request, _ = await _setup(gateway, TenantPolicy())
    short = RouteRequest(tenant=tenant.name, model=request.model, num_prompt_tokens=5, block_hashes=(),
                         prompt_prefix="", session_id=None)
    plan = await gateway.router.plan(short)
    assert plan.lookup_args is None
    decision, cached, _ = await flow.admit(tenant, 100, plan)
    assert isinstance(decision, Lease) and cached == {}


async def test_the_demotion_flag_rides_in_admission_and_applies_at_once(gateway: Gateway,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    flow = _admitter(gateway)
    tenant, request, _ = await _setup(gateway, TenantPolicy())
    plan = await gateway.router.plan(request)
    assert (await flow.admit(tenant, 100, plan)).demoted is False
    await set_demoted(gateway.redis, tenant.name, "kv quota exceeded", ttl_s=30)
    _forbid(gateway.admission, "admit", monkeypatch)  # the flag comes in the same pipeline, not a call of its own
    admitted = await flow.admit(tenant, 100, plan)
    assert isinstance(admitted.decision, Lease) and admitted.demoted is True
    await clear_demoted(gateway.redis, tenant.name)
    assert (await flow.admit(tenant, 100, plan)).demoted is False


async def test_each_controller_shard_demotes_on_its_own_flag(gateway: Gateway,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With the engines split among three controller shards, the gateway reads all three flags in the same
    round trip, and one shard clearing its flag does not lift another shard's demotion."""
    monkeypatch.setattr(gateway.admission, "demotion_shards", 3)
    flow = _admitter(gateway)
    tenant, request, _ = await _setup(gateway, TenantPolicy())
    plan = await gateway.router.plan(request)
    await set_demoted(gateway.redis, tenant.name, "kv quota exceeded on e7", ttl_s=30, shard=2)
    _forbid(gateway.admission, "admit", monkeypatch)
    assert (await flow.admit(tenant, 100, plan)).demoted is True
    await clear_demoted(gateway.redis, tenant.name, shard=0)  # shard 0 restores the tenant on its engines
    assert (await flow.admit(tenant, 100, plan)).demoted is True
    await clear_demoted(gateway.redis, tenant.name, shard=2)
    assert (await flow.admit(tenant, 100, plan)).demoted is False


async def test_the_trip_is_one_write_whose_replies_parse_to_the_standalone_answers(gateway: Gateway) -> None:
    tenant, request, _ = await _setup(gateway, TenantPolicy(requests_per_minute=1))
    plan = await gateway.router.plan(request)
    assert plan.lookup is not None
    await gateway.admission.admit(tenant.name, tenant.policy, 1)  # loads the script; uses the one request
    await gateway.router.lookup(plan)  # loads the lookup script
    trip = build_trip(gateway.admission, tenant.name, tenant.policy, 100, plan.lookup)
    assert [c[0] for c in trip.commands] == ["EVALSHA", "EXISTS", "EVALSHA"]
    reply = await parse_trip(gateway.admission, trip, await gateway.wire.execute(trip.commands))
    assert isinstance(reply.decision, Rejection) and reply.decision.limit == "requests_per_minute"
    assert reply.demoted is False
    assert gateway.router.parse_lookup(reply.extra) == await gateway.router.lookup(plan)
    bare = build_trip(gateway.admission, tenant.name, tenant.policy, 100)
    assert len(bare.commands) == 2 and not bare.carries_extra
    assert (await parse_trip(gateway.admission, bare, await gateway.wire.execute(bare.commands))).extra is None


async def test_on_the_local_index_the_engines_events_ride_in_admission_and_the_route_sees_them(
        redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the gateway's local index no lookup rides along: the index feed's stream read does, so the route
    # right after admission sees every batch published before it without a read of the feed's own.
    gw = Gateway(TesseraSettings(redis_url=redis_server.url, trace_exporter="none", prefix_index="local"))
    try:
        flow = _admitter(gw)
        tenant, request, chain = await _setup(gw, TenantPolicy())
        # One token past the three blocks, so that all three count (the engine computes at least one token).
        request = request._replace(num_prompt_tokens=request.num_prompt_tokens + 1)
        await gw.router.start_local_index()
        feed = gw.router.local_feed
        assert feed is not None
        feed.stop()  # from here on only the rides read the stream (a stopped feed still takes them)
        await asyncio.sleep(0.05)
        holder = request.model.replace("rt-model", "rt") + "-b"  # new to the index: its first blocks
        await PrefixIndex(gw.redis).apply(holder, [("store", h) for h in chain])  # after the warm start
        plan = await gw.router.plan(request)
        assert plan.lookup is None and plan.local
        await flow.admit(tenant, 100, plan)  # loads the admission script (its NOSCRIPT path) ...
        _forbid(gw.admission, "admit", monkeypatch)
        reads, rides = feed.num_reads, feed.num_rides
        decision, cached, _ = await flow.admit(tenant, 100, plan)  # ... so this one is the one round trip
        assert isinstance(decision, Lease) and cached == {}
        assert feed.num_rides == rides + 1 and feed.num_reads == reads
        route, _ = gw.router.decide(plan, cached)
        assert route.ranked[0] == holder  # its three blocks against -a's two
    finally:
        await gw.router.close()
        await gw.wire.close()
        await gw.feed_wire.close()
        await gw.redis.aclose()
