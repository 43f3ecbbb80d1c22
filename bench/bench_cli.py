"""make bench-cli: how long each console script takes to answer, start to exit, as a user runs it.

Every command runs ``--runs`` times (default 5) as a fresh process, after ``--warmup`` unmeasured runs (default
1: the first run after a change also compiles bytecode and fills the page cache). Each is timed on the wall
clock from spawn to exit, in an empty temporary directory, with no ``TESSERA_*`` variable set (no Redis). The
goal is 1.5 s on a 2-core machine: a ``--help`` or a plan must not import vLLM, torch, Triton or Ray.

Reported per command: min, median and max seconds, and whether the min and the median meet the goal; also
whether the command printed Triton's "installed, but doesn't include CPU backend" notice (a sign that the
serving stack was imported). Results: bench/results/cli.json and a table. A command that fails (exit code not
0) fails the benchmark; a missed goal does not (the numbers depend on the machine).

Usage: ``.venv/bin/python bench/bench_cli.py [--runs 5] [--warmup 1] [--goal 1.5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _support import BIN, print_table, stop_on_sigterm, write_results

GOAL_S = 1.5
TRITON_NOTICE = "Triton is installed"
# A representative plan that works offline: a preset model on a preset GPU, printed as tables.
PLAN_SERVE = ["plan", "serve", "--model", "llama-3-70b", "--gpu", "h100-sxm", "--context-len", "8192"]
COMMANDS: list[tuple[str, list[str]]] = [
    ("tessera --help", ["tessera", "--help"]),
    ("tessera plan --help", ["tessera", "plan", "--help"]),
    ("tessera plan serve --help", ["tessera", "plan", "serve", "--help"]),
    ("tessera plan serve (llama-3-70b, h100-sxm)", ["tessera", *PLAN_SERVE]),
    ("tessera tenants list --help", ["tessera", "tenants", "list", "--help"]),
    ("tessera traces analyze --help", ["tessera", "traces", "analyze", "--help"]),
    ("tessera-loadgen --help", ["tessera-loadgen", "--help"]),
    ("tessera-operator --help", ["tessera-operator", "--help"]),
    ("tessera-kvcontrol --help", ["tessera-kvcontrol", "--help"]),
]


def quiet_environment() -> dict[str, str]:
    """No TESSERA_* setting: a command that needs Redis must not find one (and must not need it for --help)."""
    return {name: value for name, value in os.environ.items() if not name.startswith("TESSERA_")}


def run_once(argv: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    command = [str(BIN / argv[0]), *argv[1:]]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=quiet_environment(), capture_output=True, text=True,
                            check=False)
    return time.perf_counter() - started, result


def measure(argv: list[str], runs: int, warmup: int, goal_s: float) -> dict[str, Any]:
    times: list[float] = []
    triton_notice = False
    failure = None
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as work:
        for index in range(warmup + runs):
            elapsed, result = run_once(argv, Path(work))
            triton_notice |= TRITON_NOTICE in result.stderr
            if result.returncode != 0:
                failure = f"exit {result.returncode}: {result.stderr.strip()[-300:]}"
                break
            if index >= warmup:
                times.append(elapsed)
    row: dict[str, Any] = {"argv": argv, "runs": len(times), "times_s": times, "triton_notice": triton_notice,
                           "failure": failure}
    if times:
        row |= {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times)}
        row |= {"min_meets_goal": row["min_s"] <= goal_s, "median_meets_goal": row["median_s"] <= goal_s}
    return row


def verdict(row: dict[str, Any], key: str) -> str:
    if row["failure"] is not None:
        return "error"
    return "pass" if row[key] else "FAIL"


def main() -> int:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="measured runs per command (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first (default 1)")
    parser.add_argument("--goal", type=float, default=GOAL_S, help=f"goal, seconds (default {GOAL_S})")
    args = parser.parse_args()

    started = time.monotonic()
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    results: dict[str, dict[str, Any]] = {}
    for label, argv in COMMANDS:
        print(f"{label} ...", flush=True)
        results[label] = measure(argv, args.runs, args.warmup, args.goal)

    print(f"\nWall time per run, seconds ({args.runs} runs after {args.warmup} warm-up; goal {args.goal} s)")
    print_table(
        ["command", "min s", "median s", "max s", "goal s", "min", "median", "Triton notice"],
        [[label, row.get("min_s", "-"), row.get("median_s", "-"), row.get("max_s", "-"), args.goal,
          verdict(row, "min_meets_goal"), verdict(row, "median_meets_goal"), "yes" if row["triton_notice"] else "no"]
         for label, row in results.items()],
    )
    failures = {label: row["failure"] for label, row in results.items() if row["failure"] is not None}
    for label, failure in failures.items():
        print(f"error: {label}: {failure}", file=sys.stderr)
    path = write_results("cli", {
        "goal_s": args.goal, "runs": args.runs, "warmup": args.warmup, "commands": results,
        "wall_s": time.monotonic() - started,
        "machine": {"cpus": os.cpu_count(), "load_average_1m_before": load_before,
                    "load_average_1m_after": os.getloadavg()[0]},
    })
    print(f"results: {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
