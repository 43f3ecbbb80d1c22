"""make bench-chaos: what do clients see, and what is billed, when parts of the platform die under load? (#16)

The local platform as ``tessera up`` starts it (bench/longrun/platform.py: embedded Redis with its AOF, one
CPU vLLM engine replica under Ray Serve, a 2-worker gateway, the KV-eviction controller), plus a second
gateway on the same Redis, both behind a round-robin TCP proxy (bench/longrun/proxy.py) that stands for the
chart's Service. A multi-tenant Poisson load of streamed chats runs through the proxy for ``CHAOS_DURATION_S``
(default 300 s); meanwhile a seeded schedule (``CHAOS_SEED``, bench/longrun/chaos.py) SIGKILLs once each:

- an engine replica (``--engines``, default 2): its Ray actor process (``ray::ServeReplica:tessera-engines:...``);
  Ray Serve starts a new one. A request the gateway sent to it that had not streamed yet is retried on the
  other replica; a stream it was serving continues there (the gateway's continuation). With one replica,
  nothing serves until the new one is up;
- the second gateway: its whole process group, as a container kill; it is started again on the same port and
  finish-journal directory after ``--restart-delay-s``, as Kubernetes restarts a container; meanwhile the proxy
  sends new connections to the first one. (Two gateways behind a Service is the chart's shape; a restart alone
  would turn every request of the restart's seconds into a refused connection, which says nothing new);
- the Redis primary (SIGKILL), started again on the same port and data directory (AOF, everysec) after
  ``--restart-delay-s``, as the chart's StatefulSet does.

Each request is then succeeded, failed with a clear error (status and error type, an error event, or a
connection the client's HTTP layer reports as cut), or lost (a hang, or a stream that ended cleanly short of
``max_tokens``), and attributed to the kill during it (classify). After the
load the bench waits for the settler to bill the dead gateway's requests, then compares per tenant the
completion tokens in Redis's usage with the tokens the clients received (bill: double-billed = charged more
than served + max_tokens - received of every request that did not succeed). Writes bench/results/chaos.json.

NOTE: the gateways run with a short lease (6 s), settle interval (1 s) and grace (3 s), so a killed gateway's
requests are billed within the bench's wait rather than after the defaults' 45 s; the mechanism is the same.
Short run: ``CHAOS_DURATION_S=120 make bench-chaos``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import BIN, bench_model, print_table, stop_on_sigterm, write_results
from longrun import platform as plat
from longrun.chaos import FAILED, LOST, SUCCEEDED, TARGETS, Kill, Outcome, bill, classify, schedule
from longrun.load import start_load, tenant_workload
from longrun.proxy import RoundRobinProxy

from tessera.gateway.launch import GatewayLaunch
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.tenancy.admission import Admission
from tests.support.machine import free_port

TENANTS = ("chaos-a", "chaos-b", "chaos-c")
SETTLING_ENV = {"TESSERA_LEASE_TTL_S": "6", "TESSERA_SETTLE_INTERVAL_S": "1", "TESSERA_SETTLE_GRACE_S": "3"}
SETTLE_WAIT_S = 30.0
# What a new engine replica took to serve here after its predecessor's SIGKILL (66 s on the shared 2-core
# machine): the schedule leaves that long after the engine's kill where the run is long enough.
ENGINE_RECOVERY_S = 75.0
REQUEST_TIMEOUT_S = 90.0  # a request still without its answer then counts as a hang


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=float(os.environ.get("CHAOS_DURATION_S", 300)),
                        help="Length of the load, seconds (env CHAOS_DURATION_S; default 300).")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("CHAOS_SEED", 0)),
                        help="Seed of the kill schedule and the load (env CHAOS_SEED; default 0).")
    parser.add_argument("--rate-rps", type=float, default=1.5, help="Requests per second, all tenants together.")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="Prompt length, the model's tokens.")
    parser.add_argument("--max-tokens", type=int, default=32, help="Tokens out per request (ignore_eos).")
    parser.add_argument("--engines", type=int, default=int(os.environ.get("CHAOS_ENGINES", 2)),
                        help="Engine replicas (env CHAOS_ENGINES; default 2, as a deployment that must survive "
                             "a replica's death runs): with two, a request sent to the killed replica before "
                             "it left the registry is retried on the other one; with one, nothing serves "
                             "until Ray Serve's replacement is up.")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS, help="What to kill.")
    parser.add_argument("--restart-delay-s", type=float, default=2.0,
                        help="A killed gateway or Redis is started again after this many seconds.")
    return parser.parse_args(argv)


class Gateway:
    """The second gateway: a fixed port and finish-journal directory, so a restart is the same pod again."""

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.work = work
        self.proc: subprocess.Popen[bytes] | None = None
        self.num_starts = 0

    def start(self) -> None:
        self.num_starts += 1
        cmd = GatewayLaunch(port=self.port, workers=2, metrics_dir=self.work / "gateway-2-metrics").command(
            str(BIN / "python"))
        env = {**os.environ, "TESSERA_FINISH_JOURNAL_DIR": str(self.work / "gateway-2-journal")}
        log = (self.work / "gateway-2.log").open("ab")
        # In this session, beside the engine (see tests/support/gateways.py on autogroup starvation).
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)

    def healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200
        return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class Chaos:
    def __init__(self, args: argparse.Namespace, platform: Any, gateway: Gateway) -> None:
        self.args = args
        self.platform = platform
        self.gateway = gateway
        self.events: list[dict[str, Any]] = []
        self.orphans: list[int] = []
        self.started = 0.0  # perf_counter at the start of the load

    def kill(self, target: str, at_s: float) -> dict[str, Any]:
        event: dict[str, Any] = {"target": target, "at_s": round(at_s, 3)}
        if target == "engine":
            pids = plat.replica_pids()
            if not pids:
                return event | {"skipped": "no engine replica process found"}
            replica = psutil.Process(pids[0])
            self.orphans = [p.pid for p in replica.children(recursive=True)]
            registered = [e.engine_id for e in self.platform.engines()]
            replica.kill()
            event |= {"pid": pids[0], "children": self.orphans, "registered": registered}
        elif target == "gateway":
            assert self.gateway.proc is not None
            event["pid"] = self.gateway.proc.pid
            self.gateway.kill()
            time.sleep(self.args.restart_delay_s)
            self.gateway.start()
        elif target == "redis":
            redis = self.platform.redis
            assert redis is not None
            port = redis.port
            event["port"] = port
            redis.kill()
            time.sleep(self.args.restart_delay_s)
            self.platform.redis = EmbeddedRedis(port=port, data_dir=self.platform.redis_data_dir).start()
        return event

    def recovered(self, target: str, event: dict[str, Any]) -> bool:
        if target == "engine":
            # Back once a replica registered that was not there at the kill (the dead one's record may linger).
            old = set(event.get("registered", []))
            return any(e.engine_id not in old for e in self.platform.engines())
        if target == "gateway":
            return self.gateway.healthy()
        with contextlib.suppress(Exception):
            return plat.redis_stats(self.platform.redis_url).keys > 0
        return False


def run_kills(chaos: Chaos, kills: list[Kill], started: float, load: Any) -> None:
    """Kills on schedule; between them, notes when each killed part is back (seconds after its kill)."""
    pending: list[tuple[str, dict[str, Any]]] = []
    queue = list(kills)
    while load.is_alive():
        now = time.perf_counter() - started
        if queue and now >= queue[0].at_s:
            kill = queue.pop(0)
            event = chaos.kill(kill.target, now)
            print(f"  {now:7.1f} s: killed {kill.target} {event}", flush=True)
            chaos.events.append(event)
            pending.append((kill.target, event))
        for target, event in list(pending):
            with contextlib.suppress(Exception):
                if chaos.recovered(target, event):
                    event["back_after_s"] = round(time.perf_counter() - started - event["at_s"], 1)
                    print(f"  {target} back {event['back_after_s']} s after its kill", flush=True)
                    pending.remove((target, event))
        time.sleep(0.5)


def outcome_of(record: Any, t0: float) -> Outcome:
    if record.ok:
        received = record.n_out or 0
    elif record.chunk_tokens is not None:
        received = sum(record.chunk_tokens)
    else:
        received = len(record.chunk_times)
    send, end = record.t_send_first, record.t_done
    return Outcome(ok=record.ok, error_kind=record.error_kind, http_status=record.http_status,
                   t_send_s=None if send is None else send - t0, t_done_s=None if end is None else end - t0,
                   tokens_received=received,
                   max_tokens=record.max_tokens, error_detail=record.error_detail)


async def read_usage(redis_url: str, tenants: list[str]) -> dict[str, dict[str, Any]]:
    client = connect(redis_url, timeout_s=5)
    try:
        admission = Admission(client)
        return {t: await admission.usage(t, "day") for t in tenants}
    finally:
        await client.aclose()


def settled_usage(redis_url: str, tenants: list[str]) -> dict[str, dict[str, Any]]:
    """The tenants' usage once it stopped changing for a settle pass or two (at most SETTLE_WAIT_S)."""
    deadline = time.monotonic() + SETTLE_WAIT_S
    last: dict[str, dict[str, Any]] = {}
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        usage = asyncio.run(read_usage(redis_url, tenants))
        if usage != last:
            last, stable_since = usage, time.monotonic()
        elif time.monotonic() - stable_since >= 12:  # lease 6 s + grace 3 s + a settle pass or two
            break
        time.sleep(1.0)
    return last


