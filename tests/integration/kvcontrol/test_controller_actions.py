"""Each controller action end to end, on two real engines (64 KV blocks each), one gateway process and the
``tessera-kvcontrol`` process: over-quota demotion, the pressure flag honoured by routing and by admission,
and the last-resort abort that the gateway continues on the other engine — billed once, streamed once, and
traced under the client's own trace id together with the engines' and the controller's spans."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from tessera.redis_conn import connect
from tessera.registry import pressure_key
from tessera.telemetry.spanfile import SpanRecord, load_spans
from tessera.tenancy.demotion import demoted_key
from tessera.tenancy.policy import DEMOTION_STEP, PRIORITY_VALUES, TenantPolicy
from tessera.tenancy.store import TenantStore
from tests.support.data_plane import ENGINE_AUTH
from tests.support.kvstack import ADMIN_TOKEN, REGISTRY_MAX_AGE_S, KVStack, complete, new_client
from tests.support.poll import async_wait_until

pytestmark = pytest.mark.engine

ONLY_DEMOTION = {"enablePressure": False, "enableAbort": False}


@pytest.fixture(scope="module")
def act_stack(make_stack: Any) -> KVStack:
    # 128 blocks (4,064 tokens) per engine and one token per step (no speculative decoding): a request can
    # run long enough to be seen and acted on, and a few of them still exhaust the cache.
    return make_stack("act", num_engines=2, num_gpu_blocks_override=128, max_model_len=4000, speculative=None)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                   stack: KVStack | None = None, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(every_s)
    state = ""
    if stack is not None and stack.controller is not None:
        state = "\n".join(line for line in httpx.get(stack.metrics_url, timeout=5).text.splitlines()
                          if line.startswith(("tessera_kv", "tessera_engine")) and not line.endswith(" 0.0"))
    raise AssertionError(f"timed out waiting for {what}\n{state}")


async def redis_exists(stack: KVStack, key: str) -> bool:
    redis = connect(stack.options.redis_url, timeout_s=5)
    try:
        return bool(await redis.exists(key))
    finally:
        await redis.aclose()


async def in_flight(stack: KVStack, tenant: str) -> list[tuple[str, dict[str, Any]]]:
    async with httpx.AsyncClient(timeout=5) as client:
        found = []
        for engine_id, url in stack.engine_urls.items():
            listing = (await client.get(f"{url}/requests", auth=ENGINE_AUTH)).json()
            found += [(engine_id, e) for e in listing if e["tenant"] == tenant]
        return found


async def cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def indexed(stack: KVStack, tenant: str, tokens: list[int], engine_id: str) -> bool:
    """Whether the shared prefix index (fed by the engines' KV events) has the prompt's blocks on the engine."""
    from tessera.routing.hashing import block_hash_chain
    from tessera.routing.prefix_index import PrefixIndex

    redis = connect(stack.options.redis_url, timeout_s=5)
    try:
        salt = (await TenantStore(redis).require_tenant(tenant)).cache_salt
        chain = block_hash_chain(tokens, 32, salt)
        held = await PrefixIndex(redis).longest_prefixes(chain, list(stack.engine_urls))
        return held.get(engine_id, 0) == len(chain)
    finally:
        await redis.aclose()


def spans_of(stack: KVStack, trace_id: str | None = None) -> list[SpanRecord]:
    spans = load_spans([stack.options.run_dir / "traces"])
    return [s for s in spans if trace_id is None or s.trace_id == trace_id]


async def test_over_quota_tenant_is_demoted_and_restored(act_stack: KVStack) -> None:
    stack = act_stack
    stack.wait_idle()
    stack.start_controller(policy=ONLY_DEMOTION, poll_interval_s=0.05)
    hog = await stack.create_tenant("act-hog", kv_quota=0.1)  # 12 of 127 blocks
    calm = await stack.create_tenant("act-calm")
    async with new_client() as client:
        first = await complete(client, stack.gateway_url, hog, stack.model, prompt(640, 1), 200)
        assert first.status == 200
        # Read in every admission round trip: the next request sees the flag.
        await wait_for(lambda: redis_exists(stack, demoted_key("act-hog")), 30, "the demotion flag", stack)
        # New requests of the demoted tenant carry the lower priority; another tenant's do not.
        demoted = await complete(client, stack.gateway_url, hog, stack.model, prompt(64, 2), 20)
        other = await complete(client, stack.gateway_url, calm, stack.model, prompt(64, 3), 20)
        # An operator raises the quota: the controller restores the tenant within a few polls.
        redis = connect(stack.options.redis_url, timeout_s=5)
        await TenantStore(redis).set_policy("act-hog", TenantPolicy(kv_quota=1.0))
        await redis.aclose()

        async def restored() -> bool:
            return not await redis_exists(stack, demoted_key("act-hog"))

        await wait_for(restored, 30, "the demotion flag to be cleared", stack)
        after = await complete(client, stack.gateway_url, hog, stack.model, prompt(64, 4), 20)
    assert stack.metric("tessera_kvcontrol_actions_total", action="demote", tenant="act-hog") == 1
    assert stack.metric("tessera_kvcontrol_actions_total", action="restore", tenant="act-hog") == 1
    # Started, the controller froze its startup heap (tessera.telemetry.gc_heap): no full collection walks it again.
    assert stack.metric("tessera_gc_frozen_objects") > 10_000
    request_ids = {first.request_id, demoted.request_id, other.request_id, after.request_id}

    # The engines' and the controller's batch processors write within 0.5 s; the gateway's lines within a tick
    # of its worker (1 s, span_lines.py): wait for both sides of each request, which the links below read.
    def exported() -> bool:
        names = {(s.name, s.attr("tessera.request_id")) for s in spans_of(stack)}
        both_sides = {(name, r) for r in request_ids for name in ("gateway.request", "engine.generate")}
        return both_sides <= names and "kvcontrol.demote" in {n for n, _ in names}

    await async_wait_until(exported, 30, "the requests' gateway and engine spans and the kvcontrol.demote span")
    spans = spans_of(stack)

    def engine_priority(request_id: str) -> int:
        return int(next(s.attr("tessera.priority") for s in spans
                        if s.name == "engine.generate" and s.attr("tessera.request_id") == request_id))

    normal = PRIORITY_VALUES["normal"]
    assert engine_priority(first.request_id) == normal
    assert engine_priority(demoted.request_id) == normal + DEMOTION_STEP
    assert engine_priority(other.request_id) == normal
    assert engine_priority(after.request_id) == normal
    demote = next(s for s in spans if s.name == "kvcontrol.demote")
    assert demote.attr("tessera.tenant") == "act-hog" and demote.attr("tessera.engine") in stack.engine_urls
    assert demote.attr("tessera.kv.blocks") > demote.attr("tessera.kv.quota_blocks") == 12
    assert demote.attr("tessera.kv.free_blocks_before") >= 0 and demote.attr("tessera.kv.free_blocks_after") >= 0
    assert str(demote.attr("tessera.cause")).startswith("over_kv_quota")
    for trace_id, _ in demote.links:  # the hog's requests the controller saw running, if it saw any
        assert {"gateway.request", "engine.generate"} <= {s.name for s in spans if s.trace_id == trace_id}


class Loader:
    """Keeps an engine's KV more than half full: ``concurrency`` loops of direct ``/generate`` calls with a
    1,400-token prompt (44 of 127 blocks) and 300 output tokens each, until stopped."""

    def __init__(self, url: str, tenant: str, concurrency: int = 3) -> None:
        self.url, self.tenant = url, tenant
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._loop(i)) for i in range(concurrency)]

    async def _loop(self, i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                body = {"request_id": f"{self.tenant}-{i}-{n}-{random.getrandbits(32)}",
                        "prompt_token_ids": prompt(1400, n * 10 + i), "max_tokens": 300 + 70 * i, "ignore_eos": True,
                        "cache_salt": self.tenant,
                        # Background load at low priority: at the engine's default (0, critical) the loops'
                        # ever-new requests would go ahead of the test's normal-class request forever.
                        "priority": PRIORITY_VALUES["low"]}
                async with client.stream("POST", f"{self.url}/generate", json=body,
                                         headers={"x-tessera-tenant": self.tenant}, auth=ENGINE_AUTH) as resp:
                    async for _ in resp.aiter_lines():
                        pass

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_pressure_flag_steers_routing_and_sheds_batch_admission(act_stack: KVStack) -> None:
    stack = act_stack
    stack.wait_idle()
    # A short request holds 17 of 127 blocks: under the high watermark. The loaders hold more than half, and
    # never less than a tenth while they run.
    stack.start_controller(policy={"highWatermark": 0.5, "lowWatermark": 0.1, "enableDemotion": False,
                                   "enableAbort": False}, poll_interval_s=0.05)
    key = await stack.create_tenant("act-press")
    batch_key = await stack.create_tenant("act-batch", priority_class="batch")
    shared = prompt(512, 10)
    loaders: list[Loader] = []
    try:
        async with new_client() as client:
            warm = await complete(client, stack.gateway_url, key, stack.model, [*shared, 1, 2], 2)
            home = warm.engine
            (other,) = set(stack.engine_urls) - {home}
            await wait_for(lambda: indexed(stack, "act-press", shared, home), 10, "the prefix index to learn it")
            again = await complete(client, stack.gateway_url, key, stack.model, [*shared, 3, 4], 2)
            assert again.engine == home, "prefix affinity keeps the prefix on its engine"
            # Load on the prefix's engine: the controller flags it, and routing sends the prefix elsewhere.
            loaders.append(Loader(stack.engine_urls[home], "act-load"))
            await wait_for(lambda: redis_exists(stack, pressure_key(home)), 30, f"the pressure flag of {home}", stack)
            await asyncio.sleep(REGISTRY_MAX_AGE_S)  # the gateway's registry view now holds the flag
            assert await redis_exists(stack, pressure_key(home))  # held while the load holds the blocks
            steered = await complete(client, stack.gateway_url, key, stack.model, [*shared, 6, 7], 2)
            assert steered.status == 200 and steered.engine == other
            # Both engines flagged: batch-class requests are shed at admission with Retry-After, others admitted.
            loaders.append(Loader(stack.engine_urls[other], "act-load"))
            await wait_for(lambda: redis_exists(stack, pressure_key(other)), 30, f"the pressure flag of {other}",
                           stack)
            await asyncio.sleep(REGISTRY_MAX_AGE_S)
            assert all([await redis_exists(stack, pressure_key(e)) for e in stack.engine_urls])
            shed = await complete(client, stack.gateway_url, batch_key, stack.model, prompt(32, 12), 2)
            assert shed.status == 503 and shed.retry_after == "1"
            assert orjson.loads(shed.error)["error"]["code"] == "engine_under_pressure"
            admitted = await complete(client, stack.gateway_url, key, stack.model, prompt(32, 13), 2)
            assert admitted.status == 200
    finally:
        for loader in loaders:
            await loader.close()
    stack.wait_idle()

    async def cleared() -> bool:  # idle engines are under the low watermark
        return not any([await redis_exists(stack, pressure_key(e)) for e in stack.engine_urls])

    await wait_for(cleared, 30, "the pressure flags to clear", stack)
    assert stack.metric("tessera_kvcontrol_actions_total", action="pressure_set") >= 2
    assert stack.metric("tessera_kvcontrol_actions_total", action="pressure_clear") >= 2
    assert stack.metric("tessera_engine_kv_pressure") == 0


# NOTE: the abort must land while the bulk request runs (a second or two here), and the controller sees the
# engine through its HTTP endpoints, which a saturated machine can delay past that. So the scenario is played
# up to three times, each with a fresh tenant, until the controller acted; a controller that never aborts
# still fails.
ATTEMPTS = 3


async def _bulk_with_a_critical_request_behind(stack: KVStack, tenant: str, seed: int,
                                               headers: dict[str, str]) -> tuple[Any, str, list[int], int]:
    bulk = await stack.create_tenant(tenant, priority_class="low")
    shared = prompt(640, seed)
    bulk_prompt, max_tokens = [*shared, *prompt(60, seed + 1)], 3200
    async with new_client() as client:
        warm = await complete(client, stack.gateway_url, bulk, stack.model, [*shared, 1], 1)
        engine = warm.engine
        await wait_for(lambda: indexed(stack, tenant, shared, engine), 10, "the prefix index to learn it")
        gold: list[asyncio.Task[httpx.Response]] = []

        async def block_the_engine() -> None:
            # A critical request that cannot fit beside the running bulk request (113 of 127 blocks) waits on
            # its engine: the controller's cue. Sent once the bulk request streams, so it is running there.
            gold.append(asyncio.create_task(client.post(
                f"{stack.engine_urls[engine]}/generate", headers={"x-tessera-tenant": "act-gold"},
                json={"request_id": f"gold-{tenant}", "prompt_token_ids": prompt(3600, seed + 2), "max_tokens": 1,
                      "priority": 0, "cache_salt": "act-gold"}, auth=ENGINE_AUTH)))

        result = await asyncio.wait_for(
            complete(client, stack.gateway_url, bulk, stack.model, bulk_prompt, max_tokens,
                     headers=headers, on_first_token=block_the_engine), 300)
        assert (await gold[0]).status_code == 200
    assert result.status == 200 and not result.error, result.error
    assert result.usage["completion_tokens"] == max_tokens and result.usage["prompt_tokens"] == len(bulk_prompt)
    # Billed once: one request (plus the warm-up), the prompt once, every generated token once.
    usage = httpx.get(f"{stack.gateway_url}/admin/tenants/{tenant}/usage?period=month",
                      headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).json()
    assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == (
        2, len(shared) + 1 + len(bulk_prompt), 1 + max_tokens)
    return result, engine, bulk_prompt, max_tokens


@pytest.mark.parametrize("client_traceparent", [True, False], ids=["client-traceparent", "gateway-root"])
async def test_abort_is_retried_elsewhere_once_billed_once_streamed_and_traced(act_stack: KVStack,
                                                                               client_traceparent: bool) -> None:
    stack = act_stack
    stack.wait_idle()
    stack.start_controller(policy={"enableDemotion": False, "enablePressure": False, "abortFreeBlocks": 128,
                                   "abortMinAgeS": 0.0, "abortCooldownS": 60}, poll_interval_s=0.05)
    for attempt in range(ATTEMPTS):
        tenant = f"act-bulk-{'tp' if client_traceparent else 'gw'}-{attempt}"
        trace_id = f"{random.getrandbits(128):032x}"
        headers = {"traceparent": f"00-{trace_id}-{random.getrandbits(64):016x}-01"} if client_traceparent else {}
        result, engine, bulk_prompt, max_tokens = await _bulk_with_a_critical_request_behind(
            stack, tenant, 20 + 10 * attempt + (0 if client_traceparent else 100), headers)
        if stack.metric("tessera_kvcontrol_actions_total", action="abort", tenant=tenant) == 1:
            break
        stack.wait_idle()
    else:
        raise AssertionError(f"the controller did not abort in {ATTEMPTS} attempts")
    assert result.engine == engine  # the stream started there, then moved

    def exported() -> bool:  # each process's batch span processor exports within 0.5 s
        spans = spans_of(stack)
        traces = {s.trace_id for s in spans
                  if s.name == "gateway.request" and s.attr("tessera.request_id") == result.request_id}
        names = [s.name for s in spans if s.trace_id in traces]
        return {"gateway.request", "kvcontrol.abort"} <= set(names) and names.count("engine.generate") == 2

    await async_wait_until(exported, 30, "the aborted request's gateway.request and kvcontrol.abort spans")
    if not client_traceparent:  # the gateway started the trace: find it by the response's request id
        trace_id = next(s.trace_id for s in spans_of(stack)
                        if s.name == "gateway.request" and s.attr("tessera.request_id") == result.request_id)
    spans = spans_of(stack, trace_id)
    names = {s.name for s in spans}
    assert {"gateway.request", "admission", "route", "engine.call", "engine.generate", "kvcontrol.abort"} <= names
    attempts = sorted((s for s in spans if s.name == "engine.generate"), key=lambda s: s.start_ns)
    (other,) = set(stack.engine_urls) - {engine}
    assert [s.attr("tessera.engine") for s in attempts] == [engine, other]
    first, second = attempts
    assert str(first.attr("tessera.aborted", "")).startswith("kv_exhausted")
    generated = int(first.attr("gen_ai.usage.output_tokens"))
    assert 0 < generated < max_tokens
    # Streamed once: the continuation starts from prompt + what was streamed and only makes up the rest.
    assert int(second.attr("gen_ai.usage.input_tokens")) == len(bulk_prompt) + generated
    assert int(second.attr("gen_ai.usage.output_tokens")) == max_tokens - generated
    abort = next(s for s in spans if s.name == "kvcontrol.abort")
    assert abort.parent_span_id == first.span_id and (trace_id, first.span_id) in abort.links
    assert abort.attr("tessera.tenant") == tenant and abort.attr("tessera.abort.result") == "aborted"
    assert abort.attr("tessera.engine_request_id") == first.attr("tessera.engine_request_id")
    assert first.attr("tessera.priority") == PRIORITY_VALUES["low"]
    assert {"tessera-gateway", "tessera-engine", "tessera-kvcontrol"} <= {s.service for s in spans}
    gateway = next(s for s in spans if s.name == "gateway.request")
    # With a client traceparent the gateway span is a child of the client's span; otherwise the root.
    assert (gateway.parent_span_id is not None) == client_traceparent
    assert gateway.attr("tessera.retries") == 1
