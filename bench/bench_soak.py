"""make bench-soak: is the platform flat over a long steady multi-tenant load? (issue #16)

Starts the local platform as ``tessera up`` does (bench/longrun/platform.py: embedded Redis with its AOF, one
CPU vLLM engine replica under Ray Serve, a 2-worker gateway, the KV-eviction controller), creates a few
tenants, stores twice the engine's KV cache with long distinct prompts (so the first window evicts as the
later ones do), and runs the project's load generator at a steady Poisson rate for ``SOAK_DURATION_S`` (default
1800 s) after a warm-up, in windows of ``SOAK_WINDOW_S`` (default 300 s). Every window meets the same
arrivals (the loadgen's ``arrival.period_s`` = the window, shifted by the warm-up; the prompts differ): a
window's p99 over a few hundred requests is set mostly by where the Poisson draw put its tightest bursts — two runs
with one seed had their slowest requests at the same seconds — so windows with independent draws differ by
the draw, and repeated arrivals leave only what changed in the platform. 4 requests a second by default (~1,240
a window, ~410 a tenant): at the 1.5 of earlier runs a window's p99 was its 5th slowest request and a tenant's
its 2nd, so one stall moved it by tens of percent. At each window's end it samples
the gateway's and the engine replica's RSS (their whole process trees), Redis's DBSIZE, used_memory and
connected_clients, and the gateway's open sockets; per window it reports p50/p99 TTFT (the user's view:
from the scheduled send), overall and per tenant (p95 and p99). bench/longrun/soak.py judges the goals (p99
within 1.2x of the first window's, each tenant's p95 too, RSS growth < 5 %, Redis keys bounded once the
per-request keys' TTLs have passed) and the bench prints PASS, FAIL or n/a per goal, each tenant's p99 ratio
beside them as a reading. Writes bench/results/soak.json.

Short run: ``SOAK_DURATION_S=240 SOAK_WINDOW_S=60 make bench-soak`` (or ``--duration-s``/``--window-s``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import bench_model, percentiles, print_table, stop_on_sigterm, write_results
from longrun import platform as plat
from longrun.load import cache_fill_workload, start_load, tenant_workload
from longrun.machine_speed import YardstickSampler, fixed_work_ms
from longrun.quiet_sample import quiet_sample_offset, window_arrivals
from longrun.sampling_noise import chance_of_failing_flat
from longrun.soak import P99_RATIO_LIMIT, WINDOW_HEADERS, Window, judge, readings, verdict_word, window_row

from tessera.engine.config import EngineConfig
from tessera_loadgen.runner import tenant_arrival_offsets
from tessera_loadgen.workload import Workload
from tests.support.machine import free_port

TENANTS = ("soak-a", "soak-b", "soak-c")
YARDSTICK_EVERY_S = 10.0  # ~30 probes a 5-minute window
KV_BLOCK_SIZE = EngineConfig.model_fields["block_size"].default  # what the local platform's engine runs
FILL_PROMPT_TOKENS = 896  # long enough to fill fast, short of the platform's max_model_len (1,024)
# From the bench choosing the load's t0 to its first arrival: the child's spawn, imports and prompt library
# (~2-3 s here). Late is harmless: arrivals due before the child is ready go at once, inside the warm-up.
LOAD_START_LEAD_S = 8.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=float(os.environ.get("SOAK_DURATION_S", 1800)),
                        help="Measured load, seconds (env SOAK_DURATION_S; default 1800).")
    parser.add_argument("--window-s", type=float, default=float(os.environ.get("SOAK_WINDOW_S", 300)),
                        help="Window length, seconds (env SOAK_WINDOW_S; default 300).")
    parser.add_argument("--warmup-s", type=float, default=float(os.environ.get("SOAK_WARMUP_S", 30)),
                        help="Load before the first window, not measured (env SOAK_WARMUP_S; default 30).")
    parser.add_argument("--rate-rps", type=float, default=float(os.environ.get("SOAK_RATE_RPS", 4.0)),
                        help="Requests per second, all tenants together (env SOAK_RATE_RPS; default 4).")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="Prompt length, the model's tokens.")
    parser.add_argument("--max-tokens", type=int, default=16, help="Tokens out per request (ignore_eos).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the load's schedule.")
    parser.add_argument("--kv-blocks", type=int, default=int(os.environ.get("SOAK_KV_BLOCKS", 1024)),
                        help="The engine's KV cache in blocks of 32 tokens (env SOAK_KV_BLOCKS; default 1024). "
                             "Small on purpose: the cache fills in the first minutes and then evicts as fast as it "
                             "stores, so the prefix index's keys (one per cached block) reach their bound "
                             "within the run instead of growing towards a capacity the run never fills.")
    parser.add_argument("--fill-cache", type=float, default=float(os.environ.get("SOAK_FILL_CACHE", 2.0)),
                        help="Before the warm-up, store this many times the KV cache's capacity with long "
                             "distinct prompts (env SOAK_FILL_CACHE; default 2; 0 skips it), so the first "
                             "window already evicts as the later ones do.")
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or args.window_s <= 0 or args.window_s > args.duration_s:
        parser.error("need 0 < window <= duration")
    return args


def soak_window_arrivals(workload: Workload, args: argparse.Namespace) -> list[float]:
    """Every tenant's arrivals in one window, seconds from its start (each window meets the same ones)."""
    offsets = [t for tenant in workload.tenants
               for t in itertools.takewhile(lambda t: t < args.window_s, tenant_arrival_offsets(workload, tenant))]
    return window_arrivals(offsets, period_s=args.window_s, warmup_s=args.warmup_s)


