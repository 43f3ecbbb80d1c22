"""make bench-gateway: what the gateway adds over calling the engine replica directly.

One engine replica (``tessera engine serve``: vLLM CPU build, the small model, FP8 KV, n-gram speculation)
and one gateway process (one uvicorn worker, so its CPU is one process's CPU). The engine is pinned to the
first core and the gateway, this client and Redis to the others (``--no-pinning`` to compare): unpinned on a
2-core machine, vLLM's busy engine-core loop takes the CPU the gateway and the client need, and a stream can
reach either of them only once the whole generation is over (TTFT p99 in the hundreds of milliseconds on
both paths). At each arrival rate the
same Poisson schedule of 64-token streamed chat requests alternates between the two paths, so both see
the same engine conditions. TTFT is the first streamed event that carries the engine's first delta.
Gateway CPU per chunk comes from alternating long and short streams, each short one padded to the wall
time of the long one before it, so the difference holds neither per-request cost nor the gateway's own
background (cache refreshers, span export: ~4 ms of CPU per second here, which at one chunk every 30 ms is
as much again as the chunks).
It is measured twice: against the small model (a chunk every ~4 ms) and against a larger generated model
whose decode steps take ~30 ms, as a large model's do on a GPU; between chunks that far apart the process
goes cold, and each chunk costs more. A least-squares fit over the mixed phases (cpu - idle = a·requests +
b·chunks) is printed beside them, but trades the two terms against each other from run to run. The added
TTFT p50 comes with a 95% bootstrap interval: over a few dozen requests per path it is about ±0.7 ms wide on
this machine.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import psutil

from tessera.engine.small_model import SmallModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import (
    bench_model,
    bench_setup,
    cpu_seconds,
    issue_keys,
    median_difference_ci,
    percentiles,
    print_table,
    signed_headers,
    start_engine,
    start_gateway,
    stop,
    stop_on_sigterm,
    write_results,
)

RATES = (2.0, 4.0, 8.0)
LENGTHS = (16, 64)
# At least this long and this many requests (both paths together) per phase: p50 over a handful of requests
# moved by 2-3 ms between runs on this machine, over 20-40 requests still by ~0.5 ms.
PHASE_S = 30.0
MIN_PHASE_REQUESTS = 120
# Per-chunk CPU from this many sequential short and long gateway streams (see chunk_cost).
CHUNK_COST_REQUESTS = 15
CHUNK_COST_SHORT, CHUNK_COST_LONG = 8, 384
# The paced model for the second chunk-cost measurement: ~30 ms per decode step on one core here.
PACED_MODEL = SmallModelSpec(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                             intermediate_size=2816)
IDLE_S = 5.0
PROMPT = "Tell me about the KV cache and speculative decoding in one paragraph."


async def one_direct(session: aiohttp.ClientSession, url: str, ids: list[int], n: int) -> dict[str, Any]:
    body = {"request_id": f"d-{time.monotonic_ns()}", "prompt_token_ids": ids, "max_tokens": n,
            "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, chunks = None, 0
    data = orjson.dumps(body)
    async with session.post(f"{url}/generate", data=data, headers=signed_headers("POST", "/generate", data)) as resp:
        async for line in resp.content:
            msg = orjson.loads(line)
            if "d" in msg:
                chunks += 1
                ttft = ttft or time.perf_counter() - t0
    return {"path": "direct", "ttft": ttft, "e2e": time.perf_counter() - t0, "chunks": chunks}


async def one_gateway(session: aiohttp.ClientSession, url: str, key: str, n: int,
                      model: str = "tessera-small") -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n,
            "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    ttft, chunks = None, 0
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
                ttft = ttft or time.perf_counter() - t0
    return {"path": "gateway", "ttft": ttft, "e2e": time.perf_counter() - t0, "chunks": chunks}


async def phase(rate: float, length: int, engine_url: str, gateway_url: str, key: str, ids: list[int],
                gateway_proc: psutil.Process) -> dict[str, Any]:
    rng = random.Random(int(rate * 1000) + length)
    schedule: list[float] = []
    t = 0.0
    while t < PHASE_S or len(schedule) < MIN_PHASE_REQUESTS:
        t += rng.expovariate(rate)
        schedule.append(t)
    results: list[dict[str, Any]] = []
    cpu0 = cpu_seconds(gateway_proc.pid)
    wall0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def fire(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if i % 2 == 0:
                results.append(await one_direct(session, engine_url, ids, length))
            else:
                results.append(await one_gateway(session, gateway_url, key, length))

        await asyncio.gather(*(fire(i, at) for i, at in enumerate(schedule)))
    cpu = cpu_seconds(gateway_proc.pid) - cpu0
    gw = [r for r in results if r["path"] == "gateway"]
    return {"rate": rate, "length": length, "results": results, "gateway_cpu_s": cpu,
            "wall_s": time.perf_counter() - wall0,
            "gateway_requests": len(gw), "gateway_chunks": sum(r["chunks"] for r in gw)}


async def main_async(engine_url: str, gateway_url: str, key: str, ids: list[int], gw_pid: int,
                     chunk_cost_only: bool = False) -> tuple[list[dict[str, Any]], dict[str, float]]:
    proc = psutil.Process(gw_pid)
    async with aiohttp.ClientSession() as session:  # warm both paths (tokenizer load, connections)
        for _ in range(3):
            await one_direct(session, engine_url, ids, 8)
            await one_gateway(session, gateway_url, key, 8)
        # The gateway's background CPU while it serves nothing, right after the warm-up (its registry
        # refresher keeps running for 10 s after the last request, as it does between the phases' requests).
        cpu0, wall0 = cpu_seconds(proc.pid), time.perf_counter()
        await asyncio.sleep(IDLE_S)
        idle_cpu_per_s = (cpu_seconds(proc.pid) - cpu0) / (time.perf_counter() - wall0)
    phases: list[dict[str, Any]] = []
    for length in LENGTHS if not chunk_cost_only else ():
        for rate in RATES:
            phases.append(await phase(rate, length, engine_url, gateway_url, key, ids, proc))
            phases[-1]["idle_cpu_s"] = idle_cpu_per_s * phases[-1]["wall_s"]
            print(f"  phase rate={rate} len={length}: {len(phases[-1]['results'])} requests", flush=True)
    return phases, await chunk_cost(gateway_url, key, proc, "tessera-small")


async def chunk_cost(gateway_url: str, key: str, proc: psutil.Process, model: str) -> dict[str, Any]:
    """Gateway CPU per streamed chunk from sequential requests that differ only in length: each long stream
    is followed by a short one and an idle wait that make up the same wall time, so (CPU long - CPU short) /
    (chunks long - chunks short) holds neither per-request cost (the mixed phases' least-squares split
    trades the two terms against each other) nor the gateway's background, which runs alike in both
    windows; alternating them cancels its drift over the run as well."""
    cpu_long = cpu_short = wall_long = 0.0
    chunks_long = chunks_short = 0
    async with aiohttp.ClientSession() as session:
        await one_gateway(session, gateway_url, key, CHUNK_COST_SHORT, model)  # warm: tokenizer, connection
        for _ in range(CHUNK_COST_REQUESTS):
            cpu0, wall0 = cpu_seconds(proc.pid), time.perf_counter()
            chunks_long += (await one_gateway(session, gateway_url, key, CHUNK_COST_LONG, model))["chunks"]
            cpu1, wall1 = cpu_seconds(proc.pid), time.perf_counter()
            chunks_short += (await one_gateway(session, gateway_url, key, CHUNK_COST_SHORT, model))["chunks"]
            await asyncio.sleep(max(0.0, wall1 + (wall1 - wall0) - time.perf_counter()))
            cpu_long += cpu1 - cpu0
            cpu_short += cpu_seconds(proc.pid) - cpu1
            wall_long += wall1 - wall0
    return {"model": model, "per_chunk_ms": (cpu_long - cpu_short) / (chunks_long - chunks_short) * 1e3,
            # How far apart the chunks came: the colder the process between them, the more each costs.
            "chunk_interval_ms": wall_long / max(chunks_long, 1) * 1e3,
            "chunks_short": chunks_short, "chunks_long": chunks_long, "wall_s": wall_long,
            "cpu_short_s": cpu_short, "cpu_long_s": cpu_long}


def engine_overrides() -> dict[str, Any]:
    """``--engine-config JSON``: EngineConfig keys for both engines (e.g. '{"shmBusyLoopS": 1.0}' to compare a
    gateway change at the engine's old pace: the chunk cost grows with the time between chunks)."""
    if "--engine-config" not in sys.argv:
        return {}
    overrides = orjson.loads(sys.argv[sys.argv.index("--engine-config") + 1])
    assert isinstance(overrides, dict), "--engine-config takes a JSON object"
    return overrides


def paced_chunk_cost(env: dict[str, str], work: Path, engine_cpus: str | None, gateway_url: str, key: str,
                     gateway_pid: int) -> dict[str, float]:
    """The chunk cost again, against an engine serving the paced model (made on first use)."""
    paced_dir = bench_model("tessera-paced", PACED_MODEL)
    engine, _ = start_engine({"model": str(paced_dir), "servedModelName": "tessera-paced", **engine_overrides()}, env,
                             work / "engine-paced.log", cpus=engine_cpus)
    try:
        time.sleep(3)  # the engine's registration and the gateway's catalog refresh
        return asyncio.run(chunk_cost(gateway_url, key, psutil.Process(gateway_pid), "tessera-paced"))
    finally:
        stop(engine)


def print_chunk_costs(costs: list[dict[str, float]]) -> None:
    print(f"\nGateway CPU per streamed chunk, from {CHUNK_COST_REQUESTS} {CHUNK_COST_LONG}-token streams, each "
          f"beside an {CHUNK_COST_SHORT}-token one padded to the same wall time (goal < 0.1 ms; a Ray "
          "DeploymentHandle stream measured ~0.9 ms)")
    print_table(["model", "ms between chunks", "chunks long", "chunks short", "CPU ms per chunk"],
                [[c["model"], c["chunk_interval_ms"], c["chunks_long"], c["chunks_short"], c["per_chunk_ms"]]
                 for c in costs])


def main() -> None:
    stop_on_sigterm()
    # --chunk-cost-only: just the sequential per-chunk measurement (a minute instead of ten).
    chunk_cost_only = "--chunk-cost-only" in sys.argv
    setup = bench_setup("gateway", pinning="--no-pinning" not in sys.argv)
    model_dir, work, redis = setup.model_dir, setup.work, setup.redis
    engine_cpus, platform_cpus = setup.engine_cpus, setup.platform_cpus
    env = {"TESSERA_REDIS_URL": redis.url, "TESSERA_TRACE_DIR": str(work / "traces"),
           # The default policy: its prefix lookup rides in admission's round trip.
           "TESSERA_ROUTING_POLICY": "prefix_affinity", "VLLM_CPU_KVCACHE_SPACE": "1"}
    engine, engine_url = start_engine({"model": str(model_dir.resolve()), "servedModelName": "tessera-small",
                                       **engine_overrides()},
                                      env, work / "engine.log", cpus=engine_cpus)
    gateway, gateway_url = start_gateway(env, work / "gateway.log", cpus=platform_cpus)
    try:
        key = issue_keys(redis.url, {"bench": None})["bench"]
        from tessera.gateway.models import load_served_model
        from tessera.registry import ModelInfo

        served = load_served_model(ModelInfo("tessera-small", str(model_dir.resolve()), 2048, 32))
        ids = served.encode_chat([{"role": "user", "content": PROMPT}])
        time.sleep(2)  # let the engine's first heartbeat land
        phases, chunks = asyncio.run(main_async(engine_url, gateway_url, key, ids, gateway.pid, chunk_cost_only))
        stop(engine)
        costs = [chunks, paced_chunk_cost(env, work, setup.engine_cpus, gateway_url, key, gateway.pid)]
    finally:
        stop(gateway)
        stop(engine)
        redis.stop()

    if chunk_cost_only:
        print_chunk_costs(costs)
        print(f"results: {write_results('gateway-chunks', {'chunk_costs': costs})}")
        return
    rows, summary = [], []
    for p in phases:
        for path in ("direct", "gateway"):
            rs = [r for r in p["results"] if r["path"] == path and r["ttft"] is not None]
            t50, t99 = percentiles([r["ttft"] * 1e3 for r in rs])
            e50, e99 = percentiles([r["e2e"] * 1e3 for r in rs])
            row = {"rate": p["rate"], "tokens": p["length"], "path": path, "n": len(rs), "ttft_p50_ms": t50,
                   "ttft_p99_ms": t99, "e2e_p50_ms": e50, "e2e_p99_ms": e99,
                   "chunks_per_req": float(np.mean([r["chunks"] for r in rs])) if rs else 0.0}
            summary.append(row)
            rows.append(list(row.values()))
    # Gateway CPU less its idle background = a*requests + b*chunks, least squares over all phases.
    a_matrix = np.array([[p["gateway_requests"], p["gateway_chunks"]] for p in phases], dtype=float)
    cpu = np.array([p["gateway_cpu_s"] - p["idle_cpu_s"] for p in phases])
    (per_request_s, per_chunk_s), *_ = np.linalg.lstsq(a_matrix, cpu, rcond=None)
    added = []
    for p in phases:
        ttfts = {path: [r["ttft"] * 1e3 for r in p["results"] if r["path"] == path and r["ttft"] is not None]
                 for path in ("direct", "gateway")}
        d = next(s for s in summary if (s["rate"], s["tokens"], s["path"]) == (p["rate"], p["length"], "direct"))
        g = next(s for s in summary if (s["rate"], s["tokens"], s["path"]) == (p["rate"], p["length"], "gateway"))
        low, high = median_difference_ci(ttfts["direct"], ttfts["gateway"])
        added.append({"rate": p["rate"], "tokens": p["length"],
                      "added_ttft_p50_ms": g["ttft_p50_ms"] - d["ttft_p50_ms"],
                      "ci95_low_ms": low, "ci95_high_ms": high,
                      "added_ttft_p99_ms": g["ttft_p99_ms"] - d["ttft_p99_ms"]})
    print("\nTTFT / E2E per path (ms), same engine replica, requests alternating between paths")
    print_table(list(summary[0].keys()), rows)
    print("\nGateway overhead (goal: at most 2 ms added TTFT p50); 95% bootstrap interval of the p50 difference")
    print_table(["rate", "tokens", "added TTFT p50 ms", "95% CI low", "95% CI high", "added TTFT p99 ms"],
                [[a["rate"], a["tokens"], a["added_ttft_p50_ms"], a["ci95_low_ms"], a["ci95_high_ms"],
                  a["added_ttft_p99_ms"]] for a in added])
    idle_ms_per_s = phases[0]["idle_cpu_s"] / phases[0]["wall_s"] * 1e3
    print_chunk_costs(costs)
    print(f"Least-squares split over the mixed phases: {per_request_s * 1e3:.3f} ms per request + "
          f"{per_chunk_s * 1e3:.4f} ms per chunk, beside {idle_ms_per_s:.2f} ms per second of idle background")
    results_path = write_results("gateway", {"phases": [{k: v for k, v in p.items() if k != "results"} for p in phases],
                                     "summary": summary, "added": added,
                                     "gateway_cpu_ms_per_request": per_request_s * 1e3,
                                     "gateway_cpu_ms_per_chunk": per_chunk_s * 1e3,
                                     "gateway_idle_cpu_ms_per_s": idle_ms_per_s,
                                     "chunk_costs": costs})
    print(f"results: {results_path}")


if __name__ == "__main__":
    main()