def main() -> None:
    stop_on_sigterm()
    args = parse_args()
    kills = schedule(args.seed, args.duration_s, args.targets, recovery_s={"engine": ENGINE_RECOVERY_S})
    work = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    print(f"chaos: {args.duration_s:g} s of {args.rate_rps:g} req/s over {len(TENANTS)} tenants; kills "
          + ", ".join(f"{k.target} at {k.at_s:.1f} s" for k in kills) + f" (logs in {work})", flush=True)
    os.environ.update(SETTLING_ENV)
    platform = plat.start_platform(work, bench_model("tessera-small"), gateway_port=free_port(),
                                   num_engines=args.engines, extra_env=SETTLING_ENV)
    gateway = Gateway(work)
    proxy: RoundRobinProxy | None = None
    chaos = Chaos(args, platform, gateway)
    try:
        gateway.start()
        deadline = time.monotonic() + 120
        while not gateway.healthy():
            if time.monotonic() > deadline or (gateway.proc is not None and gateway.proc.poll() is not None):
                raise RuntimeError(f"the second gateway did not start; see {work / 'gateway-2.log'}")
            time.sleep(0.5)
        proxy = RoundRobinProxy([platform.options.gateway_port, gateway.port]).start()
        keys = plat.create_tenants(platform, TENANTS)
        workload = tenant_workload(keys, rate_rps=args.rate_rps, duration_s=args.duration_s,
                                   prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                   request_timeout_s=REQUEST_TIMEOUT_S, seed=args.seed, name="chaos")
        chaos.started = time.perf_counter()
        load = start_load(workload, proxy.url, work / "loadgen")
        run_kills(chaos, kills, chaos.started, load)
        output = load.result()
        print("  load done; waiting for the settler", flush=True)
        usage = settled_usage(platform.redis_url, list(TENANTS))
    finally:
        if proxy is not None:
            proxy.stop()
        gateway.stop()
        platform.stop()
        for pid in chaos.orphans:  # vLLM children of the killed replica, if any outlived it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    report(args, kills, chaos, output, usage, proxy)


