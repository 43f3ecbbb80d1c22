"""make bench-idle-gaps: how fast a stack decodes a request that finds it idle (issue #19).

At 4 req/s a request mostly arrives after the engine sat idle for a few hundred milliseconds, where a sequential
run never lets it rest; `make bench-stack` sees the difference only as a ratio that moves with the minute. This
bench looks at it directly: each arm (vLLM's own server, or `tessera up`, each with environment settings of its
own) serves requests one at a time with a fixed idle gap before each (0, 20, 100, 250 ms, then 0 again), and the
client records every streamed token's arrival. Per arm and gap: TTFT, decode (first token to last) and E2E
p50, and CPU per request of the arm's processes. Arms run one after another; give an arm twice (e.g. A B B A)
to see the minute's drift. Same workload as bench-stack (bench/stack/workload.py): ~350-token prompts that
differ per request, 16 tokens out. Writes bench/results/idle_gaps.json and idle_gaps.md.

    python bench/bench_idle_gaps.py --arms tessera tessera:GOMP_SPINCOUNT=0 vllm
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import RESULTS, bench_model, print_table, stop_on_sigterm, write_results
from stack import cpu, stacks, workload

DEFAULT_GAPS_S = (0.0, 0.02, 0.1, 0.25, 0.0)


@dataclass(frozen=True, slots=True)
class Arm:
    """``stack[:NAME=VALUE[,NAME=VALUE...]]``: a stack (``vllm`` or ``tessera``) and environment for it alone."""

    stack: str
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Arm:
        stack, _, settings = text.partition(":")
        if stack not in ("vllm", "tessera"):
            raise argparse.ArgumentTypeError(f"{text!r}: the stack must be vllm or tessera")
        return cls(stack, dict(stacks.env_setting(item) for item in filter(None, settings.split(","))))

    def label(self) -> str:
        return self.stack + "".join(f" {k}={v}" for k, v in self.env.items())


def summarise(samples: list[workload.Sample], cpu_s: float) -> dict[str, float]:
    """p50s in ms of one gap's requests, and the arm's CPU per request (pure)."""
    return {"ttft_p50_ms": 1e3 * statistics.median(s.ttft_s for s in samples),
            "decode_p50_ms": 1e3 * statistics.median(s.text_arrivals_s[-1] - s.ttft_s for s in samples),
            "e2e_p50_ms": 1e3 * statistics.median(s.e2e_s for s in samples),
            "cpu_ms_per_request": 1e3 * cpu_s / len(samples)}


async def measure(running: stacks.Running, maker: workload.PromptMaker, tag: str, gaps: list[float],
                  per_gap: int) -> list[dict[str, Any]]:
    # Connections, caches, the engine's first forwards.
    if not all(s.ok for s in await workload.warm_up(running.target, maker, num_requests=5)):
        raise stacks.StackUnavailable(f"{running.name}: warm-up requests failed")
    rows = []
    async with workload.client_session() as session:
        for index, gap in enumerate(gaps):
            meter = cpu.CpuMeter(running.roots).start()
            samples = []
            for i in range(per_gap):
                await asyncio.sleep(gap)
                sample = await workload.one_request(session, running.target, maker.prompt(f"{tag}-{index}-{i}"))
                if not sample.ok:
                    raise stacks.StackUnavailable(f"{running.name}: a request failed: {sample.error}")
                samples.append(sample)
            by_part, _ = meter.stop()
            rows.append({"gap_s": gap, **summarise(samples, sum(by_part.values()))})
    return rows


def start(arm: Arm, model_dir: Path, work: Path) -> stacks.Running:
    if arm.stack == "vllm":
        return stacks.start_vllm(stacks.resolved_engine(model_dir), work, arm.env)
    return stacks.start_tessera(model_dir, work, extra_env=arm.env)


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=Arm.parse, nargs="+", default=[Arm.parse("vllm"), Arm.parse("tessera")],
                        help="stack[:NAME=VALUE,...], run in this order (default: vllm tessera)")
    parser.add_argument("--gaps", type=float, nargs="+", default=list(DEFAULT_GAPS_S), help="Idle gaps, seconds.")
    parser.add_argument("--requests", type=int, default=20, help="Requests per gap.")
    args = parser.parse_args()
    model_dir = bench_model("tessera-small")
    work = Path(tempfile.mkdtemp(prefix="bench-idle-gaps-"))
    maker = workload.PromptMaker(model_dir)
    results = []
    for n, arm in enumerate(args.arms):
        print(f"[{n + 1}/{len(args.arms)}] {arm.label()}", flush=True)
        running = start(arm, model_dir, work)
        try:
            rows = asyncio.run(measure(running, maker, f"{n}-{arm.stack}", args.gaps, args.requests))
        finally:
            running.stop()
        results.append({"arm": arm.label(), "run": n + 1, "rows": rows})
    headers = ["run", "arm", "gap ms", "TTFT p50", "decode p50", "E2E p50", "CPU ms/req"]
    table = [[r["run"], r["arm"], f"{row['gap_s'] * 1e3:g}", f"{row['ttft_p50_ms']:.1f}",
              f"{row['decode_p50_ms']:.1f}", f"{row['e2e_p50_ms']:.1f}", f"{row['cpu_ms_per_request']:.1f}"]
             for r in results for row in r["rows"]]
    print_table(headers, table)
    payload = {"cpu_flags": cpu.cpu_flags(),
               "requests_per_gap": args.requests, "results": results}
    write_results("idle_gaps", payload)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    flags = " ".join(payload["cpu_flags"]) or "none of avx512*/amx*"
    (RESULTS / "idle_gaps.md").write_text(f"# make bench-idle-gaps\n\nCPU flags: {flags}\n\n" + "\n".join(lines) + "\n")
    print(f"results: {RESULTS / 'idle_gaps.json'}, {RESULTS / 'idle_gaps.md'}")


if __name__ == "__main__":
    main()
