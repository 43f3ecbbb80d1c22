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

from tessera.engine.registry import pressure_key
from tessera.redis_conn import connect
from tessera.telemetry.spanfile import SpanRecord, load_spans
from tessera.tenancy.demotion import demoted_key
from tessera.tenancy.policy import DEMOTION_STEP, PRIORITY_VALUES, TenantPolicy
from tessera.tenancy.store import TenantStore

from .stack import ADMIN_TOKEN, KVStack, complete, new_client

pytestmark = pytest.mark.engine

ONLY_DEMOTION = {"enablePressure": False, "enableAbort": False}


@pytest.fixture(scope="module")
def act_stack(make_stack: Any) -> KVStack:
    # One token per step (no speculative decoding) and room for 2,000-token sequences: requests that live
    # for seconds, long enough to observe and act on while they run.
    return make_stack("act", num_engines=2, speculative=None, max_model_len=2000)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                   stack: KVStack | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
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
            found += [(engine_id, e) for e in (await client.get(f"{url}/requests")).json() if e["tenant"] == tenant]
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
    stack.start_controller(policy=ONLY_DEMOTION)
    hog = await stack.create_tenant("act-hog", kv_quota=0.1)  # 6 of 63 blocks
    calm = await stack.create_tenant("act-calm")
    async with new_client() as client:
        first = asyncio.create_task(complete(client, stack.gateway_url, hog, stack.model, prompt(640, 1), 1300))
        await wait_for(lambda: redis_exists(stack, demoted_key("act-hog")), 30, "the demotion flag", stack)
        # New requests of the demoted tenant carry the lower priority; another tenant's do not.
        second = asyncio.create_task(complete(client, stack.gateway_url, hog, stack.model, prompt(64, 2), 1300))
        other = asyncio.create_task(complete(client, stack.gateway_url, calm, stack.model, prompt(64, 3), 1300))

        async def both_running() -> bool:
            return len(await in_flight(stack, "act-hog")) == 2 and len(await in_flight(stack, "act-calm")) == 1

        await wait_for(both_running, 30, "the demoted request to run")
        priorities = sorted(e["priority"] for _, e in await in_flight(stack, "act-hog"))
        assert priorities == [PRIORITY_VALUES["normal"], PRIORITY_VALUES["normal"] + DEMOTION_STEP]
        assert [e["priority"] for _, e in await in_flight(stack, "act-calm")] == [PRIORITY_VALUES["normal"]]
        # An operator raises the quota: the controller restores the tenant within a few polls.
        redis = connect(stack.options.redis_url, timeout_s=5)
        await TenantStore(redis).set_policy("act-hog", TenantPolicy(kv_quota=1.0))
        await redis.aclose()

        async def restored() -> bool:
            return not await redis_exists(stack, demoted_key("act-hog"))

        await wait_for(restored, 30, "the demotion flag to be cleared")
        await cancel(first, second, other)
    assert stack.metric("tessera_kvcontrol_actions_total", action="demote", tenant="act-hog") >= 1
    assert stack.metric("tessera_kvcontrol_actions_total", action="restore", tenant="act-hog") >= 1
    await asyncio.sleep(1.5)
    demote = next(s for s in spans_of(stack) if s.name == "kvcontrol.demote" and s.attr("tessera.tenant") == "act-hog")
    assert demote.attr("tessera.kv.blocks") > demote.attr("tessera.kv.quota_blocks") == 6
    assert demote.attr("tessera.kv.free_blocks_after") is not None
    # The demotion links to the hog's request that was running, whose trace holds gateway and engine spans.
    assert demote.links
    linked = spans_of(stack, demote.links[0][0])
    assert {"gateway.request", "engine.generate"} <= {s.name for s in linked}


async def test_pressure_flag_steers_routing_and_sheds_batch_admission(act_stack: KVStack) -> None:
    stack = act_stack
    stack.wait_idle()
    # Short requests stay under the high watermark (17 of 63 blocks); a 1,112-token prompt is over it.
    stack.start_controller(policy={"highWatermark": 0.5, "lowWatermark": 0.3, "enableDemotion": False,
                                   "enableAbort": False})
    key = await stack.create_tenant("act-press")
    batch_key = await stack.create_tenant("act-batch", priority_class="batch")
    shared = prompt(512, 10)
    async with new_client() as client:
        warm = await complete(client, stack.gateway_url, key, stack.model, [*shared, 1, 2], 2)
        home = warm.engine
        await wait_for(lambda: indexed(stack, "act-press", shared, home), 10, "the prefix index to learn it")
        again = await complete(client, stack.gateway_url, key, stack.model, [*shared, 3, 4], 2)
        assert again.engine == home, "prefix affinity should keep the prefix on its engine"
        # A long request on the prefix's engine fills over half of its KV: the controller flags it.
        long_home = asyncio.create_task(
            complete(client, stack.gateway_url, key, stack.model, [*shared, *prompt(600, 14)], 880))

        async def running(engine_id: str, n: int) -> bool:
            return [e for e, _ in await in_flight(stack, "act-press")].count(engine_id) == n

        await wait_for(lambda: running(home, 1), 30, f"the long request on {home}")
        await wait_for(lambda: redis_exists(stack, pressure_key(home)), 30, f"the pressure flag of {home}")
        await asyncio.sleep(0.5)  # the gateway re-reads the registry every 250 ms
        assert await redis_exists(stack, pressure_key(home))  # held while the long request holds its blocks
        steered = await complete(client, stack.gateway_url, key, stack.model, [*shared, 6, 7], 2)
        (other,) = set(stack.engine_urls) - {home}
        assert steered.status == 200 and steered.engine == other
        # Both engines flagged: batch-class requests are shed at admission with Retry-After, others admitted.
        long_other = asyncio.create_task(
            complete(client, stack.gateway_url, key, stack.model, prompt(1112, 11), 880))
        await wait_for(lambda: running(other, 1), 30, f"the long request on {other}")
        await wait_for(lambda: redis_exists(stack, pressure_key(other)), 30, f"the pressure flag of {other}")
        await asyncio.sleep(0.5)
        assert all([await redis_exists(stack, pressure_key(e)) for e in stack.engine_urls])
        shed = await complete(client, stack.gateway_url, batch_key, stack.model, prompt(32, 12), 2)
        assert shed.status == 503 and shed.retry_after == "1"
        assert orjson.loads(shed.error)["error"]["code"] == "engine_under_pressure"
        admitted = await complete(client, stack.gateway_url, key, stack.model, prompt(32, 13), 2)
        assert admitted.status == 200
        await cancel(long_home, long_other)
    stack.wait_idle()
    # Idle engines are under the low watermark: the controller clears both flags.

    async def cleared() -> bool:
        return not any([await redis_exists(stack, pressure_key(e)) for e in stack.engine_urls])

    await wait_for(cleared, 30, "the pressure flags to clear")
    assert stack.metric("tessera_kvcontrol_actions_total", action="pressure_set") >= 2
    assert stack.metric("tessera_kvcontrol_actions_total", action="pressure_clear") >= 2