def report(args: argparse.Namespace, kills: list[Kill], chaos: Chaos, output: Any,
           usage: dict[str, dict[str, Any]], proxy: RoundRobinProxy | None) -> None:
    done = chaos.events
    # The kills' times count from the load's start; the records' from the loadgen's first arrival (t0).
    shift = output.t0 - chaos.started
    # A part not back by the end of the load counts as down until then.
    actual = [Kill(e["at_s"] - shift, e["target"], e.get("back_after_s", math.inf)) for e in done]
    outcomes: dict[str, list[Outcome]] = {t: [] for t in TENANTS}
    counts: Counter[tuple[str, str, str]] = Counter()
    for record in output.records:
        outcome = outcome_of(record, output.t0)
        outcomes[record.tenant].append(outcome)
        verdict = classify(outcome, actual)
        counts[(verdict.outcome, verdict.reason, verdict.killed or "-")] += 1
    totals = Counter({o: sum(n for (kind, _, _), n in counts.items() if kind == o) for o in (SUCCEEDED, FAILED, LOST)})
    bills = [bill(t, outcomes[t], int(usage[t]["completion_tokens"]), int(usage[t]["requests"])) for t in TENANTS]
    print()
    print_table(["target", "killed at s", "back after s"],
                [[e["target"], e["at_s"], e.get("back_after_s", "not seen")] for e in done])
    print()
    print_table(["sent", "succeeded", "failed (clear error)", "lost"],
                [[len(output.records), totals[SUCCEEDED], totals[FAILED], totals[LOST]]])
    print()
    print_table(["outcome", "reason", "during outage of", "requests"],
                [[*key, n] for key, n in sorted(counts.items())])
    print()
    print_table(["tenant", "tokens served", "tokens charged", "bound", "double-billed", "unbilled", "ok reqs",
                 "reqs in usage"],
                [[b.tenant, b.served_tokens, b.charged_tokens, b.bound_tokens, b.double_billed_tokens,
                  b.unbilled_tokens, b.served_requests, b.charged_requests] for b in bills])
    errors = Counter(f"{r.error_kind}: {r.error_detail[:100]}" for r in output.records if r.error_kind)
    print()
    print_table(["requests", "error (kind: the server's message)"], [[n, e] for e, n in errors.most_common(8)])
    goals = {"lost": totals[LOST] == 0, "double_billed": all(b.double_billed_tokens == 0 for b in bills)}
    print()
    print_table(["goal", "verdict"], [["0 lost", "PASS" if goals["lost"] else "FAIL"],
                                      ["0 double-billed", "PASS" if goals["double_billed"] else "FAIL"]])
    path = write_results("chaos", {
        "args": vars(args), "schedule": [asdict(k) for k in kills], "kills": done,
        "sent": len(output.records), "totals": dict(totals),
        "by_reason": [{"outcome": o, "reason": r, "during_kill_of": k, "requests": n}
                      for (o, r, k), n in sorted(counts.items())],
        "billing": [asdict(b) | {"double_billed_tokens": b.double_billed_tokens,
                                 "unbilled_tokens": b.unbilled_tokens} for b in bills],
        "usage": usage, "goals": goals, "errors": errors.most_common(20),
        "proxy_refused_connections": proxy.num_refused if proxy is not None else None,
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()}})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
