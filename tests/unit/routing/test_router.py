"""The Router adapter on a Redis of its own (so its command counts are exact): registry + index → policy,
one Lua round trip per request for the prefix lookup, dead engines out of the ranking and the index."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable

import pytest
import redis.asyncio as aioredis

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing import policies as policies_module
from tessera.routing import router as router_module
from tessera.routing.local_index import LocalPrefixIndex
from tessera.routing.pod_in_flight import PodInFlight
from tessera.routing.pod_view import PodEngines
from tessera.routing.prefix_index import PrefixIndex
from tessera.routing.router import InFlight, Router, engine_view
from tessera.routing.snapshot import EngineView, RouteRequest

MODEL = "m"


@pytest.fixture
async def redis(own_redis: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    client = connect(own_redis.url, timeout_s=5.0)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture(autouse=True)
def quiet_refresher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command counts below are exact: the background registry refresher waits a minute here (the
    tests of the refresher itself set their own period)."""
    monkeypatch.setattr(router_module, "REGISTRY_CACHE_S", 60.0)


async def register(redis: aioredis.Redis, *engine_ids: str, model: str = MODEL,
                   heartbeat_interval_s: float = 1.0) -> None:
    registry = EngineRegistry(redis, heartbeat_interval_s)
    for engine_id in engine_ids:
        await registry.heartbeat(EngineRecord(engine_id, f"http://{engine_id}", model, 32, 100, 2048))


def chain(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.getrandbits(64) for _ in range(n))


def request(hashes: tuple[int, ...]) -> RouteRequest:
    return RouteRequest(tenant="t", model=MODEL, num_prompt_tokens=32 * len(hashes) + 7, block_hashes=hashes)


async def commands_served(redis: aioredis.Redis) -> dict[str, int]:
    """Calls per command since the server started, as sent by clients (Redis also counts the commands a
    Lua script runs; the lookup script only runs HKEYS, so that one is left out)."""
    stats = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()
            if k not in ("cmdstat_info", "cmdstat_hkeys")}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


async def test_routes_to_the_engine_holding_the_prefix(redis: aioredis.Redis) -> None:
    await register(redis, "a", "b", "c")
    index = PrefixIndex(redis)
    hashes = chain(6)
    await index.apply("b", [("store", h) for h in hashes[:5]])
    await index.apply("c", [("store", h) for h in hashes[:2]])
    decision, records = await Router(redis, "prefix_affinity", index).route(request(hashes))
    assert decision.ranked[0] == "b" and decision.expected_cached_tokens == 160
    assert "cached_tokens=160" in decision.reason
    assert set(decision.ranked) == set(records) == {"a", "b", "c"}


async def test_one_redis_call_per_request_for_the_prefix_lookup(redis: aioredis.Redis) -> None:
    await register(redis, "a", "b")
    index = PrefixIndex(redis)
    router = Router(redis, "prefix_affinity", index)
    await router.route(request(chain(4)))  # reads the registry and loads the scripts
    before = await commands_served(redis)
    for seed in range(10):
        await router.route(request(chain(32, seed)))
    # Ten routes inside one registry-cache window: ten round trips (the EVALSHA lookups), nothing else.
    assert delta(before, await commands_served(redis)) == {"evalsha": 10}


async def test_policies_without_the_index_make_no_lookup(redis: aioredis.Redis) -> None:
    await register(redis, "a", "b")
    router = Router(redis, "round_robin", PrefixIndex(redis))
    await router.route(request(chain(4)))
    before = await commands_served(redis)
    for _ in range(5):
        await router.route(request(chain(4)))
    assert delta(before, await commands_served(redis)) == {}


