"""Routing benchmark (`make bench-routing`): all five policies on one request sequence, in every regime
of load (light, overloaded) and KV capacity (ample, scarce), real engines by default.

Setup: three ``EngineHost`` replicas in this process (each a real vLLM engine, CPU build, in its own engine
core process) serving a generated model large enough that prefilling 1,000 tokens takes >= 50 ms here.
The engines feed the Redis prefix index from their own KV events, exactly as in production. Requests go
through the gateway's routing path in process — hash chain → ``Router.route`` (registry + one Redis lookup +
policy) → stream from the chosen replica's own ``/generate`` — with two router instances standing in for two
gateway worker processes (the ``make run`` default), each with its own in-flight counts and, for the stateful
baselines, its own memory. Authentication and admission are left out: they cost the same under every policy.

Regimes: the KV cache per engine is ``KV_LEVELS`` blocks (ample: one engine holds every system prompt;
scarce: about a quarter of them, the fleet three quarters), the arrival rate ``LOAD_FACTORS`` x the rate
the fleet could serve if nothing were cached (light: 0.4, below it; overloaded: 2.0, above it unless
routing keeps most prefixes cached). Engines restart per KV level (vLLM sizes its cache at start).

``--backend sim`` runs the same regimes in virtual time on the simulated engine's scheduler and block pool
(``routing_sim.py``: the gateway's own policies, heartbeat and registry-read lag, KV events after a lag;
step costs of a slow CPU machine unless ``--step-costs``), several seeded sequences per regime, in seconds
instead of minutes; it writes bench/results/routing-sim.json, every figure labelled ``"backend": "sim"``.

Workload: several tenants, several long system prompts each (Zipf popularity), unique suffixes, Poisson
arrivals; the same seeded sequence for every policy. Engines' prefix caches are reset between policies
(AllBlocksCleared also empties their index entries), so each policy starts cold.

Measured: the engines' own ``num_cached_tokens`` against the workload's ideal (an unbounded cache on one
engine), TTFT p50/p99 from each request's scheduled arrival to its first token, throughput; and the
routing decision's own cost for 64 engines and 100,000 indexed blocks. Results: bench/results/routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import REPO, bench_model, signed_headers, stop_on_sigterm
from replica_drive import one_pod, read_generate_stream, replay
from routing_figures import fleet_lru_cached_tokens, percentile
from routing_sim import SLOW_CPU_STEP_COSTS, Outcome, SimRequestSpec, SimSetup, WorkloadSpec, make_workload

MODEL_DIR = REPO / ".tessera" / "models" / "tessera-bench-routing"
RESULTS = REPO / "bench" / "results" / "routing.json"
RESULTS_SIM = REPO / "bench" / "results" / "routing-sim.json"  # the sim backend's: never mixed with real runs
MODEL = "bench-routing"
POLICIES = ["round_robin", "least_loaded", "session_affinity", "approx_prefix", "prefix_affinity"]

NUM_ENGINES = 3
BLOCK = 32
GATEWAY_WORKERS = 2
WORKLOAD = WorkloadSpec(block_size=BLOCK, workers=GATEWAY_WORKERS)
# KV blocks per engine. The 12 system prompts are 12,288 tokens: ample holds them all on every engine
# (19,200 tokens, room left for suffixes); tight, about five (the bench's size before the sweep: the fleet
# holds all twelve, no engine does); scarce, about three (the same halved, as a bf16 KV cache halves an
# FP8 one: the fleet holds three quarters of them).
KV_LEVELS = {"ample": 600, "tight": 200, "scarce": 100}
# Arrival rate as a multiple of the fleet's cold capacity (requests/s it could serve with nothing cached).
LOAD_FACTORS = {"light": 0.4, "overloaded": 2.0}
DEFAULT_REGIMES = [("light", "ample"), ("overloaded", "ample"), ("light", "scarce"), ("overloaded", "scarce")]
NUM_REQUESTS = 150  # per regime and round
# One round by default; a second (--rounds 2) replays the sequence in reverse policy order, so a machine
# whose background load drifts (this one is shared) weighs on every policy alike.
ROUNDS = 1
# The sim backend: requests per sequence and seeded sequences per regime (~30 s of CPU for the six regimes). Each
# sequence starts on a cold fleet, and under overload its first ~25 requests (every prefix new, the queues
# building) are where the slowest requests are; with four sequences the pooled p99 was the slowest 8 of 800, all
# from one sequence's start (overloaded/ample: prefix_affinity 3,891 against approx_prefix 3,782 ms), with sixteen
# the slowest 32 of 3,200 from several (3,504 against 4,060 ms). docs/routing.md, "The sweep's sample".
SIM_REQUESTS = 200
SIM_SEQUENCES = 16
# At fleet scale (--sim-engines above 3) each sequence already holds engines/3 times the requests, so the pooled
# p99 spans that many more of them: four sequences, as those runs were measured (docs/routing.md).
SIM_SEQUENCES_SCALED = 4
# The sim backend at fleet scale (--sim-engines): the system prompts grow with the fleet (SYSTEM_PROMPTS_PER_ENGINE
# an engine, as 12 over 3 engines), so each regime's cache against the working set, and each engine's share
# of the arrivals, stay what they are at 3 engines; the requests grow with it too.
SYSTEM_PROMPTS_PER_ENGINE = 4


def scaled_workload(num_engines: int) -> WorkloadSpec:
    """The workload for a fleet of ``num_engines``: SYSTEM_PROMPTS_PER_ENGINE prompts an engine over about
    the square root as many tenants (3 engines: 4 tenants x 3, the default; 64: 16 x 16)."""
    prompts = SYSTEM_PROMPTS_PER_ENGINE * num_engines
    tenants = max(WORKLOAD.tenants, math.isqrt(prompts))
    return replace(WORKLOAD, tenants=tenants, prompts_per_tenant=-(-prompts // tenants))


@dataclass(frozen=True)
class Regime:
    load: str
    kv: str
    rate_per_s: float
    kv_blocks: int

    @property
    def name(self) -> str:
        return f"{self.load}/{self.kv}"


# ---- setup (real engines) ---------------------------------------------------------------------------------


def ensure_model() -> None:
    from tessera.engine.small_model import SmallModelSpec

    bench_model(MODEL_DIR.name, SmallModelSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                                               num_attention_heads=8, num_key_value_heads=4, seed=1))


def start_engines(redis_url: str, num_gpu_blocks: int) -> list[Any]:
    from tessera.engine.config import EngineConfig
    from tessera.engine.host import EngineHost

    config = EngineConfig.model_validate({
        "model": str(MODEL_DIR), "served_model_name": MODEL, "num_gpu_blocks_override": num_gpu_blocks,
        "max_model_len": 2048, "block_size": BLOCK, "speculative": None, "max_num_seqs": 16,
    })
    hosts = [EngineHost(config, redis_url) for _ in range(NUM_ENGINES)]
    errors: list[BaseException] = []

    def start(host: Any) -> None:
        try:
            host.start()
        except BaseException as exc:  # re-raised below, after every thread ends
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for host in hosts:
            host.stop()
        raise errors[0]
    return hosts


def on_engine_loop(host: Any, coro: Any, timeout_s: float = 60.0) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, host._loop).result(timeout_s)


async def generate(session: Any, url: str, prompt: list[int], salt: str | None = None,
                   max_tokens: int = 1, prefill_tokens: int = 0,
                   on_first: Callable[[], None] | None = None) -> tuple[float | None, dict[str, Any]]:
    """One ``/generate`` call; ``prefill_tokens`` declared as the gateway declares it (gateway/request/call.py),
    ``on_first`` called at the first token."""
    import orjson

    body = {"request_id": f"b-{time.monotonic_ns()}", "prompt_token_ids": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "cache_salt": salt, "prefill_tokens": prefill_tokens}
    data = orjson.dumps(body)
    async with session.post(f"{url}/generate", data=data, headers=signed_headers("POST", "/generate", data)) as resp:
        assert resp.status == 200, await resp.text()
        stream = await read_generate_stream(resp.content, on_first)
    if stream.error is not None:
        raise RuntimeError(stream.error)
    return stream.first_token_s, stream.stats


async def measure_prefill(hosts: list[Any]) -> float:
    """Median engine-measured prefill of a unique 1,000-token prompt on an idle engine."""
    import aiohttp

    rng = random.Random(1)
    samples = []
    async with aiohttp.ClientSession() as session:
        for host in hosts:
            await generate(session, host.url, [rng.randrange(10, 700) for _ in range(300)])  # warm-up
            for _ in range(3):
                _, stats = await generate(session, host.url, [rng.randrange(10, 700) for _ in range(1000)])
                samples.append(stats["prefill_s"])
    return statistics.median(samples)


async def reset_caches(hosts: list[Any], redis_url: str) -> None:
    import aiohttp

    from tessera.redis_conn import connect
    from tessera.routing.prefix_index import PrefixIndex

    for host in hosts:
        assert on_engine_loop(host, host.engine.reset_prefix_cache()), "reset_prefix_cache refused"
    # vLLM publishes KV events after an engine step, so AllBlocksCleared goes out with the next request:
    # give each engine one shorter than a block (it stores nothing).
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(generate(session, h.url, list(range(10, 10 + BLOCK // 2))) for h in hosts))
    redis = connect(redis_url, timeout_s=5.0)
    try:
        index = PrefixIndex(redis)
        deadline = time.monotonic() + 20
        while any([await index.blocks_of(h.engine_id) for h in hosts]):
            assert time.monotonic() < deadline, "AllBlocksCleared did not empty the index"
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()
    await asyncio.sleep(2.5)  # heartbeats catch up with the idle fleet


# ---- one policy -------------------------------------------------------------------------------------------


async def run_policy(name: str, requests: list[SimRequestSpec], redis_url: str) -> list[Outcome]:
    import aiohttp

    from tessera.redis_conn import connect
    from tessera.routing.prefix_index import PrefixIndex
    from tessera.routing.router import Router
    from tessera.routing.snapshot import RouteRequest

    redis = connect(redis_url, timeout_s=5.0)
    # Two gateway workers of one pod: their in-flight counts shared through the pod's table.
    held = contextlib.ExitStack()
    routers = [Router(redis, name, PrefixIndex(redis), pod=row) for row in held.enter_context(one_pod(GATEWAY_WORKERS))]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))

    async def one(req: SimRequestSpec, scheduled: float, start: float) -> Outcome:
        router = routers[req.worker]
        decision, records = await router.route(RouteRequest(req.tenant, MODEL, len(req.prompt), req.chain,
                                                            req.prefix_text, req.session_id, req.salt))
        engine_id = decision.ranked[0]
        prefill_tokens = decision.tokens_to_prefill(len(req.prompt))
        with router.in_flight(engine_id, prefill_tokens) as flight:
            first, stats = await generate(session, records[engine_id].url, req.prompt, req.salt, req.max_tokens,
                                          prefill_tokens, flight.prefilled)
        return Outcome(engine_id, decision.reason, (first or time.perf_counter()) - scheduled,
                       time.perf_counter() - start, int(stats.get("num_cached_tokens", 0)), len(req.prompt),
                       int(stats.get("num_output_tokens", 0)))

    try:
        return await replay(requests, one, lead_s=0.2)
    finally:
        for router in routers:
            await router.close()
        held.close()
        await session.close()
        await redis.aclose()


def run_policy_sim(name: str, requests: list[SimRequestSpec], setup: SimSetup) -> list[Outcome]:
    import routing_sim

    return list(routing_sim.run(setup, name, requests, MODEL))


def summarize(rounds: list[tuple[list[SimRequestSpec], list[Outcome]]], capacity_blocks: int) -> dict[str, Any]:
    """``capacity_blocks``: the fleet's KV blocks together (the fleet-LRU reference's capacity)."""
    outcomes = [o for _, outs in rounds for o in outs]
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached for o in outcomes)
    ideal = sum(r.ideal_cached for reqs, _ in rounds for r in reqs)
    fleet_lru = sum(sum(fleet_lru_cached_tokens([r.chain for r in reqs], [len(r.prompt) for r in reqs], BLOCK,
                                                capacity_blocks)) for reqs, _ in rounds)
    ttft = [o.ttft_s for o in outcomes]
    makespan = sum(max(o.done_s for o in outs) - reqs[0].arrival_s for reqs, outs in rounds)
    per_engine: dict[str, int] = {}
    for _, outs in rounds:
        for rank, (_, n) in enumerate(sorted(_per_engine(outs).items(), key=lambda kv: -kv[1])):
            per_engine[str(rank)] = per_engine.get(str(rank), 0) + n
    slowest = sorted(outcomes, key=lambda o: -o.ttft_s)[:5]
    return {
        "hit_rate": cached / prompt_tokens,
        "ideal_hit_rate": ideal / prompt_tokens,
        "share_of_ideal": cached / ideal if ideal else 0.0,
        "fleet_lru_hit_rate": fleet_lru / prompt_tokens,
        "share_of_fleet_lru": cached / fleet_lru if fleet_lru else 0.0,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
        "ttft_p99_ms_per_round": [percentile([o.ttft_s for o in outs], 99) * 1e3 for _, outs in rounds],
        "throughput_rps": len(outcomes) / makespan,
        "output_tokens_per_s": sum(o.output_tokens for o in outcomes) / makespan,
        "prefill_tokens_computed": prompt_tokens - cached,
        # Busiest engine first, summed over rounds (engine ids are the same, their roles are not).
        "requests_per_engine": list(per_engine.values()),
        "route_reasons": _reason_counts(outcomes),
        "slowest": [{"ttft_ms": round(o.ttft_s * 1e3), "cached": o.cached, "reason": o.reason} for o in slowest],
    }


def _per_engine(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.engine_id] = counts.get(o.engine_id, 0) + 1
    return counts


def _reason_counts(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        words = o.reason.split()
        kind = words[1].rstrip(":").split("=")[0] if len(words) > 1 else words[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# ---- the routing decision's own cost ----------------------------------------------------------------------


async def routing_cost(redis_url: str, num_engines: int = 64, num_blocks: int = 100_000) -> dict[str, Any]:
    from tessera.redis_conn import connect
    from tessera.registry import EngineRecord, EngineRegistry
    from tessera.routing.hashing import block_hash_chain
    from tessera.routing.policies import make_policy
    from tessera.routing.prefix_index import PrefixIndex
    from tessera.routing.router import Router
    from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot

    rng = random.Random(7)
    redis = connect(redis_url, timeout_s=5.0)
    registry, index = EngineRegistry(redis), PrefixIndex(redis)
    engine_ids = [f"cost-engine-{i:02d}" for i in range(num_engines)]
    records = [EngineRecord(e, f"http://10.0.0.{i}:8000", "bench-cost", BLOCK, 20_000, 4096,
                            num_running=rng.randrange(8), num_waiting=rng.randrange(3),
                            kv_cache_usage=rng.random()) for i, e in enumerate(engine_ids)]

    async def heartbeat() -> None:
        for record in records:
            await registry.heartbeat(record)

    chains = [tuple(rng.getrandbits(64) for _ in range(32)) for _ in range(num_blocks // 32)]
    ops: dict[str, list[tuple[str, int]]] = {e: [] for e in engine_ids}
    for chain in chains:  # each prompt prefix cached on one or two engines
        for engine_id in rng.sample(engine_ids, rng.choice((1, 1, 2))):
            ops[engine_id] += [("store", h) for h in chain]
    for engine_id, engine_ops in ops.items():
        for i in range(0, len(engine_ops), 5000):
            await index.apply(engine_id, engine_ops[i:i + 5000])
    await heartbeat()

    def request() -> RouteRequest:
        if rng.random() < 0.5:  # a hit: a stored prefix, sometimes only its first part, plus a new tail
            chain = rng.choice(chains)[:rng.choice((8, 16, 32))] + tuple(rng.getrandbits(64) for _ in range(4))
        else:
            chain = tuple(rng.getrandbits(64) for _ in range(36))
        return RouteRequest("t", "bench-cost", len(chain) * BLOCK, chain)

    router = Router(redis, "prefix_affinity", index)
    route_us, lookup_us = [], []
    for _ in range(200):
        await router.route(request())
    for _ in range(8):
        await heartbeat()  # the registry expires records that stop heartbeating (outside the timing)
        for _ in range(500):
            req = request()
            t = time.perf_counter_ns()
            await router.route(req)
            route_us.append((time.perf_counter_ns() - t) / 1e3)
            t = time.perf_counter_ns()
            await index.longest_prefixes(req.block_hashes, engine_ids)
            lookup_us.append((time.perf_counter_ns() - t) / 1e3)

    policy = make_policy("prefix_affinity")
    views = tuple(EngineView(r.engine_id, r.url, r.num_running, r.num_waiting, r.kv_cache_usage, r.num_gpu_blocks,
                             r.block_size) for r in records)
    policy_us = []
    for _ in range(4000):
        snap, req = RouteSnapshot(views, {rng.choice(engine_ids): rng.randrange(1, 33)}), request()
        t = time.perf_counter_ns()
        policy(snap, req)
        policy_us.append((time.perf_counter_ns() - t) / 1e3)
    prompt = [rng.randrange(10, 700) for _ in range(1000)]
    hash_us = []
    for _ in range(500):
        t = time.perf_counter_ns()
        block_hash_chain(prompt, BLOCK, "salt")
        hash_us.append((time.perf_counter_ns() - t) / 1e3)

    for engine_id in engine_ids:
        await index.clear_engine(engine_id)
        await registry.deregister(engine_id)
    await redis.aclose()

    def pct(values: list[float]) -> dict[str, float]:
        return {"p50_us": percentile(values, 50), "p99_us": percentile(values, 99)}

    return {"num_engines": num_engines, "num_indexed_blocks": len(chains) * 32, "route": pct(route_us),
            "index_lookup": pct(lookup_us), "policy_only": pct(policy_us), "hash_chain_1000_tokens": pct(hash_us)}


# ---- main -------------------------------------------------------------------------------------------------


def goals(policies: dict[str, dict[str, Any]]) -> dict[str, bool]:
    pa, rr, ap = policies["prefix_affinity"], policies["round_robin"], policies["approx_prefix"]
    return {
        "prefix_affinity_at_least_90pct_of_ideal": pa["share_of_ideal"] >= 0.9,
        # Not the goal: the same share of the fleet's LRU, the reach where the fleet holds too little.
        "prefix_affinity_at_least_90pct_of_fleet_lru": pa["share_of_fleet_lru"] >= 0.9,
        "prefix_affinity_p99_at_most_half_round_robin": pa["ttft_p99_ms"] <= 0.5 * rr["ttft_p99_ms"],
        "prefix_affinity_beats_approx_hit_rate": pa["hit_rate"] > ap["hit_rate"],
        "prefix_affinity_beats_approx_p99": pa["ttft_p99_ms"] < ap["ttft_p99_ms"],
    }


def print_regime(name: str, regime: dict[str, Any]) -> None:
    setup = regime["setup"]
    runs = "seeded sequences" if setup["backend"] == "sim" else "rounds"
    print(f"\n== {name} ({setup['backend']}): Poisson {setup['rate_per_s']:.2f}/s "
          f"({setup['load_factor']}x cold capacity {setup['cold_capacity_rps']:.2f}/s), {setup['engines']} engines x "
          f"{setup['kv_blocks']} KV blocks of {BLOCK} ({setup['kv_share_of_working_set']:.0%} of the system "
          f"prompts each), {setup['rounds']} {runs} x {setup['requests']} requests")
    head = f"{'policy':<17}{'hit rate':>9}{'ideal':>7}{'of ideal':>9}{'fleet LRU':>10}{'of LRU':>7}{'TTFT p50':>10}" \
           f"{'TTFT p99':>10}{'req/s':>7}{'prefill tok':>12}  per engine"
    print(head)
    print("-" * len(head))
    for policy, s in regime["policies"].items():
        print(f"{policy:<17}{s['hit_rate']:>9.1%}{s['ideal_hit_rate']:>7.1%}{s['share_of_ideal']:>9.1%}"
              f"{s['fleet_lru_hit_rate']:>10.1%}{s['share_of_fleet_lru']:>7.1%}{s['ttft_p50_ms']:>8.0f}ms{s['ttft_p99_ms']:>8.0f}ms{s['throughput_rps']:>7.2f}"
              f"{s['prefill_tokens_computed']:>12}  {s['requests_per_engine']}")
    print("goals:", json.dumps(regime["goals"]))


def print_cost(cost: dict[str, Any]) -> None:
    print(f"\nrouting decision, {cost['num_engines']} engines, {cost['num_indexed_blocks']:,} indexed blocks:")
    for key in ("route", "index_lookup", "policy_only", "hash_chain_1000_tokens"):
        print(f"  {key:<24} p50 {cost[key]['p50_us']:8.1f} us   p99 {cost[key]['p99_us']:8.1f} us")


def regime_setup(regime: Regime, backend: str, cold_rps: float, rounds: int, requests: int,
                 num_engines: int = NUM_ENGINES, workload: WorkloadSpec = WORKLOAD) -> dict[str, Any]:
    # An engine's cache against its share of the system prompts at 3 engines (a scaled fleet keeps it).
    per_engine_set = workload.working_set_tokens * NUM_ENGINES / num_engines
    return {"backend": backend, "load": regime.load, "kv": regime.kv, "rate_per_s": regime.rate_per_s,
            "load_factor": LOAD_FACTORS[regime.load], "cold_capacity_rps": cold_rps, "kv_blocks": regime.kv_blocks,
            "kv_share_of_working_set": min(1.0, (regime.kv_blocks - 1) * BLOCK / per_engine_set),
            "rounds": rounds, "requests": requests, "engines": num_engines, "system_prompts":
                workload.tenants * workload.prompts_per_tenant}


def cold_capacity_rps(prefill_1000_s: float, num_parallel: int) -> float:
    """Requests/s the fleet serves when nothing is cached: each prefills a whole prompt."""
    return num_parallel / (prefill_1000_s * WORKLOAD.mean_prompt_tokens / 1000)


def make_regimes(names: list[tuple[str, str]], cold_rps: float) -> list[Regime]:
    return [Regime(load, kv, LOAD_FACTORS[load] * cold_rps, KV_LEVELS[kv]) for load, kv in names]


async def run_regime_engines(hosts: list[Any], redis_url: str, regime: Regime, requests: list[SimRequestSpec],
                             rounds: int) -> dict[str, dict[str, Any]]:
    results: dict[str, list[tuple[list[SimRequestSpec], list[Outcome]]]] = {name: [] for name in POLICIES}
    for round_index in range(rounds):
        for name in POLICIES if round_index % 2 == 0 else POLICIES[::-1]:
            await reset_caches(hosts, redis_url)
            t = time.monotonic()
            outcomes = await run_policy(name, requests, redis_url)
            results[name].append((requests, outcomes))
            _progress(regime, round_index, name, [(requests, outcomes)], time.monotonic() - t, len(hosts))
    return {name: summarize(results[name], fleet_blocks(regime, len(hosts))) for name in POLICIES}


def run_regime_sim(regime: Regime, num_requests: int, num_sequences: int, setup: SimSetup,
                   workload: WorkloadSpec = WORKLOAD) -> dict[str, dict[str, Any]]:
    """Virtual time is cheap: each policy runs ``num_sequences`` seeded sequences (not replays of one), and
    the figures pool them, so a p99 is not one unlucky request."""
    sim = SimSetup(**{**asdict(setup), "step_costs": setup.step_costs, "num_gpu_blocks": regime.kv_blocks})
    sequences = [make_workload(replace(workload, seed=workload.seed + k), num_requests, regime.rate_per_s)
                 for k in range(num_sequences)]
    results = {}
    for name in POLICIES:
        t = time.monotonic()
        rounds = [(requests, run_policy_sim(name, requests, sim)) for requests in sequences]
        _progress(regime, 0, name, rounds, time.monotonic() - t, sim.num_engines)
        results[name] = summarize(rounds, fleet_blocks(regime, sim.num_engines))
    return results


def fleet_blocks(regime: Regime, num_engines: int) -> int:
    """The fleet's KV blocks together, each engine's less the null block vLLM's pool keeps (the fleet-LRU
    reference's capacity)."""
    return num_engines * (regime.kv_blocks - 1)