def sample(platform: Any, scrape_gc: plat.GcScraper, yardstick_ms: float | None = None) -> dict[str, Any]:
    """What the soak records at a window's sample; ``yardstick_ms``: the machine's yardstick over the window
    (longrun/machine_speed.py), one probe now where none is given."""
    stats = plat.redis_stats(platform.redis_url)
    gateway = plat.gateway_pid(platform)
    return {"gateway_rss_bytes": plat.rss_bytes([gateway]), "engine_rss_bytes": plat.rss_bytes(plat.replica_pids()),
            "redis_keys": stats.keys, "redis_used_memory_bytes": stats.used_memory_bytes,
            "redis_clients": stats.connected_clients, "gateway_sockets": plat.inet_sockets(gateway),
            "cpu_s": plat.component_cpu_s(platform), "gc": scrape_gc(),
            "redis_persistence": plat.redis_persistence(platform.redis_url),
            "yardstick_ms": fixed_work_ms() if yardstick_ms is None else yardstick_ms}


# What a sample holds beside a Window's fields (reported in tables of their own).
NOT_WINDOW_FIELDS = ("at_s", "cpu_s", "gc", "redis_persistence", "yardstick_ms")


def window_of(record: Any, t_measure: float, window_s: float) -> int:
    """The window a request was scheduled in (negative: the warm-up's time)."""
    return math.floor((record.t_sched - t_measure) / window_s)


def build_windows(records: list[Any], t_measure: float, window_s: float, samples: list[dict[str, Any]]) -> list[Window]:
    """One Window per sample: the requests scheduled in it (warm-up excluded), TTFT from the scheduled send;
    its ``end_s`` is when its sample was taken (``at_s``, in the window's last minute), else the window's end."""
    ttfts: dict[int, list[tuple[str, float]]] = {}
    counts: dict[int, list[int]] = {}
    for record in records:
        if record.warmup:
            continue
        index = window_of(record, t_measure, window_s)
        if not 0 <= index < len(samples):
            continue
        count = counts.setdefault(index, [0, 0])
        count[0] += 1
        if not record.ok:
            count[1] += 1
        elif record.t_first is not None:
            ttfts.setdefault(index, []).append((record.tenant, record.t_first - record.t_sched))
    windows = []
    for index, taken in enumerate(samples):
        values = ttfts.get(index, [])
        p50, p99 = percentiles([v for _, v in values])
        tenants = sorted({t for t, _ in values})
        per_tenant = {t: percentiles([v for name, v in values if name == t], (95, 99)) for t in tenants}
        num, failed = counts.get(index, [0, 0])
        windows.append(Window(index=index, end_s=taken.get("at_s", (index + 1) * window_s), num_requests=num,
                              num_failed=failed, ttft_p50_s=p50, ttft_p99_s=p99,
                              tenant_ttft_p95_s={t: p[0] for t, p in per_tenant.items()},
                              tenant_ttft_p99_s={t: p[1] for t, p in per_tenant.items()},
                              **{k: v for k, v in taken.items() if k not in NOT_WINDOW_FIELDS}))
    return windows


