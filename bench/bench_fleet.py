"""Fleet benchmark (`make bench-fleet`): Tessera's routing policies and vLLM's Rust router (vllm-router
0.1.17) in front of 16 / 64 / 256 / 1,000 simulated H100 engines (issue #17).

Setup, per fleet size: one seeded workload (bench/fleet/workload.py: chat sessions over tenants' shared
system prompts with Zipf popularity, and a noisy tenant whose long prompts share nothing). For each policy
a fresh fleet (`tessera engine sim`, one process: default H100 SXM + Llama-3-70B TP8 FP8 KV, roofline step
times, the planner's KV capacity) registers in an embedded Redis, and the workload is replayed against it:
* Tessera's policies in this process, as bench_routing drives them: ``Router.route`` (two instances for
  two gateway workers; prefix_affinity's lookup from the in-process index, fed by the engines' KV events
  through Redis) then the chosen replica's ``/generate``;
* vllm-router as a process in front of the replicas' OpenAI routes, with its ``cache_aware`` policy (its
  own radix tree of routed text) and its ``kv_aware`` policy fed by the same replicas' KV events
  (``--kv-event-source URL=tcp://…`` per replica, vLLM's wire format).

Time: the fleet runs ``time_scale`` times slower than real time (--time-scale; default grows with the
size, so 1,000 engines keep up on two cores) and every latency is in simulated time; a probe of the
fleet's event loop says whether it kept up (``fleet_probe_*``: a /health round trip, wall ms).

Measured per size and policy: the engines' own cached tokens against the ideal (an unbounded cache that
saw every earlier request), TTFT p50/p99 from the scheduled arrival, throughput, load imbalance (max/mean
of the engines' simulated busy time), Tessera's decision latency (wall µs of ``Router.route``), index
memory (the local index's bytes; vllm-router's RSS) and event lag (engine publication to visible in the
local index, wall ms). Goals (issue #17): prefix_affinity >= 90 % of the ideal hit rate and p99 TTFT <=
0.5x round_robin at every size, and ahead of vllm-router on both. Beside them, per size, the floors no
router beats (fleet/floors.py): the workload's TTFT p99 alone on an idle replica, uncached and with the ideal
cache; their ratio is the best p99 ratio to round_robin any policy reaches where no replica queues. Results:
bench/results/fleet.json and fleet.png; a table per size.

    python bench/bench_fleet.py                               # all four sizes (~20 min on 2 cores)
    python bench/bench_fleet.py --sizes 16,64                 # a short run
    python bench/bench_fleet.py --sizes 64 --policies prefix_affinity,round_robin --vllm-router-policies ''
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import REPO, print_table, stop_on_sigterm, write_results
from fleet import drive, procs
from fleet.floors import ttft_floors
from fleet.plot import plot
from fleet.summary import TABLE_HEADERS, VLLM_ROUTER_PREFIX, goals, summarize, table_rows
from fleet.workload import WorkloadConfig, block_chains, ideal_cached_tokens, make_workload

SIZES = (16, 64, 256, 1000)
TESSERA_POLICIES = ("round_robin", "least_loaded", "session_affinity", "approx_prefix", "prefix_affinity")
VLLM_ROUTER_POLICIES = ("cache_aware", "kv_aware")
MODEL = "sim-llama-3-70b"
BLOCK_SIZE = 16
RESULTS_NAME = "fleet"
PLOT_PATH = REPO / "bench" / "results" / "fleet.png"


def default_time_scale(num_engines: int) -> float:
    """Wall seconds per simulated second: 2 up to 64 engines, then in proportion (1,000 engines: ~31x). At
    1x, 16 engines on this shared 2-core machine (load average ~5) fell behind by up to 3 s of wall time."""
    return max(2.0, num_engines / 32)


def default_num_requests(num_engines: int) -> int:
    return min(2000, max(400, 5 * num_engines))


def default_num_system_prompts(num_engines: int) -> int:
    return max(32, num_engines // 4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="fleet sizes, comma-separated")
    p.add_argument("--requests", type=int, default=None, help="requests per size (default: 5 per engine, "
                                                               "400 to 2,000)")
    p.add_argument("--rate-per-engine", type=float, default=2.0, help="arrivals per engine per simulated second")
    p.add_argument("--time-scale", type=float, default=None, help="wall s per simulated s (default: per size)")
    p.add_argument("--policies", default=",".join(TESSERA_POLICIES), help="Tessera policies to run")
    p.add_argument("--vllm-router-policies", default=",".join(VLLM_ROUTER_POLICIES),
                   help="vllm-router policies to run ('' for none)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--index-source", default="local", choices=("local", "redis"),
                   help="where prefix_affinity's lookup is answered")
    p.add_argument("--vllm-router-log-level", default="warning", help="its --log-level (its log: the work dir)")
    p.add_argument("--gateway-workers", type=int, default=2, help="router instances standing for gateway workers")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="the replicas' cap on a prefill's tokens a step while others run or wait (vLLM's; 0: none)")
    return p.parse_args(argv)


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def workload_floors(prompt_tokens: list[int], ideal: list[int]) -> dict[str, float]:
    """The workload's idle-replica TTFT floors (fleet/floors.py) on the replica the fleet simulates (the sim's
    default configuration: its step-time model and token budget), in simulated ms."""
    from tessera.engine.sim.config import SimEngineConfig
    from tessera.engine.sim.step_time import step_time_fn

    replica = SimEngineConfig()
    floors = ttft_floors(prompt_tokens, ideal, step_time_fn(replica.step_time), replica.max_num_batched_tokens)
    return {"uncached_p50_ms": floors.uncached_p50_s * 1000, "uncached_p99_ms": floors.uncached_p99_s * 1000,
            "ideal_p50_ms": floors.ideal_p50_s * 1000, "ideal_p99_ms": floors.ideal_p99_s * 1000,
            "best_p99_ratio": floors.best_p99_ratio}


async def redis_used_memory(redis_url: str) -> int:
    from tessera.redis_conn import connect

    redis = connect(redis_url, timeout_s=5.0)
    try:
        return int((await redis.info("memory"))["used_memory"])
    finally:
        await redis.aclose()


async def run_size(num_engines: int, args: argparse.Namespace, redis_url: str, work: Path) -> dict[str, Any]:
    from tessera.routing.hashing import block_hash_chain

    time_scale = args.time_scale or default_time_scale(num_engines)
    config = WorkloadConfig(num_requests=args.requests or default_num_requests(num_engines),
                            rate_per_s=args.rate_per_engine * num_engines, seed=args.seed,
                            num_system_prompts=default_num_system_prompts(num_engines), max_tokens=args.max_tokens,
                            gateway_workers=args.gateway_workers)
    requests = make_workload(config)
    chains = block_chains(requests, BLOCK_SIZE, block_hash_chain)
    ideal = ideal_cached_tokens(chains, [r.num_prompt_tokens for r in requests], BLOCK_SIZE)
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    floors = workload_floors([r.num_prompt_tokens for r in requests], ideal)
    print(f"\n== {num_engines} engines: {len(requests)} requests over {requests[-1].arrival_s:.1f} simulated s, "
          f"time scale {time_scale:g}, ideal hit rate {sum(ideal) / prompt_tokens:.1%}; alone on an idle replica "
          f"TTFT p99 {floors['uncached_p99_ms']:.0f} ms uncached, {floors['ideal_p99_ms']:.0f} ms with the ideal "
          f"cache (best p99 ratio where nothing queues: {floors['best_p99_ratio']:.2f})", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    runs = [(p, False) for p in _names(args.policies)] + [(p, True) for p in _names(args.vllm_router_policies)]
    for policy, via_vllm_router in runs:
        name = f"{VLLM_ROUTER_PREFIX}{policy}" if via_vllm_router else policy
        tag = f"{num_engines}-{name.replace(':', '-')}"
        started = time.monotonic()
        sim_config = {"time_scale": time_scale, "feed_index": not via_vllm_router, "served_model_name": MODEL,
                      "block_size": BLOCK_SIZE, "long_prefill_token_threshold": args.long_prefill_token_threshold}
        fleet = procs.start_fleet(num_engines, sim_config, redis_url, work, tag)
        router: procs.VllmRouter | None = None
        try:
            records = await procs.wait_registered(redis_url, fleet.urls)
            with drive.LoopProbe(fleet.urls) as probe:
                if via_vllm_router:
                    try:
                        router = procs.start_vllm_router(
                            policy, fleet.urls, {u: r.kv_events_endpoint for u, r in records.items()}, MODEL,
                            BLOCK_SIZE, work, tag, args.vllm_router_log_level)
                    except procs.RouterUnavailable as exc:
                        skipped[name] = str(exc)
                        print(f"  {name:<24} skipped: {exc}", flush=True)
                        continue
                    result = await drive.run_openai(router.url, requests, MODEL, time_scale)
                    result.extra["router_rss_bytes"] = router.rss_bytes()
                    result.extra["router_metrics"] = router.metrics()
                else:
                    result = await drive.run_tessera(policy, requests, chains, redis_url, MODEL, time_scale,
                                                     args.gateway_workers, args.index_source)
            stats = await procs.fleet_stats(fleet.urls)
            extra = {**result.extra, **probe.summary(), "redis_used_memory_bytes": await redis_used_memory(redis_url),
                     "wall_s": time.monotonic() - started}
            # The fleet's lateness in simulated ms: past a decode step or two (~10 ms each), its TTFTs carry it.
            extra["fleet_lag_p99_sim_ms"] = extra["fleet_probe_p99_ms_wall"] / time_scale
        finally:
            if router is not None:
                router.stop()
            fleet.stop()
        row = rows[name] = summarize(result.outcomes, sum(ideal), stats, extra)
        print(f"  {name:<24} hit {row['hit_rate']:.1%} ({row['share_of_ideal']:.1%} of ideal)  TTFT p50 "
              f"{row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms  busy max/mean {row['imbalance_busy']:.2f}  "
              f"failed {row['num_failed']}  probes p99: fleet {row['fleet_probe_p99_ms_wall']:.0f} ms, client "
              f"{row['client_loop_lag_p99_ms_wall']:.0f} ms wall (fleet {row['fleet_lag_p99_sim_ms']:.0f} sim ms)  "
              f"[{row['wall_s']:.0f} s, load {os.getloadavg()[0]:.1f}]", flush=True)
        if row.get("errors"):
            print(f"    failures: {row['errors']}", flush=True)
    return {"num_engines": num_engines, "time_scale": time_scale,
            "workload": {**{k: getattr(config, k) for k in config.__dataclass_fields__},
                         "num_requests_generated": len(requests), "prompt_tokens": prompt_tokens,
                         "ideal_hit_rate": sum(ideal) / prompt_tokens, "ttft_floors": floors,
                         "duration_s": requests[-1].arrival_s},
            "policies": rows, "skipped": skipped, "goals": goals(rows)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from tessera.redis_conn import EmbeddedRedis

    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    redis = EmbeddedRedis().start()
    result: dict[str, Any] = {
        "setup": {"engine": "tessera engine sim: H100 SXM, Llama-3-70B TP8, FP8 KV, roofline step times",
                  "block_size": BLOCK_SIZE, "rate_per_engine_per_s": args.rate_per_engine,
                  "max_tokens": args.max_tokens, "gateway_workers": args.gateway_workers,
                  "index_source": args.index_source, "vllm_router_version": procs.router_version(),
                  "work_dir": str(work)},
        "sizes": {},
        "machine": {"cpus": os.cpu_count(), "load_average_1m_before": os.getloadavg()[0]},
    }
    started = time.monotonic()
    try:
        for size in [int(s) for s in _names(args.sizes)]:
            result["sizes"][str(size)] = await run_size(size, args, redis.url, work)
            result["machine"]["load_average_1m_after"] = os.getloadavg()[0]
            result["wall_s"] = time.monotonic() - started
            write_results(RESULTS_NAME, result)  # after every size: a cut run keeps what it measured
    finally:
        redis.stop()
    return result


def main(argv: list[str] | None = None) -> None:
    stop_on_sigterm()
    os.environ.setdefault("TESSERA_TRACE_EXPORTER", "none")
    args = parse_args(argv)
    result = asyncio.run(main_async(args))
    plotted = plot(result["sizes"], PLOT_PATH)
    result["plot"] = str(plotted) if plotted else None
    path = write_results(RESULTS_NAME, result)
    for size, entry in result["sizes"].items():
        floors = entry["workload"]["ttft_floors"]
        print(f"\n{size} engines (time scale {entry['time_scale']:g}; ideal hit rate "
              f"{entry['workload']['ideal_hit_rate']:.1%}; latencies in simulated ms; alone on an idle replica, "
              f"TTFT p99 {floors['uncached_p99_ms']:.0f} uncached / {floors['ideal_p99_ms']:.0f} ideal cache)")
        print_table(TABLE_HEADERS, table_rows(entry["policies"]))
        print("goals:", json.dumps(entry["goals"]))
        for name, why in entry["skipped"].items():
            print(f"skipped {name}: {why}")
    machine = result["machine"]
    print(f"\nresults: {path}  plot: {result['plot']}  ({result['wall_s']:.0f} s; {machine['cpus']} CPUs, load "
          f"average {machine['load_average_1m_before']:.1f} before, {machine['load_average_1m_after']:.1f} after)")


if __name__ == "__main__":
    main()
