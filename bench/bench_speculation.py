"""Speculation on, off and adaptive, on the random small model: throughput and CPU per decoded token.

    .venv/bin/python bench/bench_speculation.py [--requests 8] [--max-tokens 64] [--concurrency 4]

Two workloads: "noise" (random prompts sampled at temperature 1: n-gram finds nothing to accept) and
"repeats" (prompts that repeat a 16-token sequence, greedy: n-gram drafts are accepted). Three modes:
"on" (n-gram, k=3, as the engine default), "off" (an engine started with ``speculative: null``) and
"adaptive" (the n-gram engine under ``SpeculationControl``, decisions included in the measured run).
CPU is the user+system time of this process (vLLM's frontend) and its children (engine core, worker).
Both engines stay up and the runs interleave, repeated ``--reps`` times; each engine is charged only its
own processes. A run takes about two minutes, most of it two engine starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform" / "src"))

from _support import stop_on_sigterm  # noqa: E402

from tessera.engine.capabilities import ask_vllm, resolve  # noqa: E402
from tessera.engine.config import EngineConfig  # noqa: E402
from tessera.engine.protocol import RequestStats  # noqa: E402
from tessera.engine.small_model import is_small_model_dir, make_small_model  # noqa: E402
from tessera.engine.speculation_control import (  # noqa: E402
    WORKER_EXTENSION,
    SpeculationControl,
    set_num_speculative_tokens,
)
from tessera.engine.speculation_policy import PolicySettings  # noqa: E402

MAX_K = 3
WORKLOADS = {"noise": 1.0, "repeats": 0.0}  # sampling temperature


@dataclass(slots=True)
class Row:
    workload: str
    mode: str
    tokens: int
    wall_s: float
    cpu_s: float
    accepted: int
    drafted: int
    final: str


def prompts(workload: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if workload == "noise":
        return [[rng.randrange(10, 1000) for _ in range(64)] for _ in range(n)]
    return [list(range(s, s + 16)) * 6 for s in (rng.randrange(10, 900) for _ in range(n))]


def cpu_s(pids: set[int]) -> float:
    """User+system CPU seconds of this process and the engine processes ``pids``."""
    total = 0.0
    for pid in {os.getpid(), *pids}:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


async def start(model: Path, speculative: bool) -> Any:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    config = EngineConfig.model_validate({"model": str(model), "kv_events": {"enabled": False},
                                          "speculative": {"num_speculative_tokens": MAX_K} if speculative else None})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_space_gib))  # as the host does
    kwargs = resolve(config, ask_vllm(config)).config.to_vllm_kwargs()
    if speculative:
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    async for _ in engine.generate({"prompt_token_ids": list(range(1, 17))}, SamplingParams(max_tokens=1),
                                   request_id="warmup"):  # see host.WARMUP_PROMPT_TOKENS
        pass
    return engine


async def one(engine: Any, prompt: list[int], temperature: float, max_tokens: int) -> RequestStats:
    from vllm import SamplingParams

    stats = RequestStats(arrival_ts=time.time())
    final: Any = None
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex):
        final = output
    completion = final.outputs[0]
    stats.num_output_tokens = len(completion.token_ids)
    if completion.spec_decode_metrics is not None:
        stats.num_spec_draft_tokens = int(completion.spec_decode_metrics.num_draft_tokens)
        stats.num_spec_accepted_tokens = sum(j * c for j, c in enumerate(completion.spec_decode_metrics.histogram))
    return stats


@dataclass(slots=True)
class Engine:
    llm: Any
    pids: set[int]  # its engine-core and worker processes: the other engine's idle time is not charged


async def run(engine: Engine, workload: str, mode: str, rep: int, args: argparse.Namespace,
              control: SpeculationControl | None) -> Row:
    batch_prompts = prompts(workload, args.requests, seed=1000 * rep + len(mode) + len(workload))
    t0, c0 = time.perf_counter(), cpu_s(engine.pids)
    done: list[RequestStats] = []
    for i in range(0, len(batch_prompts), args.concurrency):
        chunk = batch_prompts[i:i + args.concurrency]
        stats = await asyncio.gather(*(one(engine.llm, p, WORKLOADS[workload], args.max_tokens) for p in chunk))
        done.extend(stats)
        if control is not None:
            for s in stats:
                control.observe(s, workload)
            await control.maybe_apply(engine.llm, num_running=0)
    wall, cpu = time.perf_counter() - t0, cpu_s(engine.pids) - c0
    final = f"{control.state.phase} k={control.state.num_speculative_tokens}" if control else ""
    return Row(workload, mode, sum(s.num_output_tokens for s in done), wall, cpu,
               sum(s.num_spec_accepted_tokens for s in done), sum(s.num_spec_draft_tokens for s in done), final)


async def main(args: argparse.Namespace) -> None:
    stop_on_sigterm()
    model = REPO / ".tessera" / "models" / "tessera-small"
    if not is_small_model_dir(model):
        make_small_model(model)
    before = child_pids()
    spec = Engine(await start(model, speculative=True), set())
    spec.pids = child_pids() - before
    plain = Engine(await start(model, speculative=False), set())
    plain.pids = child_pids() - before - spec.pids
    rows: list[Row] = []
    try:
        # Interleaved and repeated: the machine's other load falls on every mode alike.
        for rep in range(args.reps):
            for workload in WORKLOADS:
                await set_num_speculative_tokens(spec.llm, MAX_K)
                rows.append(await run(spec, workload, "on", rep, args, None))
                rows.append(await run(plain, workload, "off", rep, args, None))
                await set_num_speculative_tokens(spec.llm, MAX_K)
                control = SpeculationControl("ngram", MAX_K, settings=PolicySettings(
                    min_decode_steps=args.min_decode_steps, probe_interval_s=3600.0))
                rows.append(await run(spec, workload, "adaptive", rep, args, control))
    finally:
        spec.llm.shutdown()
        plain.llm.shutdown()
    # Medians over the repetitions: the machine may be shared, and one busy moment must not decide a row.
    print(f"{'workload':<9} {'mode':<9} {'tokens':>6} {'tok/s':>8} {'CPU ms/tok':>10} {'drafted':>7} "
          f"{'accepted':>8}  final state (adaptive)")
    for key in sorted({(r.workload, r.mode) for r in rows}):
        same = [r for r in rows if (r.workload, r.mode) == key]
        rate = statistics.median(r.tokens / r.wall_s for r in same)
        cpu_ms = statistics.median(1000 * r.cpu_s / r.tokens for r in same)
        print(f"{key[0]:<9} {key[1]:<9} {sum(r.tokens for r in same):>6} {rate:>8.1f} {cpu_ms:>10.2f} "
              f"{sum(r.drafted for r in same):>7} {sum(r.accepted for r in same):>8}  "
              f"{', '.join(sorted({r.final for r in same if r.final}))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at once")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every run")
    parser.add_argument("--min-decode-steps", type=int, default=120, help="adaptive: steps before a decision")
    asyncio.run(main(parser.parse_args()))
