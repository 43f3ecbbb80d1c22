"""Benchmark: the noisy-neighbour scenario with the KV-eviction controller off and on, in one run.

One engine replica (real vLLM, CPU build) with a tiny KV cache (64 blocks x 32 tokens), one gateway
process, the controller process, and two tenants of the same priority class and KV quota (half the cache):

- ``noisy`` floods long prompts: a closed loop of ``--noisy-concurrency`` requests, each 1,024 fresh tokens
  (32 blocks) and 16 output tokens, so its requests alone want more than the whole cache;
- ``victim`` repeats a cached prefix: Poisson arrivals at ``--victim-rate``/s, a 512-token prefix shared by
  all its requests plus 8 fresh tokens, 8 output tokens.

"off" runs the controller observe-only (ledger and eviction spans, no action), so both modes count
evictions the same way; "on" lets it act (demotion and the pressure flag; the last-resort abort needs a
second engine to continue on, so it cannot fire with one). The modes alternate over ``--rounds`` rounds
(off, on, off, on, ...) on the same engine and gateway, each ``--warmup`` s unmeasured then ``--duration``
s measured, so a change in the machine's background load hits both modes alike.

Reported per mode (all rounds pooled): the victim's p50/p99 TTFT and E2E (client-side, streamed), the
noisy tenant's throughput (tokens and requests completed per measured second), evictions per tenant (the
controller's eviction spans: blocks by owner), preemptions per tenant (the engines' per-request counts),
and the controller's actions. Goal: victim p99 TTFT on <= 0.5 x off; noisy throughput on >= 0.8 x off.
Results: bench/results/kvcontrol.json and a table.

Usage: ``.venv/bin/python bench/bench_kvcontrol.py [--rounds 3] [--duration 40] [--warmup 5]``

At fleet scale (issue #17): ``--engines 64`` runs one controller process against 64 simulated engines
publishing vLLM-format KV events at each of ``--rates`` (batches per engine per second) and reports its
event-to-ledger lag, events/s applied and CPU (bench/kvcontrol_fleet.py; ``make bench-kvcontrol-fleet``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _support import (
    bench_model,
    percentiles,
    pin_this_process,
    print_table,
    split_cores,
    stop_on_sigterm,
    write_results,
)

from tests.support.kvstack import Completion, KVStack, StackOptions, complete, new_client

PREFIX_TOKENS = 512
VICTIM_SUFFIX_TOKENS = 8
VICTIM_OUTPUT_TOKENS = 8
NOISY_PROMPT_TOKENS = 1024
NOISY_OUTPUT_TOKENS = 16
VOCAB = (10, 700)  # token ids the small model's tokenizer knows
MODES = ("off", "on")


async def _noisy_loop(client: Any, stack: KVStack, key: str, rng: random.Random, stop_at: float,
                      out: list[Completion], output_tokens: int) -> None:
    while time.monotonic() < stop_at:
        prompt = [rng.randrange(*VOCAB) for _ in range(NOISY_PROMPT_TOKENS)]
        result = await complete(client, stack.gateway_url, key, stack.model, prompt, output_tokens)
        out.append(result)
        if result.status != 200:
            await asyncio.sleep(float(result.retry_after or 1))


async def _victim_arrivals(client: Any, stack: KVStack, key: str, prefix: list[int], rate: float,
                           rng: random.Random, stop_at: float, out: list[Completion]) -> None:
    tasks = []
    while time.monotonic() < stop_at:
        prompt = prefix + [rng.randrange(*VOCAB) for _ in range(VICTIM_SUFFIX_TOKENS)]
        tasks.append(asyncio.create_task(
            complete(client, stack.gateway_url, key, stack.model, prompt, VICTIM_OUTPUT_TOKENS)))
        await asyncio.sleep(rng.expovariate(rate))
    out.extend(await asyncio.gather(*tasks))


async def run_round(stack: KVStack, keys: dict[str, str], prefix: list[int], args: argparse.Namespace,
                    seed: int) -> dict[str, Any]:
    """One measured window: the requests sent in it (victim) and completed in it (noisy)."""
    noisy: list[Completion] = []
    victim: list[Completion] = []
    async with new_client() as client:
        measure_from = time.monotonic() + args.warmup
        wall_from = time.time() + args.warmup
        stop_at = measure_from + args.duration
        await asyncio.gather(
            *(_noisy_loop(client, stack, keys["noisy"], random.Random(seed * 100 + i), stop_at, noisy,
                          args.noisy_output) for i in range(args.noisy_concurrency)),
            _victim_arrivals(client, stack, keys["victim"], prefix, args.victim_rate, random.Random(seed), stop_at,
                             victim),
        )
    return {
        "victim": [r for r in victim if r.sent_at >= measure_from],
        "noisy": [r for r in noisy if measure_from <= r.sent_at + r.e2e_s <= stop_at],
        "noisy_rejected": sum(1 for r in noisy if r.status != 200),
        "window": (wall_from, wall_from + args.duration),
        "span": (wall_from - args.warmup, wall_from + args.duration),
        "loadavg": os.getloadavg(),
    }


def summarize(mode: str, rounds: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    victim = [r for rnd in rounds for r in rnd["victim"]]
    ok = [r for r in victim if r.status == 200 and not r.error and r.ttft_s is not None]
    noisy = [r for rnd in rounds for r in rnd["noisy"] if r.status == 200 and not r.error]
    seconds = duration_s * len(rounds)
    ttft = percentiles([r.ttft_s for r in ok if r.ttft_s is not None])
    e2e = percentiles([r.e2e_s for r in ok])
    tokens = sum(int(r.usage.get("total_tokens", 0)) for r in noisy)
    return {
        "mode": mode,
        "victim": {"requests": len(ok), "errors": len(victim) - len(ok),
                   "ttft_p50_s": ttft[0], "ttft_p99_s": ttft[1], "e2e_p50_s": e2e[0], "e2e_p99_s": e2e[1],
                   "cached_tokens_mean": sum(r.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                                             for r in ok) / max(1, len(ok))},
        "noisy": {"requests": len(noisy), "rejected": sum(rnd["noisy_rejected"] for rnd in rounds),
                  "tokens": tokens, "throughput_tok_s": tokens / seconds, "throughput_req_s": len(noisy) / seconds},
        "windows": [rnd["window"] for rnd in rounds],
        "spans": [rnd["span"] for rnd in rounds],
        "loadavg_1m": [rnd["loadavg"][0] for rnd in rounds],
    }


def per_tenant_from_spans(run_dir: Path, results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Preemptions per tenant (engine spans) and evicted blocks per owner (controller spans) in the measured
    windows; the controller's actions over each whole round (its warm-up included: it acts early)."""
    from tessera.telemetry.spanfile import iter_spans

    out: dict[str, dict[str, Counter[str]]] = {
        r["mode"]: {"preemptions": Counter(), "evicted_blocks": Counter(), "actions": Counter()} for r in results}

    def within(ts: float, windows: list[tuple[float, float]]) -> bool:
        return any(lo <= ts <= hi for lo, hi in windows)

    for span in iter_spans([run_dir / "traces"]):
        ts = span.start_ns / 1e9
        tenant = str(span.attr("tessera.tenant", ""))
        for r in results:
            counts = out[r["mode"]]
            if span.name == "engine.generate" and within(ts, r["windows"]):
                counts["preemptions"][tenant] += int(span.attr("tessera.preemptions", 0))
            elif span.name == "kvcontrol.eviction" and within(ts, r["windows"]):
                counts["evicted_blocks"][tenant] += int(span.attr("tessera.kv.blocks", 0))
            elif span.name.startswith("kvcontrol.") and span.name != "kvcontrol.eviction" and within(ts, r["spans"]):
                counts["actions"][f"{span.name.removeprefix('kvcontrol.')}:{tenant}"] += 1
    return {m: {k: dict(v) for k, v in d.items()} for m, d in out.items()}


