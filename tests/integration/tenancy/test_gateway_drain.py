"""Graceful drain with real processes. A gateway (gateway/drain.py): SIGTERM to ``tessera gateway`` while
streams run; within the deadline every stream completes and new connections are refused, past it each stream
ends with the error event and is billed for what it generated. An engine replica (engine/drain.py): it
leaves the registry first, then finishes its open stream."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from tessera.engine.host import EngineHost
from tessera.gateway.drain import BACKSTOP_AFTER_DEADLINE_S
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRegistry
from tessera.tenancy.admission import Admission
from tests.support.data_plane import ENGINE_AUTH
from tests.support.engines import start_host
from tests.support.fake_engine import running_fake_engine
from tests.support.gateways import GatewayProcess, spawn_gateway
from tests.support.poll import async_wait_until
from tests.support.tenancy import GATEWAY_ENV, MODEL, TenantHandle, completion_body, create_tenant
from tests.support.valkey import RestartableRedis

NUM_STREAMS = 20
STREAM_TOKENS = 600  # 20 of them on a CPU replica: several seconds, past the listening socket's close
# The draining replica's stream must outlast the drain's registry step (its first, before any wait: about a
# second; the test waits up to LEAVE_WAIT_S for it), so it is sized from the replica's decode rate measured just
# before, to last about that long, within these bounds: a fixed 4,000 tokens took 100-180 s on the 2-vCPU VMs
# under a whole `make test`.
LEAVE_WAIT_S = 30.0
OUTLAST_S = LEAVE_WAIT_S
DRAINED_STREAM_TOKENS = (300, 4000)


@pytest.fixture(scope="module")
def drain_engine(small_model_dir: Path, tenancy_redis: RestartableRedis) -> Iterator[EngineHost]:
    """This module's own real replica (the last test drains it), registered for the tenancy model."""
    host = start_host(small_model_dir, tenancy_redis, served_model_name=MODEL,  # type: ignore[arg-type]
                      num_gpu_blocks_override=1024, max_model_len=8192, heartbeat_interval_s=1.0)
    yield host
    host.stop()


@dataclass
class StreamOutcome:
    num_tokens: int = 0  # content chunks received (one per engine delta: a token, or several accepted drafts)
    completion_tokens: int | None = None  # the usage chunk's, when the request asked for it
    done: bool = False  # ended with data: [DONE]
    error: dict[str, object] | None = None  # the SSE error event's "error", if it ended with one


async def stream_one(client: httpx.AsyncClient, url: str, tenant: TenantHandle, body: dict[str, object],
                     first_chunk: asyncio.Event, outcome: StreamOutcome) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=tenant.headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                outcome.done = True
                continue
            event = orjson.loads(data)
            if "error" in event:
                outcome.error = event["error"]
            elif event.get("usage"):
                outcome.completion_tokens = event["usage"]["completion_tokens"]
            elif any(choice.get("text") for choice in event.get("choices", [])):
                outcome.num_tokens += 1
                first_chunk.set()


async def start_streams(url: str, tenant: TenantHandle, body: dict[str, object], client: httpx.AsyncClient,
                        ) -> tuple[list[asyncio.Task[None]], list[StreamOutcome]]:
    """``NUM_STREAMS`` streams at once; returns once every one of them has had its first token."""
    outcomes = [StreamOutcome() for _ in range(NUM_STREAMS)]
    firsts = [asyncio.Event() for _ in range(NUM_STREAMS)]
    tasks = [asyncio.create_task(stream_one(client, url, tenant, body, first, outcome))
             for first, outcome in zip(firsts, outcomes, strict=True)]
    await async_wait_until(lambda: all(f.is_set() for f in firsts) or any(t.done() for t in tasks), 120.0,
                           "every stream's first token")
    for task in tasks:
        if task.done():
            task.result()  # a stream that failed before the signal: its error, not a drain's
    return tasks, outcomes