def flat_failure_chances(records: list[Any], t_measure: float, window_s: float, num_windows: int) -> dict[str, float]:
    """Per TTFT rule (the goals ``ttft_p99`` and ``ttft_p95[tenant]``, the readings ``ttft_p99[tenant]``): how often
    a run flat by construction fails it by sampling alone, each window drawn from the run's own TTFTs of that
    scope (longrun/sampling_noise.py)."""
    by_scope: dict[tuple[str, int], list[list[float]]] = {}  # (rule, its percentile) -> requests per window
    for record in records:
        index = window_of(record, t_measure, window_s)
        if record.warmup or not record.ok or record.t_first is None or not 0 <= index < num_windows:
            continue
        for scope in (("ttft_p99", 99), (f"ttft_p95[{record.tenant}]", 95), (f"ttft_p99[{record.tenant}]", 99)):
            by_scope.setdefault(scope, [[] for _ in range(num_windows)])[index].append(record.t_first - record.t_sched)
    chances = {}
    for (name, q), windows in by_scope.items():
        if num_windows >= 2 and all(windows):
            chances[name] = chance_of_failing_flat([v for w in windows for v in w],
                                                   window_sizes=[len(w) for w in windows], limit=P99_RATIO_LIMIT, q=q)
    return chances


CPU_PARTS = ("gateway", "engine", "kvcontrol", "redis", "ray_other", "client")


def cpu_rows(before: dict[str, Any], samples: list[dict[str, Any]], windows: list[Window]) -> list[list[Any]]:
    """Per window, each part's CPU milliseconds per request scheduled in it (the first window includes the
    warm-up's requests' CPU, so read it as an upper bound), then the machine's CPU seconds outside the platform
    (other work beside the bench) and stolen by the hypervisor, and the machine's yardstick (a fixed work's CPU
    time, the median of its probes through the window, as a multiple of the first window's:
    longrun/machine_speed.py): whether a slow window was the machine's."""
    rows, previous = [], before["cpu_s"]
    first_yardstick = samples[0].get("yardstick_ms") if samples else None
    for window, taken in zip(windows, samples, strict=True):
        now = taken["cpu_s"]
        per = max(window.num_requests, 1)
        ours = sum(now[p] - previous[p] for p in CPU_PARTS)
        outside_s = now.get("machine_busy", 0.0) - previous.get("machine_busy", 0.0) - ours
        steal_s = now.get("machine_steal", 0.0) - previous.get("machine_steal", 0.0)
        yardstick = taken.get("yardstick_ms")
        rows.append([window.index, *(f"{(now[p] - previous[p]) * 1000 / per:.1f}" for p in CPU_PARTS),
                     f"{max(outside_s, 0.0):.1f}", f"{steal_s:.1f}",
                     f"{yardstick:.2f} ({yardstick / first_yardstick:.2f}x)" if yardstick and first_yardstick else "–"])
        previous = now
    return rows


def gc_rows(before: dict[str, Any], samples: list[dict[str, Any]]) -> list[list[Any]]:
    """Per window and part, the garbage collector's full collections, their total milliseconds, and pauses of
    any generation over 50 ms (a pause stalls every request the process relays: tessera/telemetry/gc_heap.py)."""
    rows, previous = [], before["gc"]
    for index, taken in enumerate(samples):
        now = taken["gc"]
        cells = []
        for part in plat.GC_PARTS:
            if part not in now or part not in previous:
                cells.append("–")
                continue
            delta = {k: now[part][k] - previous[part][k] for k in ("full_collections", "full_collection_s",
                                                                   "long_pauses")}
            cells.append(f"{delta['full_collections']:.0f} / {delta['full_collection_s'] * 1000:.0f} ms / "
                         f"{delta['long_pauses']:.0f}")
        rows.append([index, *cells])
        previous = now
    return rows


