"""Precise KV-aware routing end to end: real vLLM engines with tiny KV caches feed the Redis index from
their own KV events; real gateway processes route on it.

- a prefix served by engine A is routed back to A (x-tessera-engine, engine-reported cached tokens);
- A evicts it (its events say BlockRemoved), the index forgets it, and routing stops preferring A;
- two gateway processes see the same index;
- a stopped engine leaves the registry and the index and is no longer routed to.

The tests run in file order and share one stack; the last one stops an engine.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
import pytest

from tessera.engine.host import EngineHost
from tessera.redis_conn import connect
from tessera.registry import EngineRegistry
from tessera.routing.hashing import block_hash_chain
from tessera.routing.kv_events import DecodedBatch, KVEventSubscriber
from tessera.routing.prefix_index import PrefixIndex
from tests.support.data_plane import ENGINE_AUTH
from tests.support.routing_stack import MODEL, REGISTRY_MAX_AGE_S, RoutingStack

pytestmark = pytest.mark.engine

BLOCK = 32
VOCAB = 700  # the generated tokenizer's vocabulary is a little over 700 ids


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


@dataclass
class Completion:
    engine: str
    reason: str
    cached_tokens: int

    @property
    def credited_tokens(self) -> int:
        match = re.search(r"cached_tokens=(\d+)", self.reason)
        return int(match.group(1)) if match else 0


async def complete(stack: RoutingStack, gateway: int, prompt: list[int]) -> Completion:
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(f"{stack.gateways[gateway].url}/v1/completions",
                                     headers={"authorization": f"Bearer {stack.api_key}"},
                                     json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return Completion(response.headers["x-tessera-engine"], response.headers["x-tessera-route-reason"], cached)


async def generate_direct(host: EngineHost, prompt: list[int], cache_salt: str | None = None) -> dict:
    body = {"request_id": f"direct-{time.monotonic_ns()}", "prompt_token_ids": prompt, "max_tokens": 1,
            "cache_salt": cache_salt}
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(f"{host.url}/generate", json=body, auth=ENGINE_AUTH)
    assert response.status_code == 200
    final = [line for line in response.text.splitlines() if line][-1]
    import orjson

    return dict(orjson.loads(final))


@pytest.fixture
async def index(routing_stack: RoutingStack) -> AsyncIterator[PrefixIndex]:
    redis = connect(routing_stack.redis_url, timeout_s=5.0)
    yield PrefixIndex(redis)
    await redis.aclose()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return await check()


def engine_by_id(stack: RoutingStack, engine_id: str) -> EngineHost:
    return next(e for e in stack.engines if e.engine_id == engine_id)


async def test_a_prefix_is_routed_back_until_its_engine_evicts_it(routing_stack: RoutingStack,
                                                                   index: PrefixIndex) -> None:
    stack = routing_stack
    ids = [e.engine_id for e in stack.engines]
    system = tokens(1, 10 * BLOCK)  # ten full blocks shared by the requests below
    chain = block_hash_chain(system, BLOCK, stack.cache_salt)

    first = await complete(stack, 0, system + tokens(2, 10))
    a = engine_by_id(stack, first.engine)
    b = next(e for e in stack.engines if e is not a)
    assert first.cached_tokens == 0
    # The gateway's own hash chain finds exactly the blocks A announced in its KV events.
    assert await eventually(lambda: _lookup_is(index, chain, ids, {a.engine_id: 10}))

    # B gets the first four blocks (same tenant salt) straight from the engine API.
    await generate_direct(b, system[:4 * BLOCK + 5], stack.cache_salt)
    assert await eventually(lambda: _lookup_is(index, chain, ids, {a.engine_id: 10, b.engine_id: 4}))

    back = await complete(stack, 1, system + tokens(3, 12))
    assert back.engine == a.engine_id
    assert back.credited_tokens == 10 * BLOCK and back.cached_tokens == 10 * BLOCK

    # Evict on A: unique 600-token prompts overflow its 31 blocks; record A's own KV events meanwhile.
    removed: set[int] = set()
    events = KVEventSubscriber(f"tcp://127.0.0.1:{a.kv_events_port}", a.config.kv_events.topic)
    recorder = asyncio.create_task(_record_removals(events, removed))
    await asyncio.sleep(0.5)  # let the subscription reach the publisher
    try:
        for seed in range(100, 108):
            await generate_direct(a, tokens(seed, 600))
            if await eventually(lambda: _lookup_is(index, chain, ids, {b.engine_id: 4}), timeout_s=1.0):
                break
        assert await _lookup_is(index, chain, ids, {b.engine_id: 4}), "the index still credits A"
        assert await eventually(lambda: _async_true(chain[0] in removed), timeout_s=5.0), (
            "A's KV events never reported BlockRemoved for the prefix's first block")
    finally:
        recorder.cancel()
        events.close()

    after = await complete(stack, 0, system + tokens(4, 12))
    assert after.engine == b.engine_id, after.reason
    assert after.credited_tokens == 4 * BLOCK and after.cached_tokens == 4 * BLOCK


async def test_two_gateway_processes_see_the_same_index(routing_stack: RoutingStack, index: PrefixIndex) -> None:
    stack = routing_stack
    ids = [e.engine_id for e in stack.engines]
    system = tokens(20, 8 * BLOCK)
    chain = block_hash_chain(system, BLOCK, stack.cache_salt)
    first = await complete(stack, 0, system + tokens(21, 7))
    assert await eventually(lambda: _lookup_is(index, chain, ids, {first.engine: 8}))
    # Gateway 1 never saw this prompt: only the shared index can send it to the same engine.
    via_other = await complete(stack, 1, system + tokens(22, 7))
    via_same = await complete(stack, 0, system + tokens(23, 7))
    assert via_other.engine == via_same.engine == first.engine
    assert via_other.credited_tokens == via_same.credited_tokens == 8 * BLOCK
    assert via_other.cached_tokens == via_same.cached_tokens == 8 * BLOCK


async def test_a_stopped_engine_leaves_the_registry_and_the_index(routing_stack: RoutingStack,
                                                                  index: PrefixIndex) -> None:
    stack = routing_stack
    ids = [e.engine_id for e in stack.engines]
    system = tokens(30, 6 * BLOCK)
    chain = block_hash_chain(system, BLOCK, stack.cache_salt)
    first = await complete(stack, 0, system + tokens(31, 5))
    leaving = engine_by_id(stack, first.engine)
    staying = next(e for e in stack.engines if e is not leaving)
    assert await eventually(lambda: _lookup_is(index, chain, ids, {leaving.engine_id: 6}))

    await asyncio.to_thread(leaving.stop)
    redis = connect(stack.redis_url, timeout_s=5.0)
    try:
        live = [e.engine_id for e in await EngineRegistry(redis).live_engines()]
    finally:
        await redis.aclose()
    assert leaving.engine_id not in live and staying.engine_id in live
    assert await index.blocks_of(leaving.engine_id) == {}
    assert leaving.engine_id not in await index.indexed_engines()

    await asyncio.sleep(REGISTRY_MAX_AGE_S)  # the gateways' registry views no longer hold the engine
    for gateway in (0, 1, 0, 1):
        routed = await complete(stack, gateway, system + tokens(40 + gateway, 5))
        assert routed.engine == staying.engine_id and routed.credited_tokens in (0, 6 * BLOCK)


async def _lookup_is(index: PrefixIndex, chain: tuple[int, ...], engine_ids: list[str],
                     expected: dict[str, int]) -> bool:
    return await index.longest_prefixes(chain, engine_ids) == expected


async def _async_true(value: bool) -> bool:
    return value


async def _record_removals(events: KVEventSubscriber, removed: set[int]) -> None:
    batch: DecodedBatch
    async for batch in events:
        removed.update(h for op, h in batch.ops if op == "remove")