async def test_abort_is_retried_elsewhere_once_billed_once_streamed_and_traced(act_stack: KVStack) -> None:
    stack = act_stack
    stack.wait_idle()
    stack.start_controller(policy={"enableDemotion": False, "enablePressure": False, "abortFreeBlocks": 64,
                                   "abortMinAgeS": 0.3, "abortCooldownS": 60})
    bulk = await stack.create_tenant("act-bulk", priority_class="low")
    trace_id = f"{random.getrandbits(128):032x}"
    traceparent = f"00-{trace_id}-{random.getrandbits(64):016x}-01"
    bulk_prompt, max_tokens = prompt(700, 20), 1300
    async with new_client() as client:
        stream = asyncio.create_task(complete(client, stack.gateway_url, bulk, stack.model, bulk_prompt, max_tokens,
                                              headers={"traceparent": traceparent}))

        async def bulk_running() -> bool:
            return bool(await in_flight(stack, "act-bulk"))

        await wait_for(bulk_running, 60, "the bulk request to start")
        ((engine, entry),) = await in_flight(stack, "act-bulk")
        assert entry["priority"] == PRIORITY_VALUES["low"] and entry["traceparent"].split("-")[1] == trace_id
        # A critical request that does not fit next to it waits on the same engine: the controller's cue.
        gold = asyncio.create_task(client.post(
            f"{stack.engine_urls[engine]}/generate", headers={"x-tessera-tenant": "act-gold"},
            json={"request_id": "gold-1", "prompt_token_ids": prompt(1400, 21), "max_tokens": 1, "priority": 0,
                  "cache_salt": "act-gold"}))
        result = await asyncio.wait_for(stream, 300)
        await gold
    assert result.status == 200 and not result.error, result.error
    assert result.usage["completion_tokens"] == max_tokens and result.usage["prompt_tokens"] == len(bulk_prompt)
    assert result.engine == engine  # the stream started there, then moved
    # Billed once: one request, the prompt once, every generated token once.
    usage = httpx.get(f"{stack.gateway_url}/admin/tenants/act-bulk/usage?period=month",
                      headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).json()
    assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == (1, 700, max_tokens)
    assert stack.metric("tessera_kvcontrol_actions_total", action="abort", tenant="act-bulk") == 1

    await asyncio.sleep(1.5)  # span export
    spans = spans_of(stack, trace_id)
    names = [s.name for s in spans]
    assert {"gateway.request", "admission", "route", "engine.call", "kvcontrol.abort"} <= set(names)
    attempts = sorted((s for s in spans if s.name == "engine.generate"), key=lambda s: s.start_ns)
    assert [s.attr("tessera.engine") for s in attempts] == [engine, *(set(stack.engine_urls) - {engine})]
    first, second = attempts
    assert first.attr("tessera.aborted", "").startswith("kv_exhausted")
    generated = int(first.attr("gen_ai.usage.output_tokens"))
    assert 0 < generated < max_tokens
    # Streamed once: the continuation starts from prompt + what was streamed and only makes up the rest.
    assert int(second.attr("gen_ai.usage.input_tokens")) == len(bulk_prompt) + generated
    assert int(second.attr("gen_ai.usage.output_tokens")) == max_tokens - generated
    abort = next(s for s in spans if s.name == "kvcontrol.abort")
    assert abort.parent_span_id == first.span_id and (trace_id, first.span_id) in abort.links
    assert abort.attr("tessera.tenant") == "act-bulk" and abort.attr("tessera.abort.result") == "aborted"
    services = {s.service for s in spans}
    assert {"tessera-gateway", "tessera-engine", "tessera-kvcontrol"} <= services
    gateway = next(s for s in spans if s.name == "gateway.request")
    assert gateway.parent_span_id is not None  # a child of the client's span
    assert gateway.attr("tessera.retries") == 1