async def test_a_registry_read_builds_what_the_decisions_after_it_need(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """prefix_affinity's fleet (per model) and the local index's live-engine masks are built as the registry
    is read (by the refresher, off the request path), not by the first request after each read, which paid
    ~1.5-2 ms of its route for them at 1,000 engines; two models' decisions share no cache slot either."""
    await register(redis, "a", "b")
    await register(redis, "x", "y", model="other")
    router = Router(redis, "prefix_affinity", PrefixIndex(redis), index_source="local")
    await router.start_local_index()
    await router.num_live_engines()  # a registry read, as the refresher makes one
    fleets_built: list[int] = []
    masks_built: list[int] = []
    build_fleet, build_mask = policies_module._Fleet.of, LocalPrefixIndex.live_mask

    def counted_fleet(engines: tuple[EngineView, ...]) -> policies_module._Fleet:
        fleets_built.append(len(engines))
        return build_fleet(engines)

    def counted_mask(index: LocalPrefixIndex, engine_ids: Iterable[str]) -> int:
        masks_built.append(1)
        return build_mask(index, engine_ids)

    monkeypatch.setattr(policies_module._Fleet, "of", counted_fleet)
    monkeypatch.setattr(LocalPrefixIndex, "live_mask", counted_mask)
    for seed in range(6):
        model = MODEL if seed % 2 else "other"
        decision, _ = await router.route(request(chain(4, seed))._replace(model=model))
        assert set(decision.ranked) == ({"a", "b"} if model == MODEL else {"x", "y"})
    assert fleets_built == [] and masks_built == []
    await router.num_live_engines()  # the next read builds them again, for both models
    assert sorted(fleets_built) == [2, 2] and len(masks_built) == 2
    await router.close()


async def test_engines_of_other_models_and_departed_engines_are_not_ranked(redis: aioredis.Redis) -> None:
    await register(redis, "a", "b")
    await register(redis, "x", model="other")
    index = PrefixIndex(redis)
    hashes = chain(3)
    await index.apply("gone", [("store", h) for h in hashes])  # an engine no longer in the registry
    decision, _ = await Router(redis, "prefix_affinity", index).route(request(hashes))
    assert sorted(decision.ranked) == ["a", "b"] and "miss" in decision.reason
    await EngineRegistry(redis).deregister("b")
    decision, _ = await Router(redis, "prefix_affinity", index).route(request(hashes))
    assert decision.ranked == ("a",)


async def test_the_router_sweeps_departed_engines_out_of_the_index(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "SWEEP_INTERVAL_S", 0.0)
    # NOTE: not 0. A refresher re-reading the registry with no pause starved this test's own loop for
    # seconds (hundreds of reads, each starting a sweep), until "a" — registered once — passed the router's
    # liveness window (5 heartbeat periods of its own registry, whatever the registering side's period) and
    # was rightly swept as dead: the test failed about one run in eight.
    monkeypatch.setattr(router_module, "REGISTRY_CACHE_S", 0.02)
    await register(redis, "a", heartbeat_interval_s=60.0)
    index = PrefixIndex(redis)
    hashes = chain(3)
    await index.apply("a", [("store", h) for h in hashes])
    await index.apply("gone", [("store", h) for h in hashes])
    monkeypatch.setattr("tessera.routing.prefix_index.SWEEP_GRACE_S", 0.0)
    router = Router(redis, "prefix_affinity", index)
    await router.route(request(hashes))
    for _ in range(50):
        if await index.blocks_of("gone") == {}:
            break
        await asyncio.sleep(0.05)
    await router.close()
    assert await index.blocks_of("gone") == {}
    assert await index.blocks_of("a") == {h: 1 for h in hashes}


async def test_empty_fleet_routes_nowhere(redis: aioredis.Redis) -> None:
    decision, records = await Router(redis, "prefix_affinity", PrefixIndex(redis)).route(request(chain(2)))
    assert decision.ranked == () and records == {}


async def test_the_refresher_rereads_the_registry_off_the_request_path(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "REGISTRY_CACHE_S", 0.05)
    monkeypatch.setattr(router_module, "REGISTRY_MAX_AGE_S", 60.0)  # a request never reads it itself
    await register(redis, "a")
    router = Router(redis, "round_robin", PrefixIndex(redis))
    try:
        assert (await router.route(request(chain(1))))[0].ranked == ("a",)
        await register(redis, "b")
        for _ in range(100):
            decision, _ = await router.route(request(chain(1)))
            if "b" in decision.ranked:
                break
            await asyncio.sleep(0.02)
        assert sorted(decision.ranked) == ["a", "b"]
    finally:
        await router.close()


async def test_the_refresher_stops_when_requests_stop(redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "REGISTRY_CACHE_S", 0.02)
    monkeypatch.setattr(router_module, "REFRESHER_IDLE_S", 0.2)
    await register(redis, "a")
    router = Router(redis, "round_robin", PrefixIndex(redis))
    await router.route(request(chain(1)))
    await asyncio.sleep(0.6)
    before = await commands_served(redis)
    await asyncio.sleep(0.2)
    assert delta(before, await commands_served(redis)) == {}  # idle: no registry reads
    await router.close()


async def test_a_stale_copy_is_read_on_the_request_path(redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "REGISTRY_MAX_AGE_S", 0.0)  # every copy is too old
    await register(redis, "a")
    router = Router(redis, "round_robin", PrefixIndex(redis))
    await router.route(request(chain(1)))
    await register(redis, "b")
    decision, _ = await router.route(request(chain(1)))  # no waiting: read on the spot
    assert sorted(decision.ranked) == ["a", "b"]
    await router.close()


async def test_the_registry_is_read_over_the_wire_and_reloads_a_lost_script(
        own_redis: EmbeddedRedis, redis: aioredis.Redis) -> None:
    from tessera.redis_wire import RedisWire

    await register(redis, "a", "b")
    wire = RedisWire(own_redis.url, 5.0)
    router = Router(redis, "round_robin", PrefixIndex(redis), wire=wire)
    try:
        assert sorted(r.engine_id for r in await router.engines(MODEL)) == ["a", "b"]
        await redis.script_flush()  # a restarted Redis: NOSCRIPT on the wire, redis-py loads it again
        assert await router.num_live_engines() == 2
    finally:
        await router.close()
        await wire.close()


async def test_periods_given_to_the_router_override_the_defaults(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    await register(redis, "a")
    router = Router(redis, "round_robin", PrefixIndex(redis), refresh_s=60.0, max_age_s=0.0)
    await router.route(request(chain(1)))
    await register(redis, "b")
    decision, _ = await router.route(request(chain(1)))  # max age 0: read on the spot
    assert sorted(decision.ranked) == ["a", "b"]
    await router.close()


def test_in_flight_counts_a_requests_prefill_tokens_until_its_first_token() -> None:
    loads = PodInFlight.private()
    engines = PodEngines(["a"])

    def counts() -> tuple[dict[str, int], dict[str, int]]:
        requests, tokens, _ = loads.totals(engines, 0.0)
        return dict(requests), dict(tokens)

    with InFlight(loads, "a", 300) as flight, InFlight(loads, "a", 200):
        assert counts() == ({"a": 2}, {"a": 500})
        flight.prefilled()
        flight.prefilled()  # once
        assert counts() == ({"a": 2}, {"a": 200})
    # The other one ended before its first token (a failure): its tokens leave with it.
    assert counts() == ({}, {})


def test_a_replicas_prefill_backlog_reaches_the_policys_view_through_the_registry() -> None:
    record = EngineRecord("a", "http://a", MODEL, 32, 100, 2048, num_running=2, pending_prefill_tokens=4096)
    view = engine_view(EngineRecord.from_redis({k.encode(): v.encode() for k, v in record.to_redis().items()}))
    assert view.pending_prefill_tokens == 4096 and view.load == 2
