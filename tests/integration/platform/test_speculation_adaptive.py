"""Speculation that pays for itself, against a real vLLM engine (CPU build) with n-gram drafting.

Both sides on one engine serving the random small model. Sampled (temperature 1) from random prompts, its
text is noise: n-gram finds little to match and nothing it drafts is accepted, and the controller turns
drafting off, after which the engine really drafts nothing. Prompts that repeat a sequence, decoded
greedily, are drafted and accepted, and speculation stays on (or, from off, comes back on after a probe).
NOTE: greedy decoding of random prompts is not the noise case: the random model falls into loops that
n-gram then matches (most of its drafts are accepted).

The engine is vLLM's ``AsyncLLM`` built from ``EngineConfig.to_vllm_kwargs`` as the host builds it, plus the
worker extension the controller's switch needs; the host itself is being split and is not needed here.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tessera.engine.capabilities import ask_vllm, resolve
from tessera.engine.config import EngineConfig
from tessera.engine.protocol import RequestStats
from tessera.engine.speculation_control import WORKER_EXTENSION, SpeculationControl, num_speculative_tokens
from tessera.engine.speculation_policy import PolicySettings
from tessera.engine.vllm_metrics import VllmMetrics

pytestmark = pytest.mark.engine

MAX_K = 3
MAX_TOKENS = 48
NOISE, GREEDY = 1.0, 0.0  # sampling temperatures
SETTINGS = PolicySettings(min_decode_steps=150, probe_interval_s=3600.0)


def random_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(64)]


def repetitive_prompt(rng: random.Random) -> list[int]:
    start = rng.randrange(10, 900)
    return list(range(start, start + 16)) * 6


@pytest.fixture(scope="module")
async def engine(small_model_dir: Path) -> AsyncIterator[Any]:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    config = EngineConfig.model_validate({"model": str(small_model_dir), "kv_events": {"enabled": False},
                                          "speculative": {"num_speculative_tokens": MAX_K}})
    kwargs = resolve(config, ask_vllm(config)).config.to_vllm_kwargs()
    # The default config asks for the extension itself (speculative.adaptive.enabled).
    assert kwargs["worker_extension_cls"] == WORKER_EXTENSION
    # vLLM's metrics bound to a registry of their own, as the host binds them: vLLM's default logger would fill
    # the process-wide REGISTRY of whichever test worker runs this module (test_vllm_metrics checks it).
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[VllmMetrics().stat_logger])
    # The host's warm-up pass (see host.WARMUP_PROMPT_TOKENS): a first pass of fewer than 5 tokens kills the
    # CPU worker on some machines.
    async for _ in engine.generate({"prompt_token_ids": list(range(1, 17))}, SamplingParams(max_tokens=1),
                                   request_id="warmup"):
        pass
    yield engine
    engine.shutdown()


async def generate(engine: Any, prompt: list[int], temperature: float) -> RequestStats:
    """One request; the counts the host puts in its final line (host._fill_timeline)."""
    from vllm import SamplingParams

    stats = RequestStats(arrival_ts=time.time(), num_prompt_tokens=len(prompt))
    final: Any = None
    async for output in engine.generate({"prompt_token_ids": prompt},
                                        SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, ignore_eos=True),
                                        request_id=uuid.uuid4().hex):
        final = output
    completion = final.outputs[0]
    stats.num_output_tokens = len(completion.token_ids)
    spec = completion.spec_decode_metrics
    if spec is not None:
        stats.num_spec_draft_tokens = int(spec.num_draft_tokens)
        stats.num_spec_accepted_tokens = sum(j * count for j, count in enumerate(spec.histogram))
    return stats


async def serve(engine: Any, control: SpeculationControl, tenant: str, prompts: list[list[int]],
                temperature: float, concurrency: int = 4) -> list[RequestStats]:
    """Runs the prompts ``concurrency`` at a time and feeds each finished request to the controller."""
    done: list[RequestStats] = []
    for i in range(0, len(prompts), concurrency):
        batch = await asyncio.gather(*(generate(engine, p, temperature) for p in prompts[i:i + concurrency]))
        for stats in batch:
            control.observe(stats, tenant)
        done.extend(batch)
    return done


async def test_random_prompts_turn_speculation_off_and_the_engine_stops_drafting(engine: Any) -> None:
    rng = random.Random(1)
    control = SpeculationControl("ngram", MAX_K, settings=SETTINGS)
    await serve(engine, control, "noise", [random_prompt(rng) for _ in range(8)], NOISE)
    facts = control.facts()
    window = facts["window"]
    assert window["num_decode_steps"] >= SETTINGS.min_decode_steps
    assert window["num_accepted_tokens"] <= 0.05 * window["num_decode_steps"], window

    decision = await control.maybe_apply(engine, num_running=0)
    assert decision.changed and control.state.phase == "off", decision.reason
    assert decision.estimate is not None and decision.estimate.best_gain < 1.0
    assert await num_speculative_tokens(engine) == [0]
    # The switch changes what the engine does: not even a repeating prompt is drafted now.
    after = await serve(engine, control, "noise", [repetitive_prompt(rng) for _ in range(2)], GREEDY)
    assert [s.num_spec_draft_tokens for s in after] == [0, 0]
    assert control.facts()["window"]["num_requests"] == 0  # nothing measured while off

    # Back on when it pays: a probe at full k, on repeating prompts, measures acceptance and stays on.
    control.settings = PolicySettings(min_decode_steps=SETTINGS.min_decode_steps, probe_interval_s=0.0)
    probe = await control.maybe_apply(engine, num_running=0)
    assert control.state.phase == "probe" and probe.changed
    assert await num_speculative_tokens(engine) == [MAX_K]
    await serve(engine, control, "repeats", [repetitive_prompt(rng) for _ in range(8)], GREEDY)
    back = await control.maybe_apply(engine, num_running=0)
    assert control.state.phase == "on" and control.state.num_speculative_tokens >= 1, back.reason
    assert await num_speculative_tokens(engine) == [control.state.num_speculative_tokens]


async def test_repeating_prompts_keep_speculation_on_with_high_acceptance(engine: Any) -> None:
    from tessera.engine.speculation_control import set_num_speculative_tokens

    await set_num_speculative_tokens(engine, MAX_K)  # whatever the other test left
    rng = random.Random(2)
    control = SpeculationControl("ngram", MAX_K, settings=SETTINGS)
    await serve(engine, control, "repeats", [repetitive_prompt(rng) for _ in range(8)], GREEDY)
    decision = await control.maybe_apply(engine, num_running=0)
    facts = control.facts()
    assert facts["phase"] == "on" and facts["num_speculative_tokens"] >= 1, decision.reason
    assert facts["alpha"] > 0.5 and facts["expected_tokens_per_step"] > facts["break_even_tokens_per_step"]
    assert facts["tenants"]["repeats"]["best_num_speculative_tokens"] >= 1
    text = control.prometheus_text("e1", "tessera-small").decode()
    assert 'tessera_engine_speculation_on{engine_id="e1",model="tessera-small"} 1.0' in text
    assert 'tessera_engine_speculation_tenant_alpha{engine_id="e1",model="tessera-small",tenant="repeats"}' in text
