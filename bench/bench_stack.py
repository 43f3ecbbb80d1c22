"""make bench-stack: is Tessera, end to end, slower than vLLM alone? (issue #19)

Four stacks on the same generated small model, measured in one run by one client (bench/stack/):
vLLM's own OpenAI server with the engine settings Tessera's engine resolves to here (the baseline), the same
server behind vLLM's Rust router and behind the LiteLLM proxy (both from the bench-only venv
``.venv-bench-stack``; a row is skipped, saying why, where one cannot install or run), and ``tessera up``
with one engine. Each stack runs its phases back to back: sequential requests, then Poisson arrivals at 2, 4
and 8 req/s; streamed chat, ~350-token prompts that differ per request, 16 tokens out. The report gives TTFT
and E2E p50/p99, CPU per request of each part of each stack (engine, Ray, gateway, Redis, controller,
router/proxy; psutil cpu_times deltas over the phase) and ratios to the baseline, with Tessera's goals
beside them. ``--quick`` is a smoke run of a few minutes; ``--rounds 2`` repeats everything (the stacks'
order reversed in odd rounds). Writes bench/results/stack.json and stack.md.

NOTE: Ray starts the engine replica and its vLLM processes at niceness 15 (RAY_worker_niceness), and Ray sets
OMP_NUM_THREADS=1 in the replica, where the baseline server runs at niceness 0 with torch's default threads;
the report lists both for every engine process. On a machine shared with other work the niceness alone
decides Tessera's latency: ``--ray-worker-niceness 0`` compares the stacks at equal priority.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import RESULTS, bench_model, stop_on_sigterm, write_results
from stack import cpu, report, stacks, workload

STACKS = ("vllm", "vllm+router", "vllm+litellm", "tessera")


def phases(args: argparse.Namespace) -> list[workload.Phase]:
    return [workload.Phase("sequential", num_requests=args.sequential),
            *(workload.Phase(f"poisson@{rate:g}", rate_rps=rate, duration_s=args.phase_s) for rate in args.rates)]


async def measure(running: stacks.Running, plan: list[workload.Phase], maker: workload.PromptMaker,
                  round_index: int) -> list[report.PhaseRun]:
    warm = await workload.warm_up(running.target, maker)
    failed = [s.error for s in warm if not s.ok]
    if failed:
        raise stacks.StackUnavailable(f"warm-up requests failed: {failed[0]}")
    runs = []
    me = psutil.Process()
    for phase in plan:
        prompts, offsets = workload.phase_requests(phase, maker, round_index, running.name)
        meter = cpu.CpuMeter(running.roots).start()
        client0, wall0 = sum(me.cpu_times()[:2]), time.perf_counter()
        samples = await workload.run_phase(running.target, phase, prompts, offsets)
        wall = time.perf_counter() - wall0
        by_part, by_process = meter.stop()
        runs.append(report.PhaseRun(running.name, phase.name, round_index, wall, samples, by_part,
                                    sum(me.cpu_times()[:2]) - client0, by_process))
        ok = [s for s in samples if s.ok]
        print(f"    {phase.name}: {len(samples)} requests ({len(samples) - len(ok)} failed) in {wall:.1f} s, "
              f"E2E p50 {report.percentile_ms([s.e2e_s for s in ok], 50):.1f} ms", flush=True)
    return runs


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model_dir = bench_model("tessera-small")
        self.work = Path(tempfile.mkdtemp(prefix="bench-stack-"))
        self.maker = workload.PromptMaker(self.model_dir)
        self.plan = phases(args)
        self.runs: list[report.PhaseRun] = []
        self.ran_with: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}
        self.engine: dict[str, Any] = {}
        self.complete = False

    def run_stack(self, name: str, start: Callable[[], stacks.Running], round_index: int) -> None:
        if name not in self.args.stacks:
            return
        print(f"  [{name}] starting", flush=True)
        try:
            running = start()
        except stacks.StackUnavailable as exc:
            print(f"  [{name}] skipped: {exc}", flush=True)
            self.skipped[name] = str(exc)
            return
        try:
            self.ran_with[name] = running.ran_with
            self.ran_with[name]["engine_processes"] = cpu.engine_threads(running.roots)
            self.runs += asyncio.run(measure(running, self.plan, self.maker, round_index))
        except stacks.StackUnavailable as exc:
            print(f"  [{name}] skipped: {exc}", flush=True)
            self.skipped[name] = str(exc)
        finally:
            running.stop()

    def vllm_group(self, engine: dict[str, Any], round_index: int) -> None:
        if not {"vllm", "vllm+router", "vllm+litellm"} & set(self.args.stacks):
            return
        print("  [vllm] starting vLLM's OpenAI server", flush=True)
        try:
            server = stacks.start_vllm(engine, self.work, dict(self.args.vllm_env))
        except stacks.StackUnavailable as exc:
            print(f"  [vllm] skipped, and the stacks in front of it: {exc}", flush=True)
            self.skipped |= {name: f"the vLLM server did not start: {exc}" for name in STACKS if name != "tessera"}
            return
        try:
            self.run_stack("vllm", lambda: stacks.Running(server.name, server.target, server.roots,
                                                          dict(server.ran_with), lambda: None), round_index)
            self.run_stack("vllm+router", lambda: stacks.start_router(server, self.work), round_index)
            self.run_stack("vllm+litellm", lambda: stacks.start_litellm(server, self.work), round_index)
        finally:
            server.stop()

    def run(self) -> None:
        print(f"resolving Tessera's engine settings for {self.model_dir.name} here", flush=True)
        self.engine = engine = stacks.resolved_engine(self.model_dir)
        for round_index in range(self.args.rounds):
            print(f"round {round_index + 1}/{self.args.rounds} (logs in {self.work})", flush=True)
            order = ["vllm", "tessera"] if round_index % 2 == 0 else ["tessera", "vllm"]
            for group in order:
                if group == "vllm":
                    self.vllm_group(engine, round_index)
                else:
                    self.run_stack("tessera", lambda: stacks.start_tessera(
                        self.model_dir, self.work, self.args.ray_worker_niceness,
                        shlex.split(self.args.tessera_up_args), dict(self.args.tessera_env)), round_index)
        self.complete = True

    def payload(self) -> tuple[dict[str, Any], str]:
        rows = []
        for name in STACKS:
            for phase in self.plan:
                mine = [r for r in self.runs if r.stack == name and r.phase == phase.name]
                if mine:
                    rows.append(report.summarize(mine))
        rows = report.add_ratios(rows)
        checks = report.goal_checks(rows)
        flags = cpu.cpu_flags()
        partial = "" if self.complete else " (INTERRUPTED: partial results)"
        header = [f"# make bench-stack{' --quick' if self.args.quick else ''}: Tessera against vLLM alone{partial}", "",
                  f"Machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs; "
                  f"flags: {' '.join(flags) or 'no AVX-512/AMX'}. Other work on the machine adds noise.",
                  f"Workload: streamed chat, {workload.PROMPT_TOKENS}-token prompts (model tokenizer; the chat "
                  f"template adds a few), max_tokens {workload.MAX_TOKENS} with ignore_eos; sequential "
                  f"{self.args.sequential} requests, Poisson {', '.join(f'{r:g}' for r in self.args.rates)} req/s "
                  f"for {self.args.phase_s:g} s each; {self.args.rounds} round(s).", ""]
        header += ["What each stack ran with:"]
        for name, how in self.ran_with.items():
            header.append(f"- {name}: " + "; ".join(f"{k}={v}" for k, v in how.items() if k != "log"))
        header += [f"- {name}: SKIPPED: {why}" for name, why in self.skipped.items()]
        text = "\n".join([*header, "", "## Latency", "", report.latency_table(rows), "",
                          "## CPU per request (ms), by part", "", report.cpu_table(rows), "",
                          "## Where Tessera's CPU goes (ms per request, by process)", "",
                          report.top_processes(rows, "tessera"), "",
                          "## Goals", "", report.goals_table(checks), ""])
        return ({"quick": self.args.quick, "complete": self.complete, "rounds": self.args.rounds, "cpu_flags": flags,
                 "resolved_engine": self.engine, "ran_with": self.ran_with, "skipped": self.skipped,
                 "rows": rows, "goals": checks, "workload": {
                     "prompt_tokens": workload.PROMPT_TOKENS, "max_tokens": workload.MAX_TOKENS,
                     "sequential": self.args.sequential, "rates": self.args.rates, "phase_s": self.args.phase_s}},
                text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="A smoke run: 10 sequential requests, 8 s phases.")
    parser.add_argument("--rounds", type=int, default=1, help="Repeat all stacks and phases this many times.")
    parser.add_argument("--sequential", type=int, default=150, help="Requests in the sequential phase.")
    parser.add_argument("--phase-s", type=float, default=45.0, help="Length of each Poisson phase, seconds.")
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0], help="Poisson rates, req/s.")
    parser.add_argument("--stacks", nargs="+", default=list(STACKS), choices=STACKS, help="Stacks to run.")
    parser.add_argument("--ray-worker-niceness", type=int, default=None,
                        help="RAY_worker_niceness for tessera up (default: Ray's own, 15, as users run it).")
    parser.add_argument("--tessera-up-args", default="",
                        help="More `tessera up` options for the Tessera stack, one string (an experiment's arm), "
                        "e.g. --tessera-up-args=--no-cpu-split.")
    parser.add_argument("--tessera-env", type=stacks.env_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="An environment variable for `tessera up` only (repeatable), e.g. an arm's "
                        "--tessera-env GOMP_SPINCOUNT=10000; vLLM alone runs without it.")
    parser.add_argument("--vllm-env", type=stacks.env_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="An environment variable for vLLM's own server only (repeatable), e.g. "
                        "--vllm-env OMP_WAIT_POLICY=PASSIVE: the baseline under a setting Tessera gives its engines.")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequential, args.phase_s = min(args.sequential, 10), min(args.phase_s, 8.0)
    return args


def main() -> None:
    stop_on_sigterm()
    bench = Bench(parse_args())
    try:
        bench.run()
    finally:  # what was measured before an interruption or a failure is still reported
        report_results(bench)


def report_results(bench: Bench) -> None:
    payload, text = bench.payload()
    path = write_results("stack", payload)
    (RESULTS / "stack.md").write_text(text)
    print("\n" + text)
    print(f"results: {path} and {RESULTS / 'stack.md'}")


if __name__ == "__main__":
    main()
