"""What no router can beat: each request's time to first token alone on an idle replica, given what a cache
already holds for it. Pure: token counts and a step-time model in, seconds out.

Why the fleet bench needs it: the goal "prefix_affinity's p99 TTFT <= 0.5x round_robin's" compares two
tails. Where no replica queues (light load, many replicas), round_robin's tail is the prefill of the
longest uncached prompts, and the best any router can do is the tail of the prompts' *uncacheable* part (the
noisy tenant's prompts share nothing, a session's new turn adds new tokens). The ratio of those two floors
is the best p99 ratio any policy can reach in that regime; when it is above 0.5 the goal is out of reach
there whatever the router does, and it can be met only where round_robin's misses queue.

A request alone on an idle replica computes its uncached tokens in chunks of the token budget, one step a
chunk, each step priced by the same step-time model the simulated engine uses (attention over the cached
context and the chunk, as ``scheduler.StepShape`` counts it); its first token comes out of the last chunk's
step. The replica's frontend (HTTP, the hop to the scheduler) is not counted: a floor, not a prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from routing_figures import percentile

from tessera.engine.sim.scheduler import StepShape
from tessera.engine.sim.step_time import StepTimeFn


def idle_prefill_s(prompt_tokens: int, cached_tokens: int, step_time: StepTimeFn, token_budget: int) -> float:
    """Seconds from scheduling to first token of one request alone on an idle replica with ``cached_tokens`` of
    its prompt in cache (at least the last prompt token is computed, as vLLM does)."""
    if prompt_tokens < 1:
        raise ValueError("a request has at least one prompt token")
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    done = min(max(0, cached_tokens), prompt_tokens - 1)
    seconds = 0.0
    while done < prompt_tokens:
        chunk = min(token_budget, prompt_tokens - done)
        seconds += step_time(StepShape(num_scheduled_tokens=chunk, num_prefill_tokens=chunk, num_decode_seqs=0,
                                       num_seqs=1, attention_pairs=chunk * (done + (chunk + 1) / 2),
                                       num_context_tokens=done + chunk))
        done += chunk
    return seconds


@dataclass(frozen=True, slots=True)
class TtftFloors:
    """p50/p99 of the idle-replica TTFTs, in seconds: with nothing cached, and with the ideal cache."""

    uncached_p50_s: float
    uncached_p99_s: float
    ideal_p50_s: float
    ideal_p99_s: float

    @property
    def best_p99_ratio(self) -> float:
        """The lowest p99 ratio to round_robin any router reaches where nothing queues (ideal over uncached)."""
        return self.ideal_p99_s / self.uncached_p99_s


def ttft_floors(prompt_tokens: Sequence[int], ideal_cached: Sequence[int], step_time: StepTimeFn,
                token_budget: int) -> TtftFloors:
    """The workload's idle-replica TTFT percentiles without a cache and with the ideal one (per request, the
    cached tokens ``ideal_cached`` gives; ``routing_figures.ideal_cached_tokens``)."""
    if len(prompt_tokens) != len(ideal_cached) or not prompt_tokens:
        raise ValueError("one ideal cached count per request, and at least one request")
    uncached = [idle_prefill_s(n, 0, step_time, token_budget) for n in prompt_tokens]
    ideal = [idle_prefill_s(n, c, step_time, token_budget) for n, c in zip(prompt_tokens, ideal_cached, strict=True)]
    return TtftFloors(uncached_p50_s=percentile(uncached, 50), uncached_p99_s=percentile(uncached, 99),
                      ideal_p50_s=percentile(ideal, 50), ideal_p99_s=percentile(ideal, 99))