def _progress(regime: Regime, round_index: int, name: str, rounds: list[tuple[list[SimRequestSpec], list[Outcome]]],
              wall_s: float, num_engines: int) -> None:
    s = summarize(rounds, fleet_blocks(regime, num_engines))
    print(f"  {regime.name:<18} round {round_index + 1} {name:<17} hit {s['hit_rate']:.1%} "
          f"(ideal {s['ideal_hit_rate']:.1%})  TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms  "
          f"[{wall_s:.0f} s]", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("engines", "sim"), default="engines",
                        help="real vLLM CPU engines (default) or the virtual-time simulated fleet")
    parser.add_argument("--regimes", default=",".join(f"{load}/{kv}" for load, kv in DEFAULT_REGIMES),
                        help=f"comma-separated load/kv pairs; load in {sorted(LOAD_FACTORS)}, "
                             f"kv in {sorted(KV_LEVELS)}")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per regime (2: the second reversed)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests per regime and round (default {NUM_REQUESTS}; sim {SIM_REQUESTS})")
    parser.add_argument("--sim-sequences", type=int, default=None,
                        help=f"sim only: seeded sequences per regime, pooled (default {SIM_SEQUENCES}; "
                             f"{SIM_SEQUENCES_SCALED} with --sim-engines above {NUM_ENGINES})")
    parser.add_argument("--sim-engines", type=int, default=NUM_ENGINES,
                        help="sim only: engines in the fleet; the system prompts and requests scale with it "
                             f"(SYSTEM_PROMPTS_PER_ENGINE = {SYSTEM_PROMPTS_PER_ENGINE})")
    parser.add_argument("--step-costs", default="", help="sim only: MeasuredStepTime JSON (default: a slow CPU)")
    parser.add_argument("--no-cost", action="store_true", help="skip the routing decision's cost measurement")
    parser.add_argument("--no-prefill-clock", action="store_true",
                        help="sim only: the gateways' prefill clocks off (backlogs priced in tokens, as before the "
                             "prefill-time fit; routing/prefill_clock.py)")
    args = parser.parse_args(argv)
    pairs = []
    for item in args.regimes.split(","):
        load, _, kv = item.strip().partition("/")
        if load not in LOAD_FACTORS or kv not in KV_LEVELS:
            parser.error(f"unknown regime {item!r}; load in {sorted(LOAD_FACTORS)}, kv in {sorted(KV_LEVELS)}")
        pairs.append((load, kv))
    args.regime_pairs = pairs
    args.requests_set = args.requests is not None
    if args.requests is None:
        args.requests = NUM_REQUESTS
    if args.sim_sequences is None:
        args.sim_sequences = SIM_SEQUENCES if args.sim_engines <= NUM_ENGINES else SIM_SEQUENCES_SCALED
    if args.rounds < 1 or args.requests < 10 or args.sim_sequences < 1:
        parser.error("--rounds and --sim-sequences must be >= 1 and --requests >= 10")
    if args.no_prefill_clock and args.backend != "sim":
        parser.error("--no-prefill-clock is for --backend sim")
    if args.sim_engines != NUM_ENGINES and args.backend != "sim":
        parser.error(f"--sim-engines is for --backend sim (the real-engine run has {NUM_ENGINES} engines)")
    if not 1 <= args.sim_engines <= 1024:
        parser.error("--sim-engines must be 1-1024")
    return args


