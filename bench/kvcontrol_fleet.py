"""``bench_kvcontrol.py --engines N``: one KV-eviction controller process against N simulated engines.

The engines (bench/kvcontrol_fleet_runner.py, a process of their own) register in Redis and publish KV
events in vLLM's wire format on their own ZMQ PUB sockets; this process runs the real controller
(``KVController``: discovery from the registry, one control loop per engine subscribing to its events and
polling its /stats and /requests every 0.2 s, spans exported as configured, jsonl by default) and nothing
else, so its CPU time is the controller's. The fleet steps through ``--rates`` (per engine, ``--step`` s
each after a ``--warmup``). Reported per rate: events and batches published and applied per second, the
event-to-ledger lag p50/p99/max (each batch's publish ts to its ledger update, as
``tessera_kvcontrol_event_lag_seconds`` measures it), batches lost (sequence gaps), and the controller's
CPU (share of one core). It keeps up where it applies what was published, loses nothing, and its lag p99
stays under ``KEEPS_UP_LAG_P99_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import psutil
from _support import REPO, cpu_seconds, percentiles, print_table, write_results

from tessera_operators.kvcontrol.metrics import ControllerMetrics

MODEL = "sim-kvcontrol"
NUM_TENANTS = 8
# A controller whose lag p99 stays under this keeps up: its decisions act on a ledger at most this old.
KEEPS_UP_LAG_P99_S = 0.5


class SampledMetrics(ControllerMetrics):
    """The controller's metrics, plus every batch's apply time, lag and event count (for exact percentiles)."""

    def __init__(self) -> None:
        super().__init__()
        self.applied_at, self.lag_s, self.num_events = array("d"), array("d"), array("d")
        self.num_missed = 0
        self.rss_mib = 0.0
        self.cpu_s = 0.0  # the controller's CPU from the fleet's first batch until its last was applied
        self.ledger_blocks = 0

    def observe_batch(self, engine: str, num_events: int, lag_s: float) -> None:
        super().observe_batch(engine, num_events, lag_s)
        self.applied_at.append(time.time())
        self.lag_s.append(lag_s)
        self.num_events.append(num_events)


async def _tenant_salts(redis_url: str) -> list[str]:
    from tessera.redis_conn import connect
    from tessera.tenancy.store import TenantStore

    redis = connect(redis_url, timeout_s=5.0)
    try:
        store = TenantStore(redis)
        salts = []
        for i in range(NUM_TENANTS):
            name = f"fleet-tenant-{i}"
            tenant = await store.get_tenant(name) or await store.create_tenant(name)
            salts.append(tenant.cache_salt)
        return salts
    finally:
        await redis.aclose()


async def _control(args: argparse.Namespace, redis_url: str, work: Path, fleet: subprocess.Popen[bytes],
                   metrics: SampledMetrics) -> list[tuple[float, float]]:
    """Runs the controller until the fleet exits; returns (wall time, this process's CPU seconds) samples."""
    from tessera.telemetry.tracing import configure_tracing
    from tessera_operators.kvcontrol.controller import KVController
    from tessera_operators.kvcontrol.settings import KVControlSettings

    settings = KVControlSettings(redis_url=redis_url, kvcontrol_metrics_port=0, kvcontrol_model=MODEL,
                                 trace_dir=work / "traces")
    configure_tracing("tessera-kvcontrol", settings.trace_exporter, settings.trace_dir, settings.otlp_endpoint,
                      settings.trace_sample_ratio)
    controller = await KVController(settings, metrics).start()
    cpu: list[tuple[float, float]] = []
    try:
        deadline = time.monotonic() + 120
        while len(controller.loops) < args.engines:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller found {len(controller.loops)} of {args.engines} engines")
            await asyncio.sleep(0.2)
        print(f"[bench] controlling {len(controller.loops)} engines; fleet starts publishing", flush=True)
        (work / "go").touch()
        cpu_go = cpu_seconds(os.getpid())
        while fleet.poll() is None:
            cpu.append((time.time(), cpu_seconds(os.getpid())))
            await asyncio.sleep(0.5)
        # The backlog the fleet left is applied too: until no batch came for a second (at most 60 s).
        drained_by = time.monotonic() + 60
        while time.monotonic() < drained_by:
            seen = len(metrics.applied_at)
            await asyncio.sleep(1.0)
            if len(metrics.applied_at) == seen:
                break
        metrics.cpu_s = cpu_seconds(os.getpid()) - cpu_go
        metrics.num_missed = sum(loop.ledger.num_missed_batches for loop in controller.loops.values())
        metrics.ledger_blocks = sum(loop.ledger.num_blocks for loop in controller.loops.values())
        metrics.rss_mib = psutil.Process().memory_info().rss / 2**20
    finally:
        await asyncio.wait_for(controller.stop(), 60)
    return cpu


def _cpu_share(cpu: list[tuple[float, float]], start: float, end: float) -> float:
    inside = [(t, c) for t, c in cpu if start <= t <= end]
    if len(inside) < 2:
        return float("nan")
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    return (c1 - c0) / (t1 - t0)


def summarize(windows: list[dict[str, Any]], metrics: SampledMetrics, cpu: list[tuple[float, float]]
              ) -> list[dict[str, Any]]:
    rows = []
    for w in windows:
        if w["kind"] != "measured":
            continue
        start, end = w["start"], w["end"]
        seconds = end - start
        idx = [i for i, t in enumerate(metrics.applied_at) if start <= t <= end]
        lags = [metrics.lag_s[i] for i in idx]
        p50, p99 = percentiles(lags) if lags else (float("nan"), float("nan"))
        applied_events = sum(metrics.num_events[i] for i in idx)
        row = {
            "rate_per_engine": w["rate"], "seconds": seconds,
            "published_batches_per_s": w["published_batches"] / seconds,
            "published_events_per_s": w["published_events"] / seconds if w["published_events"] else None,
            "applied_batches_per_s": len(idx) / seconds, "applied_events_per_s": applied_events / seconds,
            "lag_p50_s": p50, "lag_p99_s": p99, "lag_max_s": max(lags) if lags else float("nan"),
            "controller_cpu_share": _cpu_share(cpu, start, end), "loadavg_1m": w.get("loadavg_1m"),
        }
        applied_share = row["applied_batches_per_s"] / max(1e-9, row["published_batches_per_s"])
        row["keeps_up"] = bool(applied_share >= 0.98 and p99 <= KEEPS_UP_LAG_P99_S)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> None:
    from tessera.redis_conn import EmbeddedRedis

    work = Path(tempfile.mkdtemp(prefix="bench-kvcontrol-fleet-"))
    redis = EmbeddedRedis().start()
    metrics = SampledMetrics()
    fleet: subprocess.Popen[bytes] | None = None
    try:
        salts = asyncio.run(_tenant_salts(redis.url))
        log = open(work / "fleet.log", "wb")  # noqa: SIM115 - closed with the process
        fleet = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "kvcontrol_fleet_runner.py"), "--engines", str(args.engines),
             "--redis-url", redis.url, "--source", args.source, "--rates", args.rates, "--warmup", str(args.warmup),
             "--step", str(args.step), "--salts", ",".join(salts), "--capacity-blocks", str(args.capacity_blocks),
             "--ready-file", str(work / "ready"),
             "--go-file", str(work / "go"), "--out", str(work / "windows.json")],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TESSERA_REDIS_URL": redis.url})
        deadline = time.monotonic() + 180
        while not (work / "ready").exists():
            if fleet.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not start: {(work / 'fleet.log').read_text()[-2000:]}")
            time.sleep(0.2)
        print(f"[bench] {args.engines} simulated engines up (load average {os.getloadavg()[0]:.1f})", flush=True)
        cpu = asyncio.run(_control(args, redis.url, work, fleet, metrics))
        if fleet.returncode != 0:
            raise RuntimeError(f"the fleet failed: {(work / 'fleet.log').read_text()[-2000:]}")
    finally:
        if fleet is not None and fleet.poll() is None:
            fleet.terminate()
            fleet.wait(timeout=30)
        redis.stop()
    windows = json.loads((work / "windows.json").read_text())
    rows = summarize(windows, metrics, cpu)
    # Capacity whatever the machine's contention: every event applied (warm-up, windows, the backlog) per
    # CPU-second the controller used meanwhile, its polls and ticks included (on a shared machine it may get
    # far less than a core; its lag then says so).
    cpu_s = metrics.cpu_s
    events_in = float(sum(metrics.num_events))
    capacity = events_in / cpu_s if cpu_s else float("nan")
    payload = {"benchmark": "kvcontrol_fleet", "engines": args.engines, "source": args.source,
               "rates": args.rates, "step_s": args.step, "warmup_s": args.warmup, "tenants": NUM_TENANTS,
               "poll_interval_s": 0.2, "keeps_up_lag_p99_s": KEEPS_UP_LAG_P99_S, "missed_batches": metrics.num_missed,
               "capacity_blocks_per_engine": args.capacity_blocks, "ledger_blocks_at_end": metrics.ledger_blocks,
               "controller_rss_mib_at_end": metrics.rss_mib, "controller_cpu_s": cpu_s,
               "events_applied_in_span": events_in, "events_per_controller_cpu_s": capacity,
               "windows": rows, "loadavg_end_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "work": str(work)}
    path = write_results(f"kvcontrol_fleet_{args.engines}_{args.source}", payload)
    unit = "batches/s" if args.source == "replay" else "requests/s"
    print_table([f"{unit} per engine", "published batches/s", "published events/s", "applied batches/s",
                 "applied events/s", "lag p50 ms", "lag p99 ms", "lag max ms", "controller CPU", "keeps up"],
                [[r["rate_per_engine"], r["published_batches_per_s"], r["published_events_per_s"] or "-",
                  r["applied_batches_per_s"], r["applied_events_per_s"], 1000 * r["lag_p50_s"],
                  1000 * r["lag_p99_s"], 1000 * r["lag_max_s"], f"{100 * r['controller_cpu_share']:.0f} %",
                  "yes" if r["keeps_up"] else "NO"] for r in rows])
    print(f"controller: {events_in:.0f} events applied in {cpu_s:.1f} CPU-s = {capacity:.0f} events per CPU-second; "
          f"RSS {metrics.rss_mib:.0f} MiB holding {metrics.ledger_blocks} ledger blocks")
    print(f"batches lost (sequence gaps): {metrics.num_missed}; load average at the end "
          f"{os.getloadavg()[0]:.1f}; results: {path}; logs and spans: {work}")
