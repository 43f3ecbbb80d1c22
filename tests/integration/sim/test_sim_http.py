"""Simulated replicas over HTTP, without Redis: the replica protocol and the OpenAI routes, latencies in
simulated time, aborts when the client leaves, and many replicas in one process (fleet.py, server.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.fleet import SimFleet
from tessera.engine.sim.scheduler import StepShape
from tessera.engine.sim.step_time import MeasuredStepTime, step_time_fn
from tests.support.data_plane import ENGINE_AUTH

STEP = MeasuredStepTime(step_s=0.004, per_seq_s=0.001, per_prefill_token_s=0.0001)


def config(**overrides: Any) -> SimEngineConfig:
    base: dict[str, Any] = {"num_gpu_blocks": 128, "block_size": 16, "max_model_len": 2048, "step_time": STEP}
    return SimEngineConfig(**{**base, **overrides})


def with_fleet(sim_config: SimEngineConfig, num_engines: int,
               body: Callable[[SimFleet, httpx.AsyncClient], Awaitable[None]]) -> None:
    async def run() -> None:
        fleet = await SimFleet(sim_config, num_engines, redis_url=None).start()
        try:
            async with httpx.AsyncClient(timeout=30.0) as client:
                await body(fleet, client)
        finally:
            await fleet.stop()

    asyncio.run(run())


def lines_of(response: httpx.Response) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in response.content.splitlines()]


def test_generate_streams_deltas_then_done_with_latencies_in_simulated_time() -> None:
    async def body(fleet: SimFleet, client: httpx.AsyncClient) -> None:
        url = fleet.replicas[0].url
        prompt = list(range(500, 540))
        first = lines_of(await client.post(f"{url}/generate", json={
            "request_id": "a", "prompt_token_ids": prompt, "max_tokens": 3}, auth=ENGINE_AUTH))
        assert [len(line["d"]) for line in first[:-1]] == [1, 1, 1]
        done = first[-1]
        assert done["done"] and done["finish"] == {"0": "length"}
        stats = done["stats"]
        assert (stats["num_prompt_tokens"], stats["num_output_tokens"], stats["num_cached_tokens"]) == (40, 3, 0)
        # The prefill step took what the model says, in simulated seconds, whatever the wall clock did.
        prefill_step = step_time_fn(STEP)(StepShape(40, 40, 0, 1, 0.0, 40))
        assert stats["prefill_s"] == pytest.approx(prefill_step)
        # The same prompt again: two full blocks are hits.
        again = lines_of(await client.post(f"{url}/generate", json={
            "request_id": "b", "prompt_token_ids": prompt, "max_tokens": 1}, auth=ENGINE_AUTH))
        assert again[-1]["stats"]["num_cached_tokens"] == 32

    # Four times slower than real time: the reported figures do not change.
    with_fleet(config(time_scale=4.0), 1, body)


def test_requests_that_can_never_run_are_refused_with_400() -> None:
    async def body(fleet: SimFleet, client: httpx.AsyncClient) -> None:
        url = fleet.replicas[0].url
        too_long = await client.post(f"{url}/generate", json={
            "request_id": "x", "prompt_token_ids": list(range(2040)), "max_tokens": 20}, auth=ENGINE_AUTH)
        assert too_long.status_code == 400 and "max_model_len" in too_long.json()["error"]
        invalid = await client.post(f"{url}/generate", json={"request_id": "x", "max_tokens": 2}, auth=ENGINE_AUTH)
        assert invalid.status_code == 400 and "prompt_token_ids" in invalid.json()["error"]
        no_messages = await client.post(f"{url}/v1/chat/completions", json={"model": "m", "prompt": "hi"})
        assert no_messages.status_code == 400 and no_messages.json()["error"]["type"] == "invalid_request_error"

    with_fleet(config(), 1, body)


def test_openai_completions_whole_and_chat_streamed() -> None:
    async def body(fleet: SimFleet, client: httpx.AsyncClient) -> None:
        url = fleet.replicas[0].url
        whole = (await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x" * 40,
                                                                  "max_tokens": 5})).json()
        assert whole["object"] == "text_completion"
        assert whole["choices"][0]["text"].count(" t") == 5 and whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"]["prompt_tokens"] == 40 and whole["usage"]["completion_tokens"] == 5
        streamed = await client.post(f"{url}/v1/chat/completions", json={
            "model": "m", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]})
        events = [e for e in streamed.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [orjson.loads(e[len("data: "):]) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks).count(" t") == 3
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 3

    with_fleet(config(), 1, body)


def test_a_client_that_leaves_aborts_its_request_and_frees_its_blocks() -> None:
    async def body(fleet: SimFleet, client: httpx.AsyncClient) -> None:
        replica = fleet.replicas[0]
        async with client.stream("POST", f"{replica.url}/generate", json={
                "request_id": "long", "prompt_token_ids": list(range(100)), "max_tokens": 1000},
                auth=ENGINE_AUTH) as response:
            async for _ in response.aiter_lines():
                break  # one token, then leave
        async with asyncio.timeout(10):
            while replica.engine.num_running or replica.engine.scheduler.requests:
                await asyncio.sleep(0.01)
        assert replica.engine.pool.num_free_blocks == 127

    # Slow steps, so the request is still running when the client leaves.
    with_fleet(config(step_time=MeasuredStepTime(step_s=0.02, per_seq_s=0, per_prefill_token_s=0)), 1, body)


def test_many_replicas_share_one_process_each_on_its_own_port() -> None:
    async def body(fleet: SimFleet, client: httpx.AsyncClient) -> None:
        urls = [replica.url for replica in fleet.replicas]
        assert len(set(urls)) == 20
        answers = await asyncio.gather(*(client.post(f"{url}/generate", json={
            "request_id": "same-id", "prompt_token_ids": [1, 2, 3], "max_tokens": 2},
            auth=ENGINE_AUTH) for url in urls))
        assert all(lines_of(a)[-1]["stats"]["engine_id"] == r.engine_id for a, r in zip(answers, fleet.replicas,
                                                                                           strict=True))
        stats = (await client.get(f"{urls[0]}/stats", auth=ENGINE_AUTH)).json()
        assert stats["simulated"] and stats["num_gpu_blocks"] == 128

    with_fleet(config(), 20, body)


def test_requests_lists_tenants_and_abort_ends_a_stream_with_a_retryable_error() -> None:
    async def body(fleet: SimFleet, client: httpx.AsyncClient) -> None:
        url = fleet.replicas[0].url

        async def long_request() -> list[dict[str, Any]]:
            response = await client.post(f"{url}/generate", headers={"x-tessera-tenant": "acme"}, json={
                "request_id": "victim", "prompt_token_ids": list(range(64)), "max_tokens": 1000, "priority": 3},
                auth=ENGINE_AUTH)
            return lines_of(response)

        streaming = asyncio.create_task(long_request())
        async with asyncio.timeout(10):
            while not (listing := (await client.get(f"{url}/requests", auth=ENGINE_AUTH)).json()):
                await asyncio.sleep(0.01)
        assert [(e["request_id"], e["tenant"], e["priority"]) for e in listing] == [("victim", "acme", 3)]
        aborted = await client.post(f"{url}/abort", json={"request_id": "victim", "reason": "kv pressure"},
                                    auth=ENGINE_AUTH)
        assert aborted.status_code == 200
        last = (await streaming)[-1]
        assert last["retryable"] and last["status"] == 503 and "kv pressure" in last["error"]
        assert last["stats"]["num_output_tokens"] < 1000
        assert (await client.post(f"{url}/abort", json={"request_id": "victim"}, auth=ENGINE_AUTH)).status_code == 404
        assert (await client.get(f"{url}/requests", auth=ENGINE_AUTH)).json() == []

    with_fleet(config(step_time=MeasuredStepTime(step_s=0.02, per_seq_s=0, per_prefill_token_s=0)), 1, body)


def test_generate_answers_its_head_with_the_first_line_as_the_real_replica_does() -> None:
    """The 200 is held until the prefill's first token (engine/held_head.py): the gateway reads both in one
    wake-up. Sent at once, the head came back within milliseconds of the request."""
    slow_prefill = MeasuredStepTime(step_s=0.004, per_seq_s=0.001, per_prefill_token_s=0.01)  # 40 tokens: ~0.4 s

    async def body(fleet: SimFleet, client: httpx.AsyncClient) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with client.stream("POST", f"{fleet.replicas[0].url}/generate", auth=ENGINE_AUTH, json={
                "request_id": "held", "prompt_token_ids": list(range(600, 640)), "max_tokens": 2}) as response:
            head_after = loop.time() - started
            assert response.status_code == 200
            lines = [orjson.loads(line) async for line in response.aiter_lines() if line]
        assert head_after >= 0.3  # not before the prefill's ~0.4 s
        assert lines[-1]["done"]

    with_fleet(config(step_time=slow_prefill), 1, body)
