"""Run a workload in this process or in ``N`` worker processes, then write its run directory.

Multi-process mode (``--workers N``): each worker is a spawned process running one ``Runner`` shard on
its own event loop. The parent waits until every worker is ready, then hands them one common start time
``t0`` on the monotonic clock, which all processes of a Linux machine share, so their records can be
merged as if one client had made them. Workers stream progress counters to the parent through a queue
and write their records to a scratch file at the end.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from tessera_loadgen.client import Target
from tessera_loadgen.metrics import MetricSpec, summarize_run
from tessera_loadgen.progress import AggregateStats, LiveStats, ProgressSnapshot, display, render, snapshot
from tessera_loadgen.prompts import PromptLibrary
from tessera_loadgen.records import RequestRecord
from tessera_loadgen.results import (
    PROMPT_LENGTHS_APPROXIMATE,
    PROMPT_LENGTHS_TOKENS,
    RunInfo,
    build_result,
    write_run_dir,
)
from tessera_loadgen.runner import Runner, RunResult, Shard, build_library, resolve_models, run_in_loop
from tessera_loadgen.tokenizer_source import models_with_synthetic_prompts
from tessera_loadgen.tokenizer_spec import TokenizerSpec
from tessera_loadgen.workload import Workload

_WORKER_READY_TIMEOUT_S = 120.0
_WORKER_START_LEAD_S = 0.3
_PROGRESS_INTERVAL_S = 0.5


@dataclass(slots=True)
class RunOutput:
    """A finished run: its directory, its result document and its records."""

    run_dir: Path
    result: dict[str, Any]
    records: list[RequestRecord]
    t0: float


def execute(
    workload: Workload,
    target: Target,
    run_dir: Path,
    *,
    num_workers: int = 1,
    progress: bool = True,
    plots: bool = True,
    models: dict[str, str] | None = None,
    tokenizers: Mapping[str, TokenizerSpec] | None = None,
    t0: float | None = None,
) -> RunOutput:
    """Run ``workload`` against ``target`` and write ``run_dir``; returns the result and the records.

    ``models`` (tenant -> model) skips asking the server; ``tokenizers`` (model -> spec, from
    ``tokenizer_source.resolve_tokenizers``) makes those models' prompt lengths exact, the others'
    approximate (words), which the result says. ``t0``: the run's clock origin on ``time.perf_counter``
    (CLOCK_MONOTONIC, one clock for every process of the machine), so that a caller in another process knows
    when each scheduled arrival falls; by default the run starts as soon as it is ready. Only in one process.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if t0 is not None and num_workers > 1:
        raise ValueError("t0 is for a run in one process; several workers agree on their own")
    if models is None:
        models = run_in_loop(resolve_models(workload, target))
    tokenizers = dict(tokenizers or {})
    if num_workers == 1:
        run = run_in_loop(_run_here(workload, target, models, tokenizers, progress, t0))
    else:
        run = _run_workers(workload, target, models, tokenizers, num_workers, progress)
    summary = summarize_run(run.records, MetricSpec.from_workload(workload))
    synthetic_models = models_with_synthetic_prompts(workload, models)
    info = RunInfo(
        target=target.url,
        started_at_unix=run.t0_unix,
        duration_s=run.t_end - run.t0,
        num_workers=num_workers,
        models=run.models,
        interrupted=run.interrupted,
        num_connects=run.num_connects,
        prompt_lengths=(
            PROMPT_LENGTHS_TOKENS if all(m in tokenizers for m in synthetic_models) else PROMPT_LENGTHS_APPROXIMATE
        ),
        tokenizers={m: tokenizers[m].source if m in tokenizers else None for m in synthetic_models},
    )
    result = build_result(workload.redacted(), info, summary)
    write_run_dir(run_dir, result, run.records, run.t0)
    if plots:
        from tessera_loadgen.plots import write_plots

        write_plots(run_dir / "plots", run.records, run.t0)
    return RunOutput(run_dir, result, run.records, run.t0)


async def _run_here(
    workload: Workload,
    target: Target,
    models: dict[str, str],
    tokenizers: dict[str, TokenizerSpec],
    progress: bool,
    t0: float | None = None,
) -> RunResult:
    stats = LiveStats()
    runner = Runner(workload, target, models=models, stats=stats, tokenizers=tokenizers, t0=t0)
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    interrupts = 0

    def on_sigint() -> None:
        # First Ctrl-C: stop starting requests and let those in flight finish. Second: give up on them.
        nonlocal interrupts
        interrupts += 1
        runner.stop()
        if interrupts > 1 and main is not None:
            main.cancel()

    # Signal handlers can only be installed from the main thread (not when embedded in a worker thread).
    handles_sigint = threading.current_thread() is threading.main_thread()
    if handles_sigint:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    stop_display = asyncio.Event()
    shown = None
    if progress:
        shown = asyncio.create_task(display(stats, time.perf_counter() + 0.05, stop_display))
    try:
        run_task = asyncio.ensure_future(runner.run())
        try:
            return await asyncio.shield(run_task)
        except asyncio.CancelledError:
            run_task.cancel()
            return await run_task
    finally:
        if handles_sigint:
            loop.remove_signal_handler(signal.SIGINT)
        stop_display.set()
        if shown is not None:
            await shown


