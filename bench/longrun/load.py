"""The steady multi-tenant load of the long-running benches, through the project's load generator.

Each tenant has open-loop Poisson arrivals of streamed chats (``continuous_usage_stats`` on, so the client
counts every token it received; ``ignore_eos``, so a complete answer is exactly ``max_tokens`` long). The run
goes in a process of its own, while the bench's main thread samples the platform: a sample walks every
process with psutil and scrapes three ``/metrics``, and in the same process as the client (a thread, until
2026-12-04) it held the interpreter while streams arrived, so the requests in flight at each window's end
measured the sampler (docs/performance.md section 10, runs B and C).
"""

from __future__ import annotations

import math
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tessera_loadgen.client import Target
from tessera_loadgen.execute import RunOutput, execute
from tessera_loadgen.tokenizer_spec import load_model_dir
from tessera_loadgen.workload import Workload


def tenant_workload(keys: dict[str, str], *, rate_rps: float, duration_s: float, prompt_tokens: int,
                    max_tokens: int, request_timeout_s: float, seed: int, name: str,
                    period_s: float | None = None) -> Workload:
    """``rate_rps`` in all, split evenly over the tenants of ``keys`` (name -> API key). ``period_s``: each
    tenant's arrivals repeat with that period (the loadgen's ``arrival.period_s``)."""
    tenants: list[dict[str, Any]] = [
        {"name": tenant, "api_key": key, "model": "tessera-small",
         "arrival": {"process": "poisson", "rate_rps": rate_rps / len(keys), "period_s": period_s},
         "classes": [{"name": "chat", "prompt": {"tokens": prompt_tokens}, "output_tokens": max_tokens}]}
        for tenant, key in keys.items()]
    return Workload.model_validate({
        "name": name, "seed": seed, "duration_s": duration_s, "request_timeout_s": request_timeout_s,
        "ignore_eos": True, "continuous_usage_stats": True,
        # A 429 is the tenant's limit, not a fault: count it and move on rather than wait out Retry-After.
        "retry": {"on_429": "count"}, "tenants": tenants})


class LoadProcess:
    """A load run in a child process (spawned, in this session): ``is_alive`` while it runs, ``result`` its
    ``RunOutput`` (or the exception it raised)."""

    def __init__(self, workload: Workload, target_url: str, run_dir: Path, tokenizer_dir: Path | None,
                 t0: float | None) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self._future: Future[RunOutput] = self._pool.submit(run_load, workload, target_url, run_dir, tokenizer_dir,
                                                            t0)

    def is_alive(self) -> bool:
        return not self._future.done()

    def result(self) -> RunOutput:
        try:
            return self._future.result()
        finally:
            self._pool.shutdown()


def start_load(workload: Workload, target_url: str, run_dir: Path, tokenizer_dir: Path | None = None,
               t0: float | None = None) -> LoadProcess:
    """The run, started in a process of its own; ``.result()`` is its ``RunOutput`` once every request has
    ended. ``tokenizer_dir``: the model's directory, to make synthetic prompts exactly as long as asked in its
    tokens (without it a prompt's length is counted in words, ~3 of the small model's tokens each). ``t0``:
    when the schedule starts, on ``time.perf_counter``'s clock (the loadgen's ``execute``); by default as soon
    as the child is ready."""
    return LoadProcess(workload, target_url, run_dir, tokenizer_dir, t0)


def run_load(workload: Workload, target_url: str, run_dir: Path, tokenizer_dir: Path | None,
             t0: float | None = None) -> RunOutput:
    """The run itself (in the child)."""
    tokenizers = {"tessera-small": load_model_dir(tokenizer_dir)} if tokenizer_dir is not None else None
    return execute(workload, Target.parse(target_url), run_dir, progress=False, plots=False,
                   models={t.name: "tessera-small" for t in workload.tenants}, tokenizers=tokenizers, t0=t0)


def cache_fill_workload(keys: dict[str, str], *, kv_blocks: int, block_size: int, times: float,
                        prompt_tokens: int, seed: int) -> Workload:
    """Enough distinct long prompts, one at a time per tenant, to store ``times`` x the engine's KV cache
    (``kv_blocks`` blocks of ``block_size`` tokens), so that every block the measured load stores evicts
    one: the state a long-running engine is in. A cache still filling does less work per request (nothing
    to evict, no removal events to publish, index or account), so a run measured from a cold cache
    compares its first windows, which fill it, with later ones, which evict."""
    num_requests = max(len(keys), math.ceil(times * kv_blocks * block_size / prompt_tokens))
    tenants: list[dict[str, Any]] = [
        {"name": tenant, "api_key": key, "model": "tessera-small", "concurrency": 1,
         "classes": [{"name": "fill", "endpoint": "completions", "prompt": {"tokens": prompt_tokens},
                      "output_tokens": 1}]}
        for tenant, key in keys.items()]
    return Workload.model_validate({
        "name": "cache-fill", "seed": seed, "num_requests": num_requests, "request_timeout_s": 120.0,
        "ignore_eos": True, "retry": {"on_429": "count"}, "tenants": tenants})
