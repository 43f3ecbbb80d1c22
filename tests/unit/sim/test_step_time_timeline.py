"""A simulated engine's steps take exactly their modelled time in simulated time, however late asyncio's
timers wake (within ``timer_slack_s``); a loop held up beyond it shows as latency (engine.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tessera.engine.protocol import GenerateRequest
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.engine import SimClock, SimEngine
from tessera.engine.sim.step_time import MeasuredStepTime

STEP_S = 0.003
NUM_TOKENS = 30


def run_one(timer_slack_s: float, hold_loop_s: float = 0.0) -> Any:
    config = SimEngineConfig(num_gpu_blocks=64, block_size=16, max_model_len=512, timer_slack_s=timer_slack_s,
                             step_time=MeasuredStepTime(step_s=STEP_S, per_seq_s=0.0, per_prefill_token_s=0.0))

    async def run() -> Any:
        engine = SimEngine(config, "e", SimClock(1.0))
        task = asyncio.create_task(engine.run())
        stream = engine.add(GenerateRequest(request_id="r", prompt_token_ids=list(range(40)), max_tokens=NUM_TOKENS))
        held = False
        while not stream.done:
            await stream.changed.wait()
            stream.changed.clear()
            if hold_loop_s and not held and len(stream.request.output_token_ids) >= NUM_TOKENS // 2:
                time.sleep(hold_loop_s)  # the whole loop stalls, as a process with too many engines would
                held = True
        task.cancel()
        return engine.stats_of(stream)

    return asyncio.run(run())


def test_steps_follow_each_other_at_their_modelled_ends() -> None:
    # Without the timeline, each of the 30 steps would add the timer's late wake-up (~0.1-1 ms) to the decode.
    stats = run_one(timer_slack_s=0.5)
    assert stats.ttft_s == pytest.approx(STEP_S, abs=1e-9)
    assert stats.decode_s == pytest.approx((NUM_TOKENS - 1) * STEP_S, abs=1e-9)


def test_a_loop_held_up_beyond_the_slack_shows_as_latency() -> None:
    stats = run_one(timer_slack_s=0.005, hold_loop_s=0.1)
    assert stats.decode_s >= (NUM_TOKENS - 1) * STEP_S + 0.09