# multi-process ----------------------------------------------------------------------------------------------
def _run_workers(
    workload: Workload,
    target: Target,
    models: dict[str, str],
    tokenizers: dict[str, TokenizerSpec],
    num_workers: int,
    progress: bool,
) -> RunResult:
    context = multiprocessing.get_context("spawn")
    messages: multiprocessing.Queue[tuple[Any, ...]] = context.Queue()
    scratch = Path(tempfile.mkdtemp(prefix="tessera-loadgen-"))
    pipes = []
    processes = []
    payload = workload.model_dump_json()
    for index in range(num_workers):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker_main,
            args=(index, num_workers, payload, target.url, models, tokenizers, receiver, messages, str(scratch)),
            name=f"tessera-loadgen-worker-{index}",
        )
        process.start()
        pipes.append(sender)
        processes.append(process)
    try:
        ready = 0
        deadline = time.monotonic() + _WORKER_READY_TIMEOUT_S
        while ready < num_workers:
            kind, *rest = messages.get(timeout=max(0.1, deadline - time.monotonic()))
            if kind == "ready":
                ready += 1
            elif kind == "failed":
                raise RuntimeError(f"loadgen worker {rest[0]} failed to start:\n{rest[1]}")
        t0 = time.perf_counter() + _WORKER_START_LEAD_S
        t0_unix = time.time() + _WORKER_START_LEAD_S
        for pipe in pipes:
            pipe.send(t0)
        return _collect(messages, processes, num_workers, t0, t0_unix, models, progress)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()


def _collect(
    messages: multiprocessing.Queue[tuple[Any, ...]],
    processes: Sequence[multiprocessing.process.BaseProcess],
    num_workers: int,
    t0: float,
    t0_unix: float,
    models: dict[str, str],
    progress: bool,
) -> RunResult:
    stats = AggregateStats(num_workers)
    done: dict[int, tuple[str, float, bool, int]] = {}
    previous: ProgressSnapshot | None = None
    next_display = time.perf_counter() + 1.0
    interrupted = False
    while len(done) < num_workers:
        try:
            kind, index, *rest = messages.get(timeout=0.2)
        except queue.Empty:
            kind = ""
        except KeyboardInterrupt:
            # Workers got the same SIGINT and are draining; a second one stops the parent.
            if interrupted:
                raise
            interrupted = True
            continue
        if kind == "progress":
            stats.update(index, rest[0], rest[1])
        elif kind == "done":
            done[index] = (rest[0], rest[1], rest[2], rest[3])
        elif kind == "failed":
            raise RuntimeError(f"loadgen worker {index} failed:\n{rest[0]}")
        elif not kind and not any(p.is_alive() for p in processes) and len(done) < num_workers:
            raise RuntimeError("loadgen workers exited without reporting their records")
        if progress and time.perf_counter() >= next_display:
            previous = snapshot(stats, time.perf_counter(), t0, previous)
            sys.stderr.write(render(previous) + "\n")
            next_display += 1.0
    records: list[RequestRecord] = []
    t_end = t0
    num_connects = 0
    decode = msgspec.msgpack.Decoder().decode
    for index in sorted(done):
        path, worker_t_end, worker_interrupted, connects = done[index]
        rows = decode(Path(path).read_bytes())
        records.extend(RequestRecord.from_json(row) for row in rows)
        Path(path).unlink()
        t_end = max(t_end, worker_t_end)
        interrupted = interrupted or worker_interrupted
        num_connects += connects
    records.sort(key=lambda r: r.t_sched)
    # Records from workers carry times relative to t0, so the merged run's origin is 0.
    return RunResult(records, 0.0, t0_unix, t_end - t0, models, interrupted, num_connects)


def _worker_main(
    index: int,
    count: int,
    workload_json: str,
    target_url: str,
    models: dict[str, str],
    tokenizers: dict[str, TokenizerSpec],
    start: Connection,
    messages: multiprocessing.Queue[tuple[Any, ...]],
    scratch: str,
) -> None:
    import traceback

    try:
        workload = Workload.model_validate_json(workload_json)
        target = Target.parse(target_url)
        # Before reporting ready: the start time t0 comes after every worker is ready, and building
        # token-exact prompt material takes tens of milliseconds that must not count as schedule lag.
        library = build_library(workload, tokenizers)
    except Exception:
        messages.put(("failed", index, traceback.format_exc()))
        return
    messages.put(("ready", index))
    t0 = start.recv()
    try:
        run = run_in_loop(_worker_run(index, count, workload, target, models, library, t0, messages))
        path = Path(scratch) / f"worker-{index}.msgpack"
        path.write_bytes(msgspec.msgpack.encode([r.to_json(run.t0) for r in run.records]))
        messages.put(("done", index, str(path), run.t_end, run.interrupted, run.num_connects))
    except Exception:
        messages.put(("failed", index, traceback.format_exc()))


async def _worker_run(
    index: int,
    count: int,
    workload: Workload,
    target: Target,
    models: dict[str, str],
    library: PromptLibrary,
    t0: float,
    messages: multiprocessing.Queue[tuple[Any, ...]],
) -> RunResult:
    stats = LiveStats()
    runner = Runner(workload, target, models=models, shard=Shard(index, count), stats=stats, t0=t0, library=library)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, runner.stop)
    run_task = asyncio.ensure_future(runner.run())
    while not run_task.done():
        await asyncio.wait([run_task], timeout=_PROGRESS_INTERVAL_S)
        counters = (stats.num_sent, stats.num_done, stats.num_failed)
        messages.put(("progress", index, counters, stats.new_samples()))
    return run_task.result()