async def _tenants(stack: KVStack) -> dict[str, str]:
    return {name: await stack.create_tenant(name, priority_class="normal", kv_quota=0.5)
            for name in ("victim", "noisy", "warmup")}


async def _warm(stack: KVStack, key: str) -> None:
    async with new_client() as client:  # the engine's first forward passes are slow: not part of any mode
        for i in range(3):
            await complete(client, stack.gateway_url, key, stack.model, list(range(10 + i, 300)), 4)


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs, alternated")
    parser.add_argument("--duration", type=float, default=40.0, help="measured seconds per mode and round")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds before each measurement")
    parser.add_argument("--noisy-concurrency", type=int, default=3)
    parser.add_argument("--noisy-output", type=int, default=NOISY_OUTPUT_TOKENS, help="noisy output tokens")
    parser.add_argument("--victim-rate", type=float, default=2.0, help="victim requests per second (Poisson)")
    parser.add_argument("--no-pinning", action="store_true", help="do not pin the engine and the platform apart")
    parser.add_argument("--engines", type=int, default=0,
                        help="fleet mode: one controller against this many simulated engines (kvcontrol_fleet.py)")
    parser.add_argument("--source", choices=("replay", "sim"), default="replay",
                        help="fleet mode: a busy engine's event mix at a set rate, or the sims under load")
    parser.add_argument("--rates", default="25,50,100,150",
                        help="fleet mode: per engine, batches/s (replay) or requests/s (sim), one window each")
    parser.add_argument("--step", type=float, default=20.0, help="fleet mode: seconds per rate")
    parser.add_argument("--capacity-blocks", type=int, default=4096, help="fleet mode: KV blocks per engine")
    args = parser.parse_args()
    if args.engines:
        from kvcontrol_fleet import run as run_fleet

        run_fleet(args)
        return

    from tessera.redis_conn import EmbeddedRedis

    model_dir = bench_model("tessera-small")
    run_dir = Path(tempfile.mkdtemp(prefix="bench-kvcontrol-"))
    # The engine gets core 0; everything else (this client, Redis, gateway, controller) core 1. Unpinned, the
    # engine's busy threads starve the gateway's event loop and the victim's tail is CPU queueing, which no KV
    # policy can change (the analyzer calls it gateway_queueing).
    engine_cpus, platform_cpus = (None, None) if args.no_pinning else split_cores()
    pin_this_process(platform_cpus)
    redis = EmbeddedRedis().start()
    stack = KVStack(StackOptions(model_dir=model_dir, redis_url=redis.url, run_dir=run_dir,
                                 engine_cpus=engine_cpus, platform_cpus=platform_cpus))
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    t0 = time.monotonic()
    try:
        stack.start()
        keys = asyncio.run(_tenants(stack))
        prefix = [random.Random(7).randrange(*VOCAB) for _ in range(PREFIX_TOKENS)]
        asyncio.run(_warm(stack, keys["warmup"]))
        for i in range(args.rounds):
            for mode in MODES:
                stack.start_controller(observe_only=(mode == "off"))
                print(f"[bench] round {i + 1}/{args.rounds}, controller {mode}: {args.warmup:.0f}+{args.duration:.0f} s"
                      f" (load average {os.getloadavg()[0]:.1f})", flush=True)
                rounds[mode].append(asyncio.run(run_round(stack, keys, prefix, args, seed=10 * i + len(rounds[mode]))))
                time.sleep(1.0)  # let the last eviction spans and actions be exported
                stack.stop_controller()  # releases its flags
                stack.wait_idle()
    finally:
        stack.stop()
        redis.stop()
    results = [summarize(mode, rounds[mode], args.duration) for mode in MODES]
    tenants = per_tenant_from_spans(run_dir, results)
    for r in results:
        r["tenants"] = tenants[r["mode"]]
    report(results, run_dir, args, time.monotonic() - t0)