async def refused(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            await client.get(f"{url}/health")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        # Refused, or (a connection the kernel queued just before the listening socket closed) closed or reset
        # without an answer (EOF: RemoteProtocolError; ECONNRESET while reading the head: ReadError, seen in CI
        # once): either way not served here, and a client retries it elsewhere.
        return True
    return False


# How a drained gateway exits: one worker is uvicorn's Server, which re-raises the signal it shut down on
# (the exit says why); with several, the supervisor exits 0 once its workers have.
DRAINED_EXIT = {1: -signal.SIGTERM, 2: 0}


def sigterm(gateway: GatewayProcess) -> None:
    """SIGTERM to the gateway's main process only, as the kubelet sends it to the container's PID 1."""
    os.kill(gateway.pid, signal.SIGTERM)


async def test_streams_past_the_deadline_end_with_the_error_event_and_are_billed(
        redis_server: EmbeddedRedis, small_model_dir: Path, tmp_path: Path) -> None:
    drain_timeout_s = 2.0
    env = {**GATEWAY_ENV, "TESSERA_DRAIN_TIMEOUT_S": str(drain_timeout_s)}
    model = f"drain-fake-{time.monotonic_ns()}"
    # 2000 lines 20 ms apart: 40 s a stream, far past the deadline.
    with running_fake_engine(redis_server.url, model, small_model_dir, line_gap_s=0.02) as engine:
        gateway = spawn_gateway(redis_server.url, tmp_path, env)
        try:
            gateway.wait_healthy()
            tenant = create_tenant(gateway, {"maxConcurrentRequests": 50}, prefix="drain")
            body = {**completion_body(max_tokens=2000, prompt="drain me", stream=True), "model": model}
            limits = httpx.Limits(max_connections=NUM_STREAMS + 5)
            async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
                tasks, outcomes = await start_streams(gateway.url, tenant, body, client)
                signalled = time.monotonic()
                sigterm(gateway)
                await asyncio.gather(*tasks)
                ended_after_s = time.monotonic() - signalled
            await asyncio.to_thread(gateway.process.wait, 30)
            assert gateway.process.returncode == DRAINED_EXIT[1], gateway.log_tail()
        finally:
            gateway.stop()
        # Ended by the cut, well before uvicorn's backstop would have closed the connections unanswered.
        assert drain_timeout_s <= ended_after_s < drain_timeout_s + BACKSTOP_AFTER_DEADLINE_S
        for outcome in outcomes:
            assert not outcome.done and outcome.error is not None, outcome
            assert outcome.error["code"] == "gateway_draining" and outcome.error["type"] == "service_unavailable"
            assert {"message", "type", "code", "param"} == set(outcome.error)
        # Billed before the exit, between what the clients received and what the engine sent.
        redis: aioredis.Redis = connect(redis_server.url, timeout_s=5.0)
        try:
            usage = await Admission(redis).usage(tenant.name, "day")
        finally:
            await redis.aclose()
        received = sum(o.num_tokens for o in outcomes)
        sent = sum(engine.tokens_sent.values())
        assert usage["requests"] == NUM_STREAMS
        assert received <= int(usage["completion_tokens"]) <= sent, (received, usage, sent)
        assert received > NUM_STREAMS  # every stream was under way when it was cut
        await async_wait_until(lambda: engine.num_open == 0, 5.0, "the engine calls closed by the cut")


@pytest.mark.engine
async def test_sigterm_during_20_streams_completes_them_all_and_refuses_new_connections(
        tenancy_redis: RestartableRedis, drain_engine: EngineHost, tmp_path: Path) -> None:
    env = {**GATEWAY_ENV, "TESSERA_DRAIN_TIMEOUT_S": "120"}
    gateway = spawn_gateway(tenancy_redis.url, tmp_path, env, workers=2)  # as the chart runs it
    try:
        gateway.wait_healthy()
        tenant = create_tenant(gateway, {"maxConcurrentRequests": 50}, prefix="drain")
        # Sampled, so n-gram speculation cannot shortcut it: long enough to still run well after the signal.
        body = completion_body(max_tokens=STREAM_TOKENS, prompt=list(range(300, 316)), stream=True, ignore_eos=True,
                               temperature=1.0, stream_options={"include_usage": True})
        limits = httpx.Limits(max_connections=NUM_STREAMS + 5)
        async with httpx.AsyncClient(timeout=180.0, limits=limits) as client:
            tasks, outcomes = await start_streams(gateway.url, tenant, body, client)
            signalled = time.monotonic()
            sigterm(gateway)
            await async_wait_until(lambda: refused(gateway.url), 5.0, "new connections refused")
            refused_after_s = time.monotonic() - signalled
            running_when_refused = sum(not t.done() for t in tasks)
            await asyncio.gather(*tasks)
        assert [(o.done, o.error, o.completion_tokens) for o in outcomes] == [(True, None, STREAM_TOKENS)] * NUM_STREAMS
        # The streams outlived the listening socket: the drain, not a quick finish, completed them.
        assert running_when_refused > 0, refused_after_s
        await asyncio.to_thread(gateway.process.wait, 30)
        assert gateway.process.returncode == DRAINED_EXIT[2], gateway.log_tail()
    finally:
        gateway.stop()


@pytest.mark.engine
async def test_a_draining_replica_leaves_the_registry_first_then_finishes_its_stream(
        tenancy_redis: RestartableRedis, drain_engine: EngineHost) -> None:
    """Last in this module: it stops the module's replica."""
    def payload(max_tokens: int) -> dict[str, object]:
        return {"request_id": f"drain-{time.monotonic_ns()}", "prompt_token_ids": list(range(400, 416)),
                "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}

    async def stream(body: dict[str, object], lines: list[dict[str, object]], first: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=120) as client, client.stream(
                "POST", f"{drain_engine.url}/generate", json=body, auth=ENGINE_AUTH) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line:
                    lines.append(orjson.loads(line))
                    first.set()

    measured = asyncio.Event()
    probe = asyncio.create_task(stream(payload(64), [], measured))
    await measured.wait()
    first_line_at = time.monotonic()
    await probe
    rate = 63 / max(time.monotonic() - first_line_at, 1e-3)  # tokens a second after the first, decoding alone
    low, high = DRAINED_STREAM_TOKENS
    max_tokens = min(high, max(low, int(rate * OUTLAST_S)))
    lines: list[dict[str, object]] = []
    first = asyncio.Event()

    redis = connect(tenancy_redis.url, timeout_s=5.0)
    registry = EngineRegistry(redis)

    async def registered() -> bool:
        return drain_engine.engine_id in {r.engine_id for r in await registry.live_engines()}

    async def gone() -> bool:
        return not await registered()

    try:
        await async_wait_until(registered, 10.0, "the replica registered")
        streaming = asyncio.create_task(stream(payload(max_tokens), lines, first))
        await async_wait_until(first.is_set, 60.0, "the stream's first line")
        # The deadline is what the stream must finish within, not what is tested: 4,000 tokens (the bound) took
        # over 180 s on the 2-vCPU VM under a whole `make test`. 400 s stays inside pytest's 600 s per test.
        draining = asyncio.ensure_future(asyncio.to_thread(drain_engine.drain, 400.0))
        began = time.monotonic()
        # Its first step, before any wait (engine/drain.py); generous only for this shared, starved machine.
        await async_wait_until(gone, LEAVE_WAIT_S, "the replica gone from the registry")
        left_after_s = time.monotonic() - began
        assert not streaming.done(), (f"the stream of {max_tokens} tokens ({rate:.0f}/s measured) ended before the "
                                      f"replica left the registry ({left_after_s:.1f} s): raise OUTLAST_S")
        await streaming
        outcome = await draining
    finally:
        await redis.aclose()
    assert lines[-1].get("done") is True, lines[-1]
    assert sum(len(line.get("d", [])) for line in lines) == max_tokens  # type: ignore[arg-type,misc]
    assert outcome is not None and outcome.drained