def main(argv: list[str] | None = None) -> None:
    stop_on_sigterm()
    args = parse_args(argv)
    os.environ.setdefault("TESSERA_TRACE_EXPORTER", "none")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Three engines share two cores: one OpenMP thread each, placed by the OS (vLLM's automatic binding
    # would pin every engine to the same core).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(REPO / "platform" / "src"))
    from tessera.redis_conn import EmbeddedRedis

    started = time.monotonic()
    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    regimes: dict[str, dict[str, Any]] = {}
    cost: dict[str, Any] | None = None
    extra: dict[str, Any] = {}
    redis = EmbeddedRedis().start()
    try:
        if args.backend == "sim":
            from tessera.engine.sim.step_time import MeasuredStepTime

            costs = MeasuredStepTime.model_validate_json(args.step_costs) if args.step_costs else SLOW_CPU_STEP_COSTS
            num_engines = args.sim_engines
            workload = scaled_workload(num_engines)
            setup = SimSetup(num_engines=num_engines, block_size=BLOCK, step_costs=costs, workers=GATEWAY_WORKERS,
                             prefill_clock=not args.no_prefill_clock)
            prefill_1000_s = costs.step_s + 1000 * costs.per_prefill_token_s
            cold_rps = cold_capacity_rps(prefill_1000_s, num_engines)  # simulated engines do not share cores
            extra = {"step_costs": costs.model_dump(), "prefill_1000_tokens_ms": prefill_1000_s * 1e3,
                     "prefill_clock": setup.prefill_clock,
                     "engines": num_engines, "workload": asdict(workload)}
            num_requests = args.requests if args.requests_set else SIM_REQUESTS * num_engines // NUM_ENGINES
            for regime in make_regimes(args.regime_pairs, cold_rps):
                policies = run_regime_sim(regime, num_requests, args.sim_sequences, setup, workload)
                regimes[regime.name] = {"setup": regime_setup(regime, "sim", cold_rps, args.sim_sequences,
                                                              num_requests, num_engines, workload),
                                        "policies": policies, "goals": goals(policies)}
        else:
            extra = run_engines(args, redis.url, regimes)
        if not args.no_cost:
            cost = asyncio.run(routing_cost(redis.url))
    finally:
        redis.stop()
    result = {
        "backend": args.backend,
        "setup": {"engines": NUM_ENGINES, "gateway_workers_simulated": GATEWAY_WORKERS, "block_size": BLOCK,
                  "workload": asdict(WORKLOAD), "kv_levels_blocks": KV_LEVELS, "load_factors": LOAD_FACTORS,
                  "engine_runtime": ("EngineHost in one process (vLLM CPU build)" if args.backend == "engines"
                                     else "routing_sim.py: simulated engines in virtual time"),
                  "model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 3}, **extra},
        "regimes": regimes,
        "routing_cost": cost,
        "wall_s": time.monotonic() - started,
        "machine": {"cpus": os.cpu_count(), "load_average_1m_before": load_before,
                    "load_average_1m_after": os.getloadavg()[0]},
    }
    path = RESULTS_SIM if args.backend == "sim" else RESULTS
    if args.backend == "sim" and args.sim_engines != NUM_ENGINES:
        path = path.with_name(f"routing-sim-{args.sim_engines}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    for name, regime_result in regimes.items():
        print_regime(name, regime_result)
    if cost is not None:
        print_cost(cost)
    machine = result["machine"]
    print(f"\nresults: {path}  ({result['wall_s']:.0f} s; {machine['cpus']} CPUs, load average "
          f"{machine['load_average_1m_before']:.1f} before, {machine['load_average_1m_after']:.1f} after)")


def run_engines(args: argparse.Namespace, redis_url: str, regimes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The regimes on real engines, restarted per KV level; returns what the result's setup adds."""
    from tokenizers import Tokenizer

    ensure_model()
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    workload = WorkloadSpec(block_size=BLOCK, workers=GATEWAY_WORKERS, vocab_size=tokenizer.get_vocab_size())
    prefill_1000_s: float | None = None
    cold_rps = 0.0
    for kv in dict.fromkeys(kv for _, kv in args.regime_pairs):
        t = time.monotonic()
        hosts = start_engines(redis_url, KV_LEVELS[kv])
        try:
            print(f"{NUM_ENGINES} engines with {KV_LEVELS[kv]} KV blocks up in {time.monotonic() - t:.0f} s",
                  flush=True)
            if prefill_1000_s is None:
                prefill_1000_s = asyncio.run(measure_prefill(hosts))
                # Three engines, one thread each, on the machine's cores.
                cold_rps = cold_capacity_rps(prefill_1000_s, min(NUM_ENGINES, os.cpu_count() or 1))
                print(f"prefill of a 1,000-token prompt: {prefill_1000_s * 1e3:.0f} ms (engine-measured); cold "
                      f"capacity {cold_rps:.2f} requests/s", flush=True)
            for regime in make_regimes([(load, k) for load, k in args.regime_pairs if k == kv], cold_rps):
                requests = make_workload(workload, args.requests, regime.rate_per_s, tokenizer.decode)
                policies = asyncio.run(run_regime_engines(hosts, redis_url, regime, requests, args.rounds))
                regimes[regime.name] = {"setup": regime_setup(regime, "engines", cold_rps, args.rounds, args.requests),
                                        "policies": policies, "goals": goals(policies)}
        finally:
            for host in hosts:
                host.stop()
    return {"prefill_1000_tokens_ms": (prefill_1000_s or 0.0) * 1e3}


if __name__ == "__main__":
    main()
