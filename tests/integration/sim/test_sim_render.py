"""The simulated replica's render routes (server.py): what vllm-router's kv_aware policy asks a worker for
(the prompt's token ids), tokenized as the generating routes tokenize, so they match the engine's blocks."""

from __future__ import annotations

import asyncio

import httpx

from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.fleet import SimFleet
from tessera.engine.sim.step_time import MeasuredStepTime

STEP = MeasuredStepTime(step_s=0.004, per_seq_s=0.001, per_prefill_token_s=0.0001)


def test_render_returns_the_token_ids_the_engine_would_cache_and_generates_nothing() -> None:
    async def run() -> None:
        config = SimEngineConfig(num_gpu_blocks=128, block_size=16, max_model_len=2048, step_time=STEP)
        fleet = await SimFleet(config, 1, redis_url=None).start()
        try:
            url = fleet.replicas[0].url
            async with httpx.AsyncClient(timeout=30.0) as client:
                completion = await client.post(f"{url}/v1/completions/render",
                                               json={"model": "m", "prompt": "héllo", "max_tokens": 7})
                assert completion.status_code == 200
                [rendered] = completion.json()  # a list, one per prompt, as vLLM answers
                assert rendered["token_ids"] == list("héllo".encode())
                assert rendered["sampling_params"]["max_tokens"] == 7

                chat = await client.post(f"{url}/v1/chat/completions/render", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert chat.status_code == 200
                assert chat.json()["token_ids"] == list(b"<|user|>hi<|assistant|>")

                # The same prompt generated: its prompt tokens are the rendered ones.
                whole = (await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "héllo",
                                                                           "max_tokens": 1})).json()
                assert whole["usage"]["prompt_tokens"] == len(rendered["token_ids"])

                assert (await client.post(f"{url}/v1/chat/completions/render",
                                          json={"model": "m", "prompt": "x"})).status_code == 400
                assert (await client.post(f"{url}/v1/completions/render",
                                          json={"model": "m", "prompt": ""})).status_code == 400
            assert fleet.replicas[0].engine.num_steps == 1  # the render calls ran nothing
        finally:
            await fleet.stop()

    asyncio.run(run())