def report(results: list[dict[str, Any]], run_dir: Path, args: argparse.Namespace, elapsed_s: float) -> None:
    off, on = results
    ratio_ttft = on["victim"]["ttft_p99_s"] / off["victim"]["ttft_p99_s"]
    ratio_tput = on["noisy"]["throughput_tok_s"] / off["noisy"]["throughput_tok_s"]
    payload = {
        "benchmark": "kvcontrol", "scenario": {
            "engines": 1, "num_gpu_blocks": 64, "block_size": 32, "max_num_batched_tokens": 256,
            "noisy_concurrency": args.noisy_concurrency, "noisy_prompt_tokens": NOISY_PROMPT_TOKENS,
            "noisy_output_tokens": args.noisy_output, "victim_rate_per_s": args.victim_rate,
            "victim_prefix_tokens": PREFIX_TOKENS, "victim_output_tokens": VICTIM_OUTPUT_TOKENS,
            "rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup, "cpus": os.cpu_count(),
            "pinned": not args.no_pinning},
        "modes": results,
        "goals": {"victim_ttft_p99_on_over_off": ratio_ttft, "victim_ttft_goal_met": ratio_ttft <= 0.5,
                  "noisy_throughput_on_over_off": ratio_tput, "noisy_throughput_goal_met": ratio_tput >= 0.8},
        "elapsed_s": elapsed_s, "run_dir": str(run_dir),
    }
    path = write_results("kvcontrol", payload)
    rows = []
    for r in results:
        v, n, t = r["victim"], r["noisy"], r["tenants"]
        rows.append([r["mode"], v["requests"], v["ttft_p50_s"], v["ttft_p99_s"], v["e2e_p50_s"], v["e2e_p99_s"],
                     n["throughput_tok_s"], n["throughput_req_s"], _fmt(t["evicted_blocks"]), _fmt(t["preemptions"]),
                     _fmt(t["actions"])])
    print_table(["controller", "victim reqs", "ttft p50", "ttft p99", "e2e p50", "e2e p99", "noisy tok/s",
                 "noisy req/s", "evicted blocks", "preemptions", "actions"], rows)
    print(f"victim p99 TTFT on/off = {ratio_ttft:.2f} (goal <= 0.5: {'met' if ratio_ttft <= 0.5 else 'NOT met'}); "
          f"noisy throughput on/off = {ratio_tput:.2f} (goal >= 0.8: {'met' if ratio_tput >= 0.8 else 'NOT met'}); "
          f"load average per round off {off['loadavg_1m']} on {on['loadavg_1m']}")
    print(f"results: {path}; spans and logs: {run_dir}")


def _fmt(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if v) or "-"


if __name__ == "__main__":
    main()
