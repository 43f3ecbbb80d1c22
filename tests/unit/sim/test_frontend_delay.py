"""The simulated engine's frontend delay (engine.py): a request reaches the scheduler a drawn, measured delay
after it reached the replica; TTFT counts the delay, the queue time does not, and an abort on the way keeps
it from ever running."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from tessera.engine.protocol import GenerateRequest
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.engine import SimClock, SimEngine
from tessera.engine.sim.step_time import MeasuredStepTime

STEP_S = 0.003
DELAY_S = 0.02


def config(delays: tuple[float, ...]) -> SimEngineConfig:
    return SimEngineConfig(num_gpu_blocks=64, block_size=16, max_model_len=512, timer_slack_s=0.5,
                           frontend_delays_s=delays,
                           step_time=MeasuredStepTime(step_s=STEP_S, per_seq_s=0.0, per_prefill_token_s=0.0))


def run_one(delays: tuple[float, ...]) -> Any:
    async def run() -> Any:
        engine = SimEngine(config(delays), "e", SimClock(1.0))
        task = asyncio.create_task(engine.run())
        stream = engine.add(GenerateRequest(request_id="r", prompt_token_ids=list(range(40)), max_tokens=4))
        while not stream.done:
            await stream.changed.wait()
            stream.changed.clear()
        task.cancel()
        return engine.stats_of(stream)

    return asyncio.run(run())


def test_ttft_counts_the_frontend_delay_and_the_queue_time_does_not() -> None:
    stats = run_one((DELAY_S,))
    assert stats.ttft_s == pytest.approx(DELAY_S + STEP_S, abs=1e-9)
    assert stats.queued_s == pytest.approx(0.0, abs=1e-9)
    assert stats.prefill_s == pytest.approx(STEP_S, abs=1e-9)
    assert run_one(()).ttft_s == pytest.approx(STEP_S, abs=1e-9)


def test_each_request_draws_one_of_the_measured_delays() -> None:
    delays = (0.005, 0.03)

    async def run() -> list[float]:
        engine = SimEngine(config(delays), "e", SimClock(1.0))
        task = asyncio.create_task(engine.run())
        ttfts = []
        for i in range(12):  # one at a time: no queueing, so each TTFT is its delay plus one step
            stream = engine.add(GenerateRequest(request_id=f"r{i}", prompt_token_ids=list(range(40)), max_tokens=1))
            while not stream.done:
                await stream.changed.wait()
                stream.changed.clear()
            ttfts.append(engine.stats_of(stream).ttft_s)
            engine.release(stream)
        task.cancel()
        return ttfts

    ttfts = asyncio.run(run())
    assert {round(t - STEP_S, 6) for t in ttfts} == set(delays)


def test_a_request_aborted_before_it_reaches_the_scheduler_never_runs() -> None:
    async def run() -> tuple[int, bool]:
        engine = SimEngine(config((DELAY_S,)), "e", SimClock(1.0))
        task = asyncio.create_task(engine.run())
        engine.add(GenerateRequest(request_id="r", prompt_token_ids=list(range(40)), max_tokens=4))
        assert engine.abort("r")
        await asyncio.sleep(DELAY_S * 3)
        task.cancel()
        return engine.num_steps, "r" in engine.scheduler.requests

    assert asyncio.run(run()) == (0, False)


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValidationError, match="frontend_delays_s"):
        config((0.01, -0.001))