def slowest(records: list[Any], t_measure: float, window_s: float, num: int = 8) -> dict[int, list[list[Any]]]:
    """Per window, its slowest requests by TTFT: [seconds into the run, tenant, TTFT ms] — clustered in one
    second, they were one stall of a process; spread out, the window's load."""
    by_window: dict[int, list[list[Any]]] = {}
    for record in records:
        if record.warmup or not record.ok or record.t_first is None:
            continue
        index = window_of(record, t_measure, window_s)
        by_window.setdefault(index, []).append([round(record.t_sched - t_measure, 2), record.tenant,
                                                round((record.t_first - record.t_sched) * 1000, 1)])
    return {index: sorted(rows, key=lambda row: -row[2])[:num] for index, rows in sorted(by_window.items())}


def fill_cache(platform: Any, keys: dict[str, str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Run the cache fill (``--fill-cache`` x the KV cache) and say what it took; the Redis key count
    before and after shows the prefix index reaching its bound before the first window."""
    keys_before = plat.redis_stats(platform.redis_url).keys
    if args.fill_cache <= 0:
        return {"requests": 0, "keys_before": keys_before}
    workload = cache_fill_workload(keys, kv_blocks=args.kv_blocks, block_size=KV_BLOCK_SIZE, times=args.fill_cache,
                                   prompt_tokens=FILL_PROMPT_TOKENS, seed=args.seed + 1)
    started = time.perf_counter()
    output = start_load(workload, platform.base_url, work / "cache-fill",
                        tokenizer_dir=bench_model("tessera-small")).result()
    # One token out of the small random model often decodes to no text, which the loadgen counts as an
    # empty answer; its prompt's blocks were stored all the same, so only other errors count as failed.
    failed = sum(1 for r in output.records if not r.ok and r.error_kind != "empty_output")
    done = {"requests": len(output.records), "failed": failed,
            "seconds": round(time.perf_counter() - started, 1), "keys_before": keys_before,
            "keys_after": plat.redis_stats(platform.redis_url).keys}
    print(f"  cache fill: {done}", flush=True)
    return done


def main() -> None:
    stop_on_sigterm()
    args = parse_args()
    num_windows = math.ceil(args.duration_s / args.window_s)
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    print(f"soak: {args.duration_s:g} s in {num_windows} windows of {args.window_s:g} s after {args.warmup_s:g} s "
          f"of warm-up, {args.rate_rps:g} req/s over {len(TENANTS)} tenants (logs in {work})", flush=True)
    platform = plat.start_platform(work, bench_model("tessera-small"), gateway_port=free_port(),
                                   kv_blocks=args.kv_blocks)
    samples: list[dict[str, Any]] = []
    try:
        keys = plat.create_tenants(platform, TENANTS)
        workload = tenant_workload(keys, rate_rps=args.rate_rps, duration_s=num_windows * args.window_s,
                                   prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                   request_timeout_s=120.0, seed=args.seed, name="soak", period_s=args.window_s)
        workload = workload.model_copy(update={"warmup_s": args.warmup_s})
        fill = fill_cache(platform, keys, args, work)
        scrape_gc = plat.GcScraper(platform)
        before = sample(platform, scrape_gc)
        # The schedule starts at a t0 the bench chooses, so it knows when every arrival falls and samples each
        # window in its widest gap near the end (longrun/quiet_sample.py), not beside requests in flight.
        t0 = time.perf_counter() + LOAD_START_LEAD_S
        sample_offset_s = quiet_sample_offset(soak_window_arrivals(workload, args), args.window_s)
        load = start_load(workload, platform.base_url, work / "loadgen", t0=t0)
        # From here this thread only sleeps and samples: at the lowest priority, so a sample's own CPU (psutil's
        # walks, the scrapes' parsing) waits for the platform's processes and the load generator's, started
        # before it at the normal one, instead of delaying the requests in flight.
        os.nice(19)
        # The machine's speed through each window, probed every few seconds (longrun/machine_speed.py).
        yardstick = YardstickSampler(YARDSTICK_EVERY_S).start()
        t_measure = t0 + args.warmup_s
        print(f"  each window sampled {sample_offset_s:.2f} s after its start", flush=True)
        for index in range(num_windows):
            due = t_measure + index * args.window_s + sample_offset_s
            while (left := due - time.perf_counter()) > 0:
                time.sleep(min(left, 5.0))
                if not load.is_alive():
                    break
            taken = {"at_s": round(time.perf_counter() - t_measure, 1),
                     **sample(platform, scrape_gc, yardstick.take())}
            samples.append(taken)
            print(f"  window {index + 1}/{num_windows}: {taken}", flush=True)
        yardstick.stop()
        scrape_gc.close()
        output = load.result()
        families = plat.key_families(platform.redis_url)
    finally:
        platform.stop()
    # The loadgen's t0 is its first arrival (the one chosen above); the windows count from the end of its warm-up.
    windows = build_windows(output.records, output.t0 + args.warmup_s, args.window_s, samples)
    verdicts = judge(windows)
    print()
    print_table(WINDOW_HEADERS, [window_row(w) for w in windows])
    tenants = sorted({t for w in windows for t in w.tenant_ttft_p99_s})
    print()
    print_table(["win", *(f"{t} p95 / p99 ms" for t in tenants)],
                [[w.index, *(f"{w.tenant_ttft_p95_s.get(t, math.nan) * 1000:.1f} / "
                             f"{w.tenant_ttft_p99_s.get(t, math.nan) * 1000:.1f}" for t in tenants)]
                 for w in windows])
    print()
    print("CPU ms per request, by part of the platform, per window (which part's cost grows):")
    print_table(["win", *CPU_PARTS, "not ours, CPU s", "VM steal, s", "yardstick ms (x first)"],
                cpu_rows(before, samples, windows))
    print()
    print("Garbage collector per window and part: full collections / their total / pauses over 50 ms; objects "
          "frozen at start: " + ", ".join(f"{part} {int(v['frozen_objects']):,}"
                                          for part, v in samples[-1]["gc"].items()))
    print_table(["win", *plat.GC_PARTS, "Redis forks (AOF rewrites)", "AOF MiB"],
                [[*row, taken["redis_persistence"]["total_forks"] - prior["redis_persistence"]["total_forks"],
                  f"{taken['redis_persistence']['aof_current_size'] / 2**20:.1f}"]
                 for row, taken, prior in zip(gc_rows(before, samples), samples, [before, *samples], strict=False)])
    slow = slowest(output.records, output.t0 + args.warmup_s, args.window_s)
    print()
    print("Slowest requests per window (seconds into the run, tenant, TTFT ms):")
    for index, rows in slow.items():
        print(f"  {index}: " + "; ".join(f"{at:.1f} s {tenant} {ms:.0f}" for at, tenant, ms in rows))
    print()
    print("Redis keys at the end, by family: " + ", ".join(f"{k} {n}" for k, n in families.items()))
    print()
    flat_fails = flat_failure_chances(output.records, output.t0 + args.warmup_s, args.window_s, num_windows)
    print_table(["goal", "verdict", "detail", "a flat run fails it"],
                [[v.goal, verdict_word(v.passed), v.detail,
                  f"{flat_fails[v.goal]:.0%}" if v.goal in flat_fails else ""] for v in verdicts])
    tenant_p99 = readings(windows)
    print()
    print("Read, not judged: each tenant's p99 against the same limit (its 4th-5th slowest request of a window; "
          "longrun/soak.py says why)")
    print_table(["reading", "within the limit", "detail", "a flat run exceeds it"],
                [[v.goal, verdict_word(v.passed), v.detail,
                  f"{flat_fails[v.goal]:.0%}" if v.goal in flat_fails else ""] for v in tenant_p99])
    path = write_results("soak", {
        "args": vars(args), "num_windows": num_windows, "cache_fill": fill, "before_load": before,
        "windows": [asdict(w) for w in windows], "samples": samples,
        "goals": [asdict(v) for v in verdicts], "readings": [asdict(v) for v in tenant_p99],
        "flat_run_failure_chance": flat_fails, "slowest_requests": slow,
        "redis_key_families_at_end": families,
        "loadgen_summary": output.result["summary"]["overall"] | {"latency": None},
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()}})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
