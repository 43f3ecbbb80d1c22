"""The gateway worker's in-process prefix index (routing/local_index.py, local_feed.py) against issue #17's
goals: lookup of a 1,000-token prompt's chain, the whole ``Router`` decision at 64 engines / 100,000
blocks and 1,000 engines / 1,000,000 blocks, ingest in block events/s, bytes per indexed block, and the
event-to-visible lag through Redis's event stream. Writes bench/results/prefix_index.json and prints a
table with the goals. ``make bench-prefix-index``.

Setup: block size 16 (vLLM's default; a 1,000-token prompt is a 62-block chain); the index holds prompt
prefixes of 64 blocks, each cached on one or two engines at random; half the routed requests hit a stored
prefix (all of it, or its first 8, 16 or 32 blocks, plus new blocks), half miss. The Router reads a real
registry (embedded Redis) and answers lookups from its local index: it is the gateway's own code path
(``Router.route`` = plan + decide), minus admission, which costs the same with either index; its prefill clock
has a fit and a quarter of the engines a prompt awaiting its first token, so the decision prices waits in time as
a serving gateway's does (docs/routing.md policy rule 8). The table
splits the route into the index lookup, the policy, and the rest (``route_parts``), so a miss of the
route's goal names its cause, and prints how often the machine pauses a busy thread (``machine_pauses``), the
VM's share of a raw p99.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from _support import stop_on_sigterm

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing import pod_in_flight
from tessera.routing.local_feed import LocalIndexFeed
from tessera.routing.local_index import LocalPrefixIndex
from tessera.routing.pod_in_flight import PodInFlight
from tessera.routing.policies import make_policy
from tessera.routing.prefill_clock import MIN_SAMPLES
from tessera.routing.prefix_index import PrefixIndex, pack_hashes, unpack_hashes
from tessera.routing.router import Router, engine_view
from tessera.routing.snapshot import RouteRequest, RouteSnapshot
from tessera.telemetry.gc_heap import freeze_startup_heap

BLOCK = 16
CHAIN_BLOCKS = 64
PROMPT_TOKENS = 1000
GOALS = {"lookup_p99_us": 20.0, "route_p99_us_64": 50.0, "route_p99_us_1000": 200.0, "ingest_events_per_s": 200_000}
RESULTS = Path(__file__).parent / "results" / "prefix_index.json"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def trimmed_mean(values: list[float]) -> float:
    """The mean of all but the top 1 %."""
    kept = sorted(values)[:max(1, int(0.99 * len(values)))]
    return sum(kept) / len(kept)


def pct(values: list[float]) -> dict[str, float]:
    return {"p50_us": percentile(values, 50), "p99_us": percentile(values, 99)}


def fleet(rng: random.Random, num_engines: int, num_blocks: int) -> tuple[list[str], list[tuple[int, ...]],
                                                                           dict[str, list[int]]]:
    engine_ids = [f"bench-pi-{num_engines}-{i:04d}" for i in range(num_engines)]
    chains = [tuple(rng.getrandbits(64) for _ in range(CHAIN_BLOCKS)) for _ in range(num_blocks // CHAIN_BLOCKS)]
    held: dict[str, list[int]] = {e: [] for e in engine_ids}
    for chain in chains:
        for engine_id in rng.sample(engine_ids, rng.choice((1, 1, 2))):
            held[engine_id] += chain
    return engine_ids, chains, held


def fill(index: LocalPrefixIndex, held: dict[str, list[int]]) -> None:
    for engine_id, hashes in held.items():
        for i in range(0, len(hashes), 4096):
            part = hashes[i:i + 4096]
            index.apply(engine_id, "s" * len(part), part)


def bytes_per_block(num_engines: int, num_blocks: int) -> dict[str, float]:
    rng = random.Random(num_engines)
    _, _, held = fleet(rng, num_engines, num_blocks)
    gc.collect()
    tracemalloc.start()
    index = LocalPrefixIndex(num_blocks * 2)
    fill(index, held)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"num_engines": num_engines, "num_blocks": index.num_blocks, "bytes": size,
            "bytes_per_block": size / index.num_blocks}


def measure_ingest() -> dict[str, float]:
    """Block events/s through the feed's per-entry work: unpack the stream's hashes, apply in order. Batches
    of 16 events from 64 engines, 3 stores to 1 remove, into an index of 100,000 blocks."""
    rng = random.Random(7)
    index = LocalPrefixIndex(200_000)
    engine_ids, _, held = fleet(rng, 64, 100_000)
    fill(index, held)
    batches = []
    for _ in range(20_000):
        engine_id = rng.choice(engine_ids)
        ops = "".join(rng.choice("sssr") for _ in range(16))
        hashes = [rng.getrandbits(64) if op == "s" else rng.choice(held[engine_id]) for op in ops]
        batches.append((engine_id, ops, pack_hashes(hashes)))
    t = time.perf_counter()
    for engine_id, ops, packed in batches:
        index.apply(engine_id, ops, unpack_hashes(packed))
    elapsed = time.perf_counter() - t
    return {"events": 16 * len(batches), "seconds": elapsed, "events_per_s": 16 * len(batches) / elapsed}


def measure_lookup(index: LocalPrefixIndex, engine_ids: list[str], chains: list[tuple[int, ...]],
                   rng: random.Random) -> dict[str, Any]:
    """A 1,000-token prompt whose whole chain (62 blocks) is cached. Beside it, the floor any per-block walk
    in CPython pays (the index's lookup before it became a search): the same chains' 62 probes of a plain
    dict holding as many int keys (``list(map(dict.get, chain))``, nothing else), timed after the lookups.
    The search probes seven of those blocks, so it runs under that floor."""
    live = index.live_mask(engine_ids)
    num = PROMPT_TOKENS // BLOCK
    samples, floor = [], []
    for _ in range(20_000):
        chain = rng.choice(chains)[:num]
        t = time.perf_counter_ns()
        index.longest_prefixes(chain, live)
        samples.append((time.perf_counter_ns() - t) / 1e3)
    plain = dict.fromkeys([h for chain in chains for h in chain], 0)
    while len(plain) < index.num_blocks:
        plain[rng.getrandbits(64)] = 0
    probe = plain.get
    for _ in range(20_000):
        chain = rng.choice(chains)[:num]
        t = time.perf_counter_ns()
        list(map(probe, chain))
        floor.append((time.perf_counter_ns() - t) / 1e3)
    del plain
    return {**pct(samples), "dict_probes_only": pct(floor)}


async def measure_route(redis_url: str, num_engines: int, num_blocks: int, workers: int = 1) -> dict[str, Any]:
    """``workers``: 1, the router counts its own requests in flight (a one-worker gateway); 2, it reads them from
    a pod table with another worker's row holding as many, which sends a request and ends its oldest between each
    two of this worker's decisions (the chart's and ``tessera up``'s two workers a pod)."""
    rng = random.Random(num_engines * 31)
    engine_ids, chains, held = fleet(rng, num_engines, num_blocks)
    redis = connect(redis_url, timeout_s=5.0)
    registry = EngineRegistry(redis)
    model = f"bench-pi-{num_engines}"
    records = [EngineRecord(e, f"http://10.0.{i // 250}.{i % 250}:8000", model, BLOCK, 20_000, 4096,
                            num_running=rng.randrange(8), num_waiting=rng.randrange(3),
                            kv_cache_usage=rng.random()) for i, e in enumerate(engine_ids)]

    async def heartbeat() -> None:
        for record in records:
            await registry.heartbeat(record)

    await heartbeat()
    pods: list[PodInFlight] = []
    other_flights: list[str] = []
    if workers > 1:
        table = Path(tempfile.mkdtemp(prefix="bench-pi-pod-")) / "pod.table"
        pod_in_flight.create(table, workers)
        pods = [p for p in (PodInFlight.attach(table) for _ in range(workers)) if p is not None]
        for other in pods[1:]:  # the other workers' requests in flight, as many as this one's below
            for engine_id in rng.sample(engine_ids, num_engines // 4):
                other.add(engine_id, 1, 2_000)
                other_flights.append(engine_id)

    def other_worker_sends_and_ends() -> None:
        """Between two of this worker's decisions the other worker sends a request and its oldest one comes to
        its first token and ends, as at a steady load split evenly between the two: what this worker's next
        decision must see (untimed; the reading of it is in the decision)."""
        if len(pods) < 2:
            return
        other, engine_id = pods[1], rng.choice(engine_ids)
        other.add(engine_id, 1, 2_000, time.monotonic() + 20.0)  # as router.InFlight does
        other_flights.append(engine_id)
        oldest = other_flights.pop(0)
        other.add(oldest, 0, -2_000, time.monotonic() + 20.0)
        other.add(oldest, -1, 0)
    router = Router(redis, "prefix_affinity", PrefixIndex(redis), index_source="local",
                    local_index_max_blocks=2 * num_blocks, pod=pods[0] if pods else None)
    await router.start_local_index()
    feed = router.local_feed
    assert feed is not None
    fill(feed.index, held)
    lookup = measure_lookup(feed.index, engine_ids, chains, rng)
    # As in a gateway that has served a while: a prefill-time fit, and a prompt awaiting its first token on a
    # quarter of the engines (waits of ~20 s: they outlast the timing), so the routes price waits in time
    # (docs/routing.md policy rule 8: a hit's holder against the ranked engines, new prefixes by wait).
    clock = router.prefill_clock
    for i in range(MIN_SAMPLES):
        tokens = 100 + 50 * i
        clock.first_token("warm", clock.dispatch("warm", tokens, 0.0, isolated=True), 0.01 * tokens)
    flights = [router.in_flight(engine_id, 2_000) for engine_id in rng.sample(engine_ids, num_engines // 4)]
    for flight in flights:
        flight.__enter__()

    def request() -> RouteRequest:
        if rng.random() < 0.5:
            chain = rng.choice(chains)[:rng.choice((8, 16, 32, 62))] + tuple(rng.getrandbits(64) for _ in range(4))
        else:
            chain = tuple(rng.getrandbits(64) for _ in range(62))
        return RouteRequest("t", model, len(chain) * BLOCK + 3, chain)

    for _ in range(200):
        await router.route(request())
    # The measured requests are made before the timing, and kept: a gateway makes a request's chain and drops
    # it after the route, where a list of every request made during the timing grew the heap by ~7 MB of
    # tuples and ints (62-66 a chain), which filled the collector's older generations and fresh arenas under
    # the routes: the 64-engine p99 was 78-81 us with them made in the loop, 30-35 us made before it
    # (docs/routing.md, "Latest run").
    routed = [request() for _ in range(6 * 500)]
    # A gateway worker freezes its startup heap and raises its young generation's threshold once started
    # (gateway/lean_server.py, telemetry/gc_heap.py), so a collection walks only what it made since; this bench's
    # own scaffolding (the fleet's 100k-1M synthetic chains and the requests above, tuples a collection would walk)
    # is no gateway's, so the same call freezes it too, and the routes meet the collections a gateway's do.
    thresholds = gc.get_threshold()
    freeze_startup_heap()
    route_us: list[float] = []
    hits = 0
    for batch in range(6):
        await heartbeat()
        await router.num_live_engines()  # a fresh registry copy, outside the timing
        for req in routed[batch * 500:(batch + 1) * 500]:
            other_worker_sends_and_ends()
            t = time.perf_counter_ns()
            decision, _ = await router.route(req)
            route_us.append((time.perf_counter_ns() - t) / 1e3)
            hits += decision.expected_cached_tokens > 0
    parts = route_parts(feed.index, records, routed)
    # The same requests routed twice more: each one's best of the three times is the code's cost with the
    # machine's jitter (timer ticks, a neighbour's burst: on the 2-vCPU VM a decision's p99 is 2-3x its p50
    # even where each request's best time is flat) mostly taken out. Reported beside the raw p99, which the
    # goal is judged on.
    again: list[list[float]] = []
    for _ in range(2):
        times = []
        for req in routed:
            other_worker_sends_and_ends()
            t = time.perf_counter_ns()
            await router.route(req)
            times.append((time.perf_counter_ns() - t) / 1e3)
        again.append(times)
    best_of_3 = [min(first, *later) for first, *later in zip(route_us, *again, strict=True)]
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    for flight in flights:
        flight.__exit__(None, None, None)
    pages = huge_pages()  # while the index is alive
    await router.close()
    for pod in pods:
        pod.close()
    for engine_id in engine_ids:
        await registry.deregister(engine_id)
    await redis.aclose()
    return {"num_engines": num_engines, "workers": workers, "num_blocks": feed.index.num_blocks, "route": pct(route_us),
            "route_mean_us": trimmed_mean(route_us), "route_best_of_3": pct(best_of_3), "parts": parts,
            "credited_share": hits / len(route_us), "lookup_1000_tokens": lookup, "huge_pages": pages}


def route_parts(index: LocalPrefixIndex, records: list[EngineRecord], routed: list[RouteRequest]) -> dict[str, Any]:
    """Where a route's time goes, for the requests just routed: the index lookup alone and the policy alone
    (a fresh ``prefix_affinity`` instance over the same engines, cached prefixes and requests; its
    per-registry-read state is built before the timing, as the router's was). What the route costs beyond
    both (plan, registry copy, snapshot, awaits, and the cache misses a tight loop of one part does not
    see) is taken from the p50s, which a scheduler's pause of milliseconds on the shared machine leaves
    alone; the JSON also has means without each series' top 1 %."""
    live = index.live_mask(r.engine_id for r in records)
    lookup_us, cached = [], []
    for req in routed:
        t = time.perf_counter_ns()
        found = index.longest_prefixes(req.block_hashes, live)
        lookup_us.append((time.perf_counter_ns() - t) / 1e3)
        cached.append(found)
    policy = make_policy("prefix_affinity")
    views = tuple(engine_view(r) for r in records)
    policy(RouteSnapshot(views, {}, {}), routed[0])
    policy_us = []
    for req, found in zip(routed, cached, strict=True):
        snapshot = RouteSnapshot(views, found, {})
        t = time.perf_counter_ns()
        policy(snapshot, req)
        policy_us.append((time.perf_counter_ns() - t) / 1e3)
    return {"lookup": pct(lookup_us), "lookup_mean_us": trimmed_mean(lookup_us),
            "policy": pct(policy_us), "policy_mean_us": trimmed_mean(policy_us)}


def machine_pauses(seconds: float = 0.5, min_us: float = 5.0) -> dict[str, float]:
    """How often this machine takes the CPU away from a busy thread, and for how long: a loop reading the clock
    back to back for ``seconds``, each gap of at least ``min_us`` a pause (timer interrupts, the hypervisor). A
    route of p50 X µs meets one with a chance of about rate x X: on a 2-vCPU VM with ~1,300 pauses a second of
    10-20 µs, a 25 µs route 3 % of the time, so the raw p99 is the p50 plus a pause (docs/routing.md, "Latest
    run"); printed beside the routes so a reader can tell the VM's share from the code's."""
    clock = time.perf_counter_ns
    gaps: list[float] = []
    end = clock() + int(seconds * 1e9)
    last = clock()
    while last < end:
        now = clock()
        if now - last >= min_us * 1e3:
            gaps.append((now - last) / 1e3)
        last = now
    return {"pauses_per_s": len(gaps) / seconds, "pause_p50_us": percentile(gaps, 50) if gaps else 0.0,
            "pause_max_us": max(gaps, default=0.0)}


def huge_pages() -> dict[str, Any]:
    """Whether the process's heap sat in transparent huge pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
    puts the index's dict table there: fewer TLB misses per probe; docs/routing.md has both runs)."""
    anon_kib = 0
    try:
        with open("/proc/self/smaps_rollup") as smaps:
            for line in smaps:
                if line.startswith("AnonHugePages:"):
                    anon_kib = int(line.split()[1])
    except OSError:
        pass
    return {"glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "anon_huge_pages_mib": anon_kib / 1024}


async def measure_lag(redis_url: str) -> dict[str, Any]:
    """Engines' feeders write batches to Redis (as ``indexer.feed_index`` does, stamped with the publication
    time); a gateway's feed task follows the stream. Lag = publication to applied in the local index."""
    redis = connect(redis_url, timeout_s=5.0)
    store = PrefixIndex(redis)
    feed = LocalIndexFeed(redis, LocalPrefixIndex(1_000_000), store)
    task = asyncio.get_running_loop().create_task(feed.run())
    while not feed.ready:
        await asyncio.sleep(0.005)
    rng = random.Random(3)
    engine_ids = [f"bench-lag-{i:02d}" for i in range(16)]
    num_batches = 2000
    t0 = time.perf_counter()
    for i in range(num_batches):  # ~1,000 batches/s of 16 blocks, the engines' writes interleaved
        ops = [("store", rng.getrandbits(64)) for _ in range(16)]
        await store.apply(engine_ids[i % len(engine_ids)], ops, time.time())
        await asyncio.sleep(max(0.0, t0 + (i + 1) / 1000 - time.perf_counter()))
    while feed.num_entries < num_batches:
        await asyncio.sleep(0.01)
    lags = sorted(feed.lags_s)
    feed.stop()
    await task
    for engine_id in engine_ids:
        await store.clear_engine(engine_id)
    await redis.aclose()
    return {"num_batches": num_batches, "lag_p50_ms": 1e3 * percentile(lags, 50),
            "lag_p99_ms": 1e3 * percentile(lags, 99), "resyncs": feed.num_resyncs}


def print_table(result: dict[str, Any]) -> None:
    r64, r1k = result["route_64"], result["route_1000"]
    rows = []
    for r, fleet_name in ((r64, "64 engines / 100k blocks"), (r1k, "1,000 engines / 1M blocks")):
        lk = r["lookup_1000_tokens"]
        rows.append((f"lookup, 1,000-token chain (62 blocks, all cached), {fleet_name}",
                     f"p50 {lk['p50_us']:.1f} / p99 {lk['p99_us']:.1f} us", f"<= {GOALS['lookup_p99_us']:.0f} us",
                     lk["p99_us"] <= GOALS["lookup_p99_us"]))
        fl = lk["dict_probes_only"]
        rows.append(("  reference: a per-block walk's 62 probes of a plain dict of as many keys",
                     f"p50 {fl['p50_us']:.1f} / p99 {fl['p99_us']:.1f} us", "", None))
    for r, fleet_name, goal in ((r64, "64 engines / 100k blocks", "route_p99_us_64"),
                                (r1k, "1,000 engines / 1M blocks", "route_p99_us_1000")):
        parts = r["parts"]
        rows += [
            (f"whole Router decision, {fleet_name}",
             f"p50 {r['route']['p50_us']:.1f} / p99 {r['route']['p99_us']:.1f} us",
             f"<= {GOALS[goal]:.0f} us p99", r["route"]["p99_us"] <= GOALS[goal]),
            ("  each request's best of 3 routes (the machine's jitter mostly out)",
             f"p50 {r['route_best_of_3']['p50_us']:.1f} / p99 {r['route_best_of_3']['p99_us']:.1f} us", "", None),
            ("  of which the index lookup (these requests)",
             f"p50 {parts['lookup']['p50_us']:.1f} / p99 {parts['lookup']['p99_us']:.1f} us", "", None),
            ("  of which the prefix_affinity policy",
             f"p50 {parts['policy']['p50_us']:.1f} / p99 {parts['policy']['p99_us']:.1f} us", "", None),
            ("  the rest, ~ p50 route - p50 lookup - p50 policy (each alone, in a tight loop)",
             f"{r['route']['p50_us'] - parts['lookup']['p50_us'] - parts['policy']['p50_us']:.1f} us", "", None),
        ]
    for key, fleet_name, goal in (("route_64_pod", "64 engines", "route_p99_us_64"),
                                  ("route_1000_pod", "1,000 engines", "route_p99_us_1000")):
        r = result[key]
        rows += [(f"whole Router decision, {fleet_name}, two workers' pod table",
                  f"p50 {r['route']['p50_us']:.1f} / p99 {r['route']['p99_us']:.1f} us",
                  f"<= {GOALS[goal]:.0f} us p99", r["route"]["p99_us"] <= GOALS[goal]),
                 ("  each request's best of 3 routes",
                  f"p50 {r['route_best_of_3']['p50_us']:.1f} / p99 {r['route_best_of_3']['p99_us']:.1f} us", "", None)]
    pauses = result["machine_pauses"]
    rows.append(("the machine: a busy thread's pauses of >= 5 us a second, median / longest",
                 f"{pauses['pauses_per_s']:,.0f}/s, {pauses['pause_p50_us']:.0f} / {pauses['pause_max_us']:.0f} us",
                 "reported", None))
    rows += [
        ("ingest (unpack + apply), block events/s", f"{result['ingest']['events_per_s']:,.0f}",
         f">= {GOALS['ingest_events_per_s']:,}", result["ingest"]["events_per_s"] >= GOALS["ingest_events_per_s"]),
        ("event-to-visible lag through the stream", f"p50 {result['lag']['lag_p50_ms']:.2f} / "
         f"p99 {result['lag']['lag_p99_ms']:.2f} ms", "reported", None),
    ]
    rows += [(f"bytes per indexed block, {m['num_engines']} engines / {m['num_blocks']:,} blocks",
              f"{m['bytes_per_block']:.0f} B ({m['bytes'] / 2**20:.0f} MiB)", "reported", None)
             for m in result["memory"]]
    hp = r1k["huge_pages"]
    print(f"\nGLIBC_TUNABLES={hp['glibc_tunables']!r}, transparent huge pages at 1,000 engines: "
          f"{hp['anon_huge_pages_mib']:.0f} MiB")
    print(f"{'measure':<80}{'result':<30}{'goal':<18}met")
    print("-" * 132)
    for name, value, goal, met in rows:
        print(f"{name:<80}{value:<30}{goal:<18}{'' if met is None else ('yes' if met else 'NO')}")


async def main() -> None:
    stop_on_sigterm()
    server = EmbeddedRedis().start()
    try:
        result: dict[str, Any] = {"python": sys.version.split()[0]}
        result["ingest"] = measure_ingest()
        result["memory"] = [bytes_per_block(64, 100_000), bytes_per_block(1000, 1_000_000)]
        result["machine_pauses"] = machine_pauses()
        result["route_64"] = await measure_route(server.url, 64, 100_000)
        result["route_1000"] = await measure_route(server.url, 1000, 1_000_000)
        result["route_64_pod"] = await measure_route(server.url, 64, 100_000, workers=2)
        result["route_1000_pod"] = await measure_route(server.url, 1000, 1_000_000, workers=2)
        result["lag"] = await measure_lag(server.url)
    finally:
        server.stop()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


if __name__ == "__main__":
    asyncio.run(main())
