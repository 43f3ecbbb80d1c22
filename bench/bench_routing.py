"""Routing benchmark (`make bench-routing`): all five policies on one request sequence, real engines.

Setup: three ``EngineHost`` replicas in this process (each a real vLLM engine, CPU build, in its own engine
core process) serving a generated model large enough that prefilling 1,000 tokens takes >= 50 ms here,
with KV caches too small to hold every system prompt of the workload. The engines feed the Redis prefix
index from their own KV events, exactly as in production. Requests go through the gateway's routing path
in process — hash chain → ``Router.route`` (registry + one Redis lookup + policy) → stream from the chosen
replica's own ``/generate`` — with two router instances standing in for two gateway worker processes (the
``make run`` default), each with its own in-flight counts and, for the stateful baselines, its own memory.
Authentication and admission are left out: they cost the same under every policy.

Workload: several tenants, several long system prompts each (Zipf popularity), unique suffixes, Poisson
arrivals; the same seeded sequence for every policy. Engines' prefix caches are reset between policies
(AllBlocksCleared also empties their index entries), so each policy starts cold.

Measured: the engines' own ``num_cached_tokens`` against the workload's ideal (an unbounded cache on one
engine), TTFT p50/p99 from each request's scheduled arrival to its first token, throughput; and the
routing decision's own cost for 64 engines and 100,000 indexed blocks. Results: bench/results/routing.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import REPO, bench_model, signed_headers

MODEL_DIR = REPO / ".tessera" / "models" / "tessera-bench-routing"
RESULTS = REPO / "bench" / "results" / "routing.json"
MODEL = "bench-routing"
POLICIES = ["round_robin", "least_loaded", "session_affinity", "approx_prefix", "prefix_affinity"]

NUM_ENGINES = 3
NUM_GPU_BLOCKS = 200  # 6,400 tokens per engine: about 5 of the 12 system prompts, the fleet holds all
BLOCK = 32
NUM_TENANTS = 4
PROMPTS_PER_TENANT = 3
SYSTEM_TOKENS = 1024
SUFFIX_TOKENS = (32, 160)
USERS_PER_PROMPT = 4
MAX_TOKENS = 4
NUM_REQUESTS = 160  # per round
# Two rounds, the second in reverse policy order: a machine whose background load drifts (this one is
# shared) then weighs on every policy alike. Each round replays the same sequence from cold caches.
ROUNDS = 2
RATE_PER_S = 6.0
GATEWAY_WORKERS = 2
SEED = 2024


@dataclass(frozen=True)
class Request:
    arrival_s: float
    tenant: str
    salt: str
    prompt: list[int]
    prefix_text: str
    session_id: str
    worker: int
    ideal_cached: int


@dataclass
class Outcome:
    engine_id: str
    reason: str
    ttft_s: float
    done_s: float
    cached: int
    prompt_tokens: int
    output_tokens: int


# ---- setup ------------------------------------------------------------------------------------------------


def ensure_model() -> None:
    from tessera.engine.small_model import SmallModelSpec

    bench_model(MODEL_DIR.name, SmallModelSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                                               num_attention_heads=8, num_key_value_heads=4, seed=1))


def start_engines(redis_url: str) -> list[Any]:
    from tessera.engine.config import EngineConfig
    from tessera.engine.host import EngineHost

    config = EngineConfig.model_validate({
        "model": str(MODEL_DIR), "served_model_name": MODEL, "num_gpu_blocks_override": NUM_GPU_BLOCKS,
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
                   max_tokens: int = 1) -> tuple[float | None, dict[str, Any]]:
    import orjson

    body = {"request_id": f"b-{time.monotonic_ns()}", "prompt_token_ids": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "cache_salt": salt}
    first: float | None = None
    stats: dict[str, Any] = {}
    data = orjson.dumps(body)
    async with session.post(f"{url}/generate", data=data, headers=signed_headers("POST", "/generate", data)) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            message = orjson.loads(line)
            if "t" in message and first is None:
                first = time.perf_counter()
            elif message.get("done"):
                stats = message["stats"]
            elif "error" in message:
                raise RuntimeError(message["error"])
    return first, stats


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


# ---- workload ---------------------------------------------------------------------------------------------


def make_workload(tokenizer: Any) -> list[Request]:
    from tessera.routing.hashing import block_hash_chain

    rng = random.Random(SEED)
    vocab = tokenizer.get_vocab_size()
    systems = {(t, p): [rng.randrange(10, vocab) for _ in range(SYSTEM_TOKENS)]
               for t in range(NUM_TENANTS) for p in range(PROMPTS_PER_TENANT)}
    weights = [1 / (p + 1) for p in range(PROMPTS_PER_TENANT)]
    seen: set[int] = set()
    requests, clock = [], 0.0
    for _ in range(NUM_REQUESTS):
        clock += rng.expovariate(RATE_PER_S)
        tenant = rng.randrange(NUM_TENANTS)
        prompt_id = rng.choices(range(PROMPTS_PER_TENANT), weights)[0]
        prompt = systems[(tenant, prompt_id)] + [rng.randrange(10, vocab) for _ in range(rng.randint(*SUFFIX_TOKENS))]
        salt = f"salt-tenant-{tenant}"
        chain = block_hash_chain(prompt, BLOCK, salt)
        hits = next((i for i, h in enumerate(chain) if h not in seen), len(chain))
        seen.update(chain)
        requests.append(Request(
            arrival_s=clock, tenant=f"tenant-{tenant}", salt=salt, prompt=prompt,
            prefix_text=tokenizer.decode(prompt[:2048]), worker=rng.randrange(GATEWAY_WORKERS),
            session_id=f"tenant-{tenant}/app-{prompt_id}/user-{rng.randrange(USERS_PER_PROMPT)}",
            ideal_cached=min(hits * BLOCK, (len(prompt) - 1) // BLOCK * BLOCK),
        ))
    return requests


# ---- one policy -------------------------------------------------------------------------------------------


async def run_policy(name: str, requests: list[Request], redis_url: str) -> list[Outcome]:
    import aiohttp

    from tessera.redis_conn import connect
    from tessera.routing.hashing import block_hash_chain
    from tessera.routing.prefix_index import PrefixIndex
    from tessera.routing.router import Router
    from tessera.routing.snapshot import RouteRequest

    redis = connect(redis_url, timeout_s=5.0)
    routers = [Router(redis, name, PrefixIndex(redis)) for _ in range(GATEWAY_WORKERS)]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))
    start = time.perf_counter() + 0.2

    async def one(req: Request) -> Outcome:
        router = routers[req.worker]
        chain = block_hash_chain(req.prompt, BLOCK, req.salt)
        decision, records = await router.route(RouteRequest(req.tenant, MODEL, len(req.prompt), chain,
                                                            req.prefix_text, req.session_id))
        engine_id = decision.ranked[0]
        with router.in_flight(engine_id):
            first, stats = await generate(session, records[engine_id].url, req.prompt, req.salt, MAX_TOKENS)
        scheduled = start + req.arrival_s
        return Outcome(engine_id, decision.reason, (first or time.perf_counter()) - scheduled,
                       time.perf_counter() - start, int(stats.get("num_cached_tokens", 0)), len(req.prompt),
                       int(stats.get("num_output_tokens", 0)))

    tasks = []
    try:
        for req in requests:
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        return list(await asyncio.gather(*tasks))
    finally:
        await session.close()
        await redis.aclose()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(rounds: list[tuple[list[Request], list[Outcome]]]) -> dict[str, Any]:
    outcomes = [o for _, outs in rounds for o in outs]
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached for o in outcomes)
    ideal = sum(r.ideal_cached for reqs, _ in rounds for r in reqs)
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


def print_table(result: dict[str, Any]) -> None:
    print(f"\nprefill of a 1,000-token prompt (engine-measured, idle engine): "
          f"{result['prefill_1000_tokens_ms']:.0f} ms")
    print(f"{ROUNDS} rounds x {NUM_REQUESTS} requests, Poisson {RATE_PER_S}/s, {NUM_TENANTS} tenants x "
          f"{PROMPTS_PER_TENANT} system prompts of {SYSTEM_TOKENS} tokens, {NUM_ENGINES} engines x "
          f"{NUM_GPU_BLOCKS} KV blocks of {BLOCK}\n")
    head = f"{'policy':<17}{'hit rate':>9}{'ideal':>7}{'of ideal':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>7}" \
           f"{'prefill tok':>12}  per engine"
    print(head)
    print("-" * len(head))
    for name, s in result["policies"].items():
        print(f"{name:<17}{s['hit_rate']:>9.1%}{s['ideal_hit_rate']:>7.1%}{s['share_of_ideal']:>9.1%}"
              f"{s['ttft_p50_ms']:>8.0f}ms{s['ttft_p99_ms']:>8.0f}ms{s['throughput_rps']:>7.2f}"
              f"{s['prefill_tokens_computed']:>12}  {s['requests_per_engine']}")
    cost = result["routing_cost"]
    print(f"\nrouting decision, {cost['num_engines']} engines, {cost['num_indexed_blocks']:,} indexed blocks:")
    for key in ("route", "index_lookup", "policy_only", "hash_chain_1000_tokens"):
        print(f"  {key:<24} p50 {cost[key]['p50_us']:8.1f} us   p99 {cost[key]['p99_us']:8.1f} us")
    print("\ngoals:", json.dumps(result["goals"]))


def goals(policies: dict[str, dict[str, Any]]) -> dict[str, bool]:
    pa, rr, ap = policies["prefix_affinity"], policies["round_robin"], policies["approx_prefix"]
    return {
        "prefix_affinity_at_least_90pct_of_ideal": pa["share_of_ideal"] >= 0.9,
        "prefix_affinity_p99_at_most_half_round_robin": pa["ttft_p99_ms"] <= 0.5 * rr["ttft_p99_ms"],
        "prefix_affinity_beats_approx_hit_rate": pa["hit_rate"] > ap["hit_rate"],
        "prefix_affinity_beats_approx_p99": pa["ttft_p99_ms"] < ap["ttft_p99_ms"],
    }


async def run_all(hosts: list[Any], redis_url: str, requests: list[Request]) -> dict[str, dict[str, Any]]:
    rounds: dict[str, list[tuple[list[Request], list[Outcome]]]] = {name: [] for name in POLICIES}
    for round_index in range(ROUNDS):
        for name in POLICIES if round_index % 2 == 0 else POLICIES[::-1]:
            await reset_caches(hosts, redis_url)
            t = time.monotonic()
            outcomes = await run_policy(name, requests, redis_url)
            rounds[name].append((requests, outcomes))
            s = summarize([(requests, outcomes)])
            print(f"  round {round_index + 1} {name:<17} hit {s['hit_rate']:.1%} (ideal {s['ideal_hit_rate']:.1%})  "
                  f"TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms  [{time.monotonic() - t:.0f} s]",
                  flush=True)
    return {name: summarize(rounds[name]) for name in POLICIES}


def main() -> None:
    os.environ.setdefault("TESSERA_TRACE_EXPORTER", "none")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Three engines share two cores: one OpenMP thread each, placed by the OS (vLLM's automatic binding
    # would pin every engine to the same core).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(REPO / "platform" / "src"))
    from tokenizers import Tokenizer

    from tessera.redis_conn import EmbeddedRedis

    started = time.monotonic()
    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    ensure_model()
    redis = EmbeddedRedis().start()
    hosts: list[Any] = []
    try:
        hosts = start_engines(redis.url)
        print(f"{NUM_ENGINES} engines up in {time.monotonic() - started:.0f} s", flush=True)
        prefill_s = asyncio.run(measure_prefill(hosts))
        print(f"prefill of a 1,000-token prompt: {prefill_s * 1e3:.0f} ms (engine-measured)", flush=True)
        requests = make_workload(Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")))
        policies = asyncio.run(run_all(hosts, redis.url, requests))
        cost = asyncio.run(routing_cost(redis.url))
    finally:
        for host in hosts:
            host.stop()
        redis.stop()
    result = {
        "setup": {"engines": NUM_ENGINES, "engine_runtime": "EngineHost in one process (vLLM CPU build)",
                  "gateway_workers_simulated": GATEWAY_WORKERS, "kv_blocks_per_engine": NUM_GPU_BLOCKS,
                  "block_size": BLOCK, "tenants": NUM_TENANTS, "system_prompts_per_tenant": PROMPTS_PER_TENANT,
                  "system_prompt_tokens": SYSTEM_TOKENS, "suffix_tokens": list(SUFFIX_TOKENS),
                  "max_tokens": MAX_TOKENS, "requests_per_round": NUM_REQUESTS, "rounds": ROUNDS,
                  "poisson_rate_per_s": RATE_PER_S,
                  "model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 3}},
        "prefill_1000_tokens_ms": prefill_s * 1e3,
        "policies": policies,
        "routing_cost": cost,
        "goals": goals(policies),
        "wall_s": time.monotonic() - started,
        "machine": {"cpus": os.cpu_count(), "load_average_1m_before": load_before,
                    "load_average_1m_after": os.getloadavg()[0]},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print_table(result)
    machine = result["machine"]
    print(f"\nresults: {RESULTS}  ({result['wall_s']:.0f} s; {machine['cpus']} CPUs, load average "
          f"{machine['load_average_1m_before']:.1f} before, {machine['load_average_1m_after']:.1f} after)")


if __name__ == "__main__":
    main()
