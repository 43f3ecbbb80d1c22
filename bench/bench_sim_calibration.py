"""Simulated-engine calibration (issue #17): the sim, configured with the CPU engine's measured step costs,
against the real CPU engine on the same workload — TTFT and ITL p50/p99 side by side.

    python bench/bench_sim_calibration.py                      # real engine + sim (starts vLLM on CPU)
    python bench/bench_sim_calibration.py --sim-only --step-costs '{"step_s": …, "per_seq_s": …,
                                                                    "per_prefill_token_s": …}'

1. Real engine: one ``EngineHost`` (vLLM, CPU build) serving the routing benchmark's generated model, 200
   KV blocks of 32 tokens, no Redis.
2. Step costs, measured on it (``MeasuredStepTime``): ``step_s`` = median inter-token gap of one decoding
   sequence; ``per_seq_s`` = (median gap with ``BATCH`` sequences decoding together − ``step_s``) /
   (``BATCH`` − 1); ``per_prefill_token_s`` = (engine-reported prefill of a unique 1,000-token prompt −
   ``step_s``) / 1,000.
3. Workload (seeded, the same for both): ``NUM_REQUESTS`` requests, Poisson arrivals at ``RATE_PER_S``,
   prompts of a shared 256-token prefix (half of them) plus a unique part, ``MAX_TOKENS`` output tokens
   each, ``ignore_eos``.
4. The same workload against one simulated replica (``tessera.engine.sim``) with the same block size,
   block count, max_num_seqs and token budget, at time scale 1 (so its wall-clock gaps are simulated gaps).
5. Prints TTFT (engine-reported ``ttft_s``) and ITL (client-side gaps between streamed tokens) p50/p99 for
   both, and the sim's relative error. Goal (issue #17): every figure within 15 %.
   Results: bench/results/sim_calibration.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import ENGINE_AUTH, REPO, bench_model

MODEL_DIR = REPO / ".tessera" / "models" / "tessera-bench-routing"
RESULTS = REPO / "bench" / "results" / "sim_calibration.json"
MODEL = "bench-sim-calibration"
BLOCK = 32
NUM_GPU_BLOCKS = 200
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 2048
BATCH = 4  # sequences decoding together when measuring per_seq_s
NUM_REQUESTS = 120
RATE_PER_S = 2.0
SHARED_PREFIX_TOKENS = 256
UNIQUE_TOKENS = (64, 512)
MAX_TOKENS = 32
GOAL_ERROR = 0.15
SEED = 17


@dataclass
class Request:
    arrival_s: float
    prompt: list[int]


@dataclass
class Outcome:
    ttft_s: float
    itls_s: list[float] = field(default_factory=list)


def make_workload() -> list[Request]:
    rng = random.Random(SEED)
    shared = [rng.randrange(100, 30000) for _ in range(SHARED_PREFIX_TOKENS)]
    requests, t = [], 0.0
    for _ in range(NUM_REQUESTS):
        t += rng.expovariate(RATE_PER_S)
        unique = [rng.randrange(100, 30000) for _ in range(rng.randint(*UNIQUE_TOKENS))]
        requests.append(Request(t, (shared if rng.random() < 0.5 else []) + unique))
    return requests


async def stream(client: Any, url: str, prompt: list[int], max_tokens: int, time_scale: float = 1.0) -> Outcome:
    """One /generate: the engine-reported TTFT and the client-side gaps between tokens (scaled to the sim's
    time when it runs slower than real time)."""
    import orjson

    body = {"request_id": f"c-{time.monotonic_ns()}", "prompt_token_ids": prompt, "max_tokens": max_tokens,
            "ignore_eos": True}
    arrivals: list[float] = []
    stats: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/generate", content=orjson.dumps(body), auth=ENGINE_AUTH) as response:
        async for line in response.aiter_lines():
            if not line:
                continue
            message = orjson.loads(line)
            if "t" in message:
                now = time.perf_counter()
                arrivals.extend([now] * len(message["d"]))
            elif message.get("done"):
                stats = message["stats"]
            elif "error" in message:
                raise RuntimeError(message["error"])
    gaps = [(b - a) / time_scale for a, b in itertools.pairwise(arrivals)]
    return Outcome(float(stats["ttft_s"]), gaps)


async def run_workload(url: str, requests: list[Request], time_scale: float = 1.0) -> list[Outcome]:
    import httpx

    async with httpx.AsyncClient(timeout=600.0) as client:
        start = time.perf_counter()

        async def one(request: Request) -> Outcome:
            await asyncio.sleep(max(0.0, start + request.arrival_s * time_scale - time.perf_counter()))
            return await stream(client, url, request.prompt, MAX_TOKENS, time_scale)

        return list(await asyncio.gather(*(one(r) for r in requests)))


async def measure_step_costs(url: str) -> dict[str, float]:
    import httpx
    import orjson

    rng = random.Random(SEED + 1)
    async with httpx.AsyncClient(timeout=600.0) as client:
        await stream(client, url, [rng.randrange(100, 30000) for _ in range(64)], 8)  # warm-up
        single = await stream(client, url, [rng.randrange(100, 30000) for _ in range(32)], 64)
        step_s = statistics.median(single.itls_s)
        batch = await asyncio.gather(*(stream(client, url, [rng.randrange(100, 30000) for _ in range(32)], 64)
                                       for _ in range(BATCH)))
        # Gaps while all BATCH sequences decode: the middle of each stream.
        batched = statistics.median(g for o in batch for g in o.itls_s[8:-8])
        prefills = []
        for _ in range(3):
            body = {"request_id": f"p-{time.monotonic_ns()}", "max_tokens": 1, "ignore_eos": True,
                    "prompt_token_ids": [rng.randrange(100, 30000) for _ in range(1000)]}
            lines = (await client.post(f"{url}/generate", content=orjson.dumps(body),
                                       auth=ENGINE_AUTH)).content.splitlines()
            prefills.append(float(orjson.loads(lines[-1])["stats"]["prefill_s"]))
    return {"step_s": step_s, "per_seq_s": max(0.0, (batched - step_s) / (BATCH - 1)),
            "per_prefill_token_s": max(0.0, (statistics.median(prefills) - step_s) / 1000)}


def run_real(requests: list[Request]) -> tuple[dict[str, float], list[Outcome]]:
    """Starts the real CPU engine (vLLM), measures its step costs, runs the workload, stops it."""
    from tessera.engine.config import EngineConfig
    from tessera.engine.host import EngineHost
    from tessera.engine.small_model import SmallModelSpec

    bench_model(MODEL_DIR.name, SmallModelSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                                               num_attention_heads=8, num_key_value_heads=4, seed=1))
    config = EngineConfig.model_validate({
        "model": str(MODEL_DIR), "served_model_name": MODEL, "num_gpu_blocks_override": NUM_GPU_BLOCKS,
        "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK, "speculative": None, "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    })
    host = EngineHost(config, None).start()
    try:
        costs = asyncio.run(measure_step_costs(host.url))
        return costs, asyncio.run(run_workload(host.url, requests))
    finally:
        host.stop()


def run_sim(costs: dict[str, float], requests: list[Request], time_scale: float) -> list[Outcome]:
    from tessera.engine.sim.config import SimEngineConfig
    from tessera.engine.sim.fleet import SimFleet

    config = SimEngineConfig.model_validate({
        "served_model_name": MODEL, "block_size": BLOCK, "num_gpu_blocks": NUM_GPU_BLOCKS,
        "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "time_scale": time_scale,
        "step_time": {"kind": "measured", **costs},
    })

    async def run() -> list[Outcome]:
        fleet = await SimFleet(config, 1, redis_url=None).start()
        try:
            return await run_workload(fleet.replicas[0].url, requests, time_scale)
        finally:
            await fleet.stop()

    return asyncio.run(run())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(outcomes: list[Outcome]) -> dict[str, float]:
    ttfts = [o.ttft_s for o in outcomes]
    itls = [g for o in outcomes for g in o.itls_s]
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim-only", action="store_true", help="Skip the real engine (needs --step-costs).")
    parser.add_argument("--step-costs", help="MeasuredStepTime fields as JSON (with --sim-only).")
    parser.add_argument("--time-scale", type=float, default=1.0, help="The sim's wall seconds per sim second.")
    args = parser.parse_args()
    requests = make_workload()
    real: dict[str, float] | None = None
    if args.sim_only:
        if not args.step_costs:
            parser.error("--sim-only needs --step-costs")
        costs = json.loads(args.step_costs)
    else:
        costs, real_outcomes = run_real(requests)
        real = summarize(real_outcomes)
    sim = summarize(run_sim(costs, requests, args.time_scale))
    print(f"step costs: {json.dumps(costs)}")
    print(f"{'metric':<12} {'real':>10} {'sim':>10} {'error':>8}")
    errors: dict[str, float] = {}
    for key, value in sim.items():
        if real is None:
            print(f"{key:<12} {'-':>10} {value * 1000:>8.1f}ms {'-':>8}")
            continue
        errors[key] = abs(value - real[key]) / real[key] if real[key] else float("inf")
        print(f"{key:<12} {real[key] * 1000:>8.1f}ms {value * 1000:>8.1f}ms {errors[key] * 100:>7.1f}%")
    if real is not None:
        met = all(e <= GOAL_ERROR for e in errors.values())
        print(f"goal (every figure within {GOAL_ERROR:.0%}): {'met' if met else 'NOT met'}")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"step_costs": costs, "real": real, "sim": sim, "errors": errors,
                                       "goal_met": met}, indent=2))


if __name__ == "__main__":
    main()
