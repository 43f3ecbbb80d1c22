"""Simulated-engine calibration (issue #17): the sim, configured with the CPU engine's measured step costs,
against the real CPU engine on the same workload — TTFT and ITL p50/p99 side by side.

    make bench-sim-calibration                  # real engine (vLLM on CPU, one OMP thread) + sim
    python bench/bench_sim_calibration.py --sim-only            # the sim again, against the saved real half
    python bench/bench_sim_calibration.py --sim-only --terms step_s,per_seq_s,per_prefill_token_s

1. Real engine: one ``EngineHost`` (vLLM, CPU build, one unbound OpenMP thread as the tests run it) serving
   the routing benchmark's generated model, 200 KV blocks of 32 tokens, no Redis. vLLM's per-iteration
   details are switched on and a stat logger of this bench records, for every engine step, what it computed
   (prompt sequences and tokens, decoding sequences) and when the frontend received it; the engine core (a
   process vLLM spawns) writes each step's attention work beside it, counted from its own schedule
   (``engine_steps/sitecustomize.py``): query-key pairs and tokens of KV read, prefix-cache hits and decoding
   sequences' contexts included, as the sim's scheduler counts them.
2. Step costs, from the engine's own steps (``tessera.engine.sim.step_time_fit``): each step's time is the gap
   since the previous step on the engine core's clock (valid only when the engine had work left after it, so
   the gap holds no idle time). The ``measured`` model (per step, per extra sequence, per prompt token, per
   prompt sequence — the prefill/decode mix —, per query-key pair and per token of KV read) is fitted on the
   medians per step shape of the workload runs' own steps (``--fit-on workload``, the default: the figures
   compared below are not fitted, they come of the sim's queueing, batching and chunked prefill), of the first
   run's only (``held-out``: the sim is then compared with the other runs), or of probes (``probes``): before
   each workload run, while one long request keeps the engine stepping, isolated prompts of 32–1,536 tokens
   (3 each) and decode batches of 2–8 sequences at three contexts (128-, 384- and 768-token prompts, the
   workload's range) run in a shuffled order. Every fit is printed, with how well each explains the others'
   steps. The probes' isolated prompts' frontend delays (TTFT less the engine core's queue and prefill) become
   the sim's ``frontend_delays_s`` (``--frontend``).
3. Workload (seeded, the same for both): ``--num-requests`` requests, Poisson arrivals at ``--rate``,
   prompts of a shared 256-token prefix (half of them) plus a unique part of 64–512 tokens, 32 output
   tokens each, ``ignore_eos``. The real half runs it ``--repeats`` times (prefix cache reset between).
4. The same workload against one simulated replica (``tessera.engine.sim``) with the same block size,
   block count, max_num_seqs and token budget, at time scale 1, right after the real half.
5. Prints TTFT (engine-reported ``ttft_s``: vLLM's frontend arrival to first token; the sim's arrival to
   the end of the first token's step, simulated) and ITL (client-side gaps between streamed tokens, same
   client code for both) p50/p99: the real runs' median and spread, the sim's figures, the error against
   the real median. Diagnostics: client-side TTFT, the real engine's own ITL (core timestamps), its
   frontend overhead (TTFT minus the engine core's queue + prefill). Goal (issue #17): every figure within
   15 %. Results: bench/results/sim_calibration.json (with the step samples, so ``--sim-only`` refits).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

# The engine as the tests run it (tests/conftest.py): one unbound OpenMP thread, so its pace does not depend
# on which cores its neighbours spin on. Set before vLLM is imported.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# With iteration details on, vLLM's default logging stat logger would print every step (it is added only when
# vLLM logs at INFO; a logger level set from here is reset when vLLM configures its logging again).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import ENGINE_AUTH, REPO, bench_model, first_on_pythonpath, stop_on_sigterm

MODEL_DIR = REPO / ".tessera" / "models" / "tessera-bench-routing"
RESULTS = REPO / "bench" / "results" / "sim_calibration.json"
ENGINE_STEPS_PROBE = Path(__file__).resolve().parent / "engine_steps"
MODEL = "bench-sim-calibration"
VOCAB = 1024  # the generated model's vocabulary (SmallModelSpec's default): prompt ids stay below it
BLOCK = 32
NUM_GPU_BLOCKS = 200
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 2048
SHARED_PREFIX_TOKENS = 256
UNIQUE_TOKENS = (64, 512)
MAX_TOKENS = 32
GOAL_ERROR = 0.15
SEED = 17
PROBE_PROMPTS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536)
PROBE_BATCHES = (1, 2, 3, 5, 7)  # decoding beside the background request: 2-8 sequences
# The decode-batch probes' prompt lengths: the workload's range of contexts (a shared 256-token prefix for half,
# 64-512 unique tokens). A sequence's share of a decode step grows with the context it attends to; probes at one
# context cannot tell that cost from a per-sequence one (probes of 16 tokens fitted ~15-135 us per extra sequence
# where the workload's own steps fit ~400-600 us, and the sim's ITL came out 20-35 % short; docs/routing.md,
# calibration), probes at three let the fit part them (``per_context_token_s``).
PROBE_DECODE_PROMPT_TOKENS = (128, 384, 768)
BACKGROUND_TOKENS = 1900
METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
BUNCHED_GAP_S = 0.0003


@dataclass
class Request:
    arrival_s: float
    prompt: list[int]


@dataclass
class Outcome:
    ttft_s: float
    client_ttft_s: float
    itls_s: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def token(rng: random.Random) -> int:
    return rng.randrange(10, VOCAB)


def make_workload(num_requests: int, rate_per_s: float) -> list[Request]:
    rng = random.Random(SEED)
    shared = [token(rng) for _ in range(SHARED_PREFIX_TOKENS)]
    requests, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate_per_s)
        unique = [token(rng) for _ in range(rng.randint(*UNIQUE_TOKENS))]
        requests.append(Request(t, (shared if rng.random() < 0.5 else []) + unique))
    return requests


# ---- the client (the same for both halves) ------------------------------------------------------------------


async def stream(client: Any, url: str, prompt: list[int], max_tokens: int, time_scale: float = 1.0) -> Outcome:
    """One /generate: the engine-reported TTFT, the client's own TTFT and the client-side gaps between
    tokens (scaled to the sim's time when it runs slower than real time)."""
    import orjson

    body = {"request_id": f"c-{time.monotonic_ns()}", "prompt_token_ids": prompt, "max_tokens": max_tokens,
            "ignore_eos": True}
    arrivals: list[float] = []
    stats: dict[str, Any] = {}
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/generate", content=orjson.dumps(body), auth=ENGINE_AUTH) as response:
        async for line in response.aiter_lines():
            if not line:
                continue
            message = orjson.loads(line)
            if "t" in message:
                now = time.perf_counter()
                arrivals.extend([now] * len(message["d"]))
            elif message.get("done"):
                stats = message["stats"]
            elif "error" in message:
                raise RuntimeError(message["error"])
    gaps = [(b - a) / time_scale for a, b in itertools.pairwise(arrivals)]
    client_ttft = (arrivals[0] - sent) / time_scale if arrivals else 0.0
    return Outcome(float(stats["ttft_s"]), client_ttft, gaps, stats)


async def run_workload(url: str, requests: list[Request], time_scale: float = 1.0) -> list[Outcome]:
    import httpx

    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        start = time.perf_counter()

        async def one(request: Request) -> Outcome:
            await asyncio.sleep(max(0.0, start + request.arrival_s * time_scale - time.perf_counter()))
            return await stream(client, url, request.prompt, MAX_TOKENS, time_scale)

        return list(await asyncio.gather(*(one(r) for r in requests)))


# ---- the real engine's steps ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as vLLM's frontend heard of it (its iteration details)."""

    t_s: float  # perf_counter when the frontend received the step's outputs
    iteration_index: int  # the engine core's count of its steps (joins the step's attention work)
    num_prefill_seqs: int  # vLLM's context requests
    num_prefill_tokens: int
    num_decode_seqs: int
    num_pending: int  # running + waiting after the step: > 0 means the next step followed at once


class StepLog:
    """What the bench's stat logger hears, from vLLM's output loop (the host's thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps: list[StepRecord] = []
        self.core_itls_s: list[float] = []  # vLLM's own inter-token latencies (engine-core timestamps)

    def add(self, step: StepRecord | None, itls_s: list[float]) -> None:
        with self._lock:
            if step is not None:
                self.steps.append(step)
            self.core_itls_s.extend(itls_s)

    def take(self) -> tuple[list[StepRecord], list[float]]:
        with self._lock:
            steps, itls, self.steps, self.core_itls_s = self.steps, self.core_itls_s, [], []
        return steps, itls


def step_logger_factory(log: StepLog) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _StepLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            details = getattr(scheduler_stats, "iteration_details", None)
            step = None
            if details is not None and not details.is_dummy:
                step = StepRecord(time.perf_counter(), details.iteration_index, details.num_ctx_requests,
                                  details.num_ctx_tokens,
                                  details.num_generation_requests,
                                  scheduler_stats.num_running_reqs + scheduler_stats.num_waiting_reqs)
            log.add(step, list(getattr(iteration_stats, "inter_token_latencies_iter", []) or []))

        def log_engine_initialized(self) -> None:
            pass

    return _StepLogger


def install_step_logging(log: StepLog) -> None:
    """The host builds its engine as always (vllm_engine.build_engine), with vLLM's iteration details on and
    this bench's step logger beside the host's own loggers."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from tessera.engine import vllm_engine

    class _AsyncLLMWithSteps:
        @staticmethod
        def from_engine_args(args: Any, stat_loggers: list[Any]) -> Any:
            args.enable_logging_iteration_details = True
            return AsyncLLM.from_engine_args(args, stat_loggers=[*stat_loggers, step_logger_factory(log)])

    vllm_engine.AsyncLLM = _AsyncLLMWithSteps  # type: ignore[misc,assignment]


class CoreStep(NamedTuple):
    """One step as the engine core wrote it."""

    attention_pairs: float
    num_context_tokens: int
    core_t_s: float  # the core's perf_counter once the step's output was in (its own clock: gaps between steps)


class CoreSteps:
    """Each engine step's attention work (query-key pairs, tokens of KV read) and time, written by the engine core
    as it steps (``engine_steps/sitecustomize.py``, loaded by the processes vLLM starts after ``start``) and read
    here by iteration index."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self) -> None:
        """For the processes started from now on (vLLM spawns its engine core: a patch made in this process
        would not reach it)."""
        self.path.unlink(missing_ok=True)
        os.environ["TESSERA_BENCH_CORE_STEPS_OUT"] = str(self.path)
        os.environ["PYTHONPATH"] = first_on_pythonpath(ENGINE_STEPS_PROBE, os.environ.get("PYTHONPATH"))

    def read(self) -> dict[int, CoreStep]:
        steps: dict[int, CoreStep] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                index, pairs, context, t = line.split()
                steps[int(index)] = CoreStep(float(pairs), int(context), float(t))
        return steps


def step_samples(steps: list[StepRecord], core_steps: dict[int, CoreStep]) -> list[Any]:
    """Timed steps: each gap since the previous step on the engine core's clock, where the engine went straight
    on (no idle time), with the step's attention work as the engine core counted it (``core_steps``; a step without
    one is an error: the fit would take its decodes for free)."""
    from tessera.engine.sim.step_time_fit import StepSample

    missing = [step.iteration_index for step in steps if step.iteration_index not in core_steps]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(steps)} engine steps came without their attention work from "
                           f"the engine core (first: {missing[0]}): did engine_steps/sitecustomize.py load there?")
    samples = []
    for before, step in itertools.pairwise(steps):
        if before.num_pending == 0:
            continue
        if step.iteration_index != before.iteration_index + 1:
            continue  # a step between them went unrecorded (a dummy): the gap holds two
        shape, shape_before = core_steps[step.iteration_index], core_steps[before.iteration_index]
        k = step.num_prefill_seqs
        samples.append(StepSample(shape.core_t_s - shape_before.core_t_s, k + step.num_decode_seqs, k,
                                  step.num_prefill_tokens, shape.attention_pairs, shape.num_context_tokens))
    return samples


async def probe_steps(url: str, phase: int) -> list[Outcome]:
    """The calibration probes (module docstring, 2): a background request keeps the engine stepping while
    isolated prompts and decode batches run, in a shuffled order (so neither a prompt's length nor a batch's
    context follows the time, and with it the machine's drift or the background's growing context). Returns the
    isolated prompts' outcomes (their frontend delays). ``phase`` seeds the prompts (each phase's are new)."""
    import httpx

    rng = random.Random(SEED + 1 + 1000 * phase)
    async with httpx.AsyncClient(timeout=600.0) as client:
        long_prompt = [token(rng) for _ in range(16)]
        background = asyncio.ensure_future(stream(client, url, long_prompt, BACKGROUND_TOKENS))
        await asyncio.sleep(0.3)
        prompts = list(PROBE_PROMPTS) * 3
        rng.shuffle(prompts)
        isolated = []
        for n in prompts:
            isolated.append(await stream(client, url, [token(rng) for _ in range(n)], 1))
            await asyncio.sleep(0.02)  # a few background-only steps between probes
        batches = [(prompt_tokens, b) for prompt_tokens in PROBE_DECODE_PROMPT_TOKENS for b in PROBE_BATCHES]
        rng.shuffle(batches)
        for prompt_tokens, b in batches:
            await asyncio.gather(*(stream(client, url, [token(rng) for _ in range(prompt_tokens)], 24)
                                   for _ in range(b)))
            await asyncio.sleep(0.02)
        background.cancel()  # the host aborts a request whose client left
        await asyncio.gather(background, return_exceptions=True)
    await asyncio.sleep(0.5)
    return isolated


async def warm_up(url: str) -> None:
    import httpx

    rng = random.Random(SEED + 2)
    async with httpx.AsyncClient(timeout=600.0) as client:
        for n in (64, 1536, 512):
            await stream(client, url, [token(rng) for _ in range(n)], 8)
        await asyncio.gather(*(stream(client, url, [token(rng) for _ in range(64)], 16) for _ in range(8)))


def run_real(requests: list[Request], repeats: int) -> dict[str, Any]:
    """Starts the real CPU engine (vLLM), probes its steps, runs the workload ``repeats`` times, stops it."""
    from tessera.engine.config import EngineConfig
    from tessera.engine.host import EngineHost
    from tessera.engine.small_model import SmallModelSpec

    bench_model(MODEL_DIR.name, SmallModelSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                                               num_attention_heads=8, num_key_value_heads=4, seed=1))
    log = StepLog()
    install_step_logging(log)
    core_steps = CoreSteps(RESULTS.parent / "sim_calibration_core_steps.txt")
    core_steps.start()
    config = EngineConfig.model_validate({
        "model": str(MODEL_DIR), "served_model_name": MODEL, "num_gpu_blocks_override": NUM_GPU_BLOCKS,
        "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK, "speculative": None, "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    })
    host = EngineHost(config, None).start()

    def reset_prefix_cache() -> None:
        assert host._loop is not None
        asyncio.run_coroutine_threadsafe(host.engine.reset_prefix_cache(), host._loop).result(timeout=60)

    try:
        asyncio.run(warm_up(host.url))
        log.take()
        # Probes before each workload run, not once before all: this machine's pace drifts by 20-40 % within
        # minutes (the same workload twice: ITL p50 3.2 then 4.5 ms), and step costs probed in one spell
        # configured a sim that met another (docs/routing.md, calibration). Pooled, the probes meet the same
        # spells as the runs whose median the sim is compared with.
        probe: list[list[StepRecord]] = []
        probe_outcomes: list[Outcome] = []
        runs = []
        for repeat in range(repeats):
            reset_prefix_cache()
            log.take()
            probe_outcomes += asyncio.run(probe_steps(host.url, repeat))
            probe.append(log.take()[0])
            reset_prefix_cache()
            log.take()
            load = os.getloadavg()[0]
            outcomes = asyncio.run(run_workload(host.url, requests))
            steps, core_itls = log.take()
            runs.append({"load_average_1m": load, "outcomes": outcomes, "steps": steps, "core_itls_s": core_itls})
            print(f"real run {repeat + 1}/{repeats}: {fmt_summary(summarize(outcomes))} (load {load:.2f})",
                  flush=True)
        return {"probe_steps": probe, "probe_outcomes": probe_outcomes, "runs": runs, "core_steps": core_steps.read()}
    finally:
        host.stop()
        core_steps.path.unlink(missing_ok=True)


# ---- the sim -------------------------------------------------------------------------------------------------


def run_sim(costs: dict[str, float], requests: list[Request], time_scale: float,
            frontend_delays_s: list[float]) -> tuple[list[Outcome], int]:
    """The workload against one simulated replica (its requests reach the scheduler after one of
    ``frontend_delays_s``, drawn per request): its outcomes and how many steps it took."""
    from tessera.engine.sim.config import SimEngineConfig
    from tessera.engine.sim.fleet import SimFleet

    config = SimEngineConfig.model_validate({
        "served_model_name": MODEL, "block_size": BLOCK, "num_gpu_blocks": NUM_GPU_BLOCKS,
        "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "time_scale": time_scale, "vocab_size": VOCAB,
        "step_time": {"kind": "measured", **costs}, "frontend_delays_s": frontend_delays_s, "frontend_seed": SEED,
    })

    async def run() -> tuple[list[Outcome], int]:
        fleet = await SimFleet(config, 1, redis_url=None).start()
        try:
            return await run_workload(fleet.replicas[0].url, requests, time_scale), fleet.replicas[0].engine.num_steps
        finally:
            await fleet.stop()

    return asyncio.run(run())


# ---- figures ---------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def summarize(outcomes: list[Outcome]) -> dict[str, float]:
    ttfts = [o.ttft_s for o in outcomes]
    itls = [g for o in outcomes for g in o.itls_s]
    client = [o.client_ttft_s for o in outcomes]
    # The engine core's own part of TTFT (queue + prefill, core clock): the real engine's TTFT without its
    # frontend; the sim's is its TTFT.
    core = [o.stats.get("queued_s", 0.0) + o.stats.get("prefill_s", 0.0) for o in outcomes]
    return {"core_ttft_p50_s": percentile(core, 50), "core_ttft_p99_s": percentile(core, 99),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            "client_ttft_p50_s": percentile(client, 50), "client_ttft_p99_s": percentile(client, 99),
            # Gaps under BUNCHED_GAP_S: two tokens that reached the client together (a late step's delivery).
            "bunched_gaps_share": sum(g < BUNCHED_GAP_S for g in itls) / len(itls) if itls else float("nan"),
            "itl_mean_s": statistics.fmean(itls) if itls else float("nan")}


def per_request(outcomes: list[Outcome]) -> dict[str, Any]:
    """Each request's TTFT and gaps between tokens (microseconds), kept in the results so a later look at a tail
    can say which requests and steps made it."""
    return {"ttfts_s": [o.ttft_s for o in outcomes], "itls_us": [[round(g * 1e6) for g in o.itls_s] for o in outcomes]}


def fmt_summary(summary: dict[str, Any]) -> str:
    return "  ".join(f"{k.removesuffix('_s')} {summary[k] * 1000:.1f} ms" for k in METRICS)


def frontend_overhead_s(outcomes: list[Outcome]) -> list[float]:
    """Real engine: TTFT minus the engine core's own queue + prefill time (input processing, the two IPC
    hops and output processing: what no step-time model holds)."""
    return [o.ttft_s - o.stats["queued_s"] - o.stats["prefill_s"] for o in outcomes
            if o.stats.get("prefill_s")]


def fit_report(name: str, config: Any, own: list[Any], other: list[Any], other_name: str) -> dict[str, Any]:
    from tessera.engine.sim.step_time_fit import relative_errors

    report = {"costs": config.model_dump(exclude={"kind", "jitter_factors", "jitter_s", "jitter_seed"}),
              "num_samples": len(own)}
    for label, samples in (("own", own), (other_name, other)):
        errors = sorted(abs(e) for e in relative_errors(config, samples))
        report[f"abs_rel_error_{label}"] = {"p50": percentile(errors, 50), "p90": percentile(errors, 90)}
    costs = ", ".join(f"{k} {v:.3g}" for k, v in report["costs"].items())
    print(f"step costs fitted on {name} ({len(own)} steps): {costs}")
    for label in ("own", other_name):
        e = report[f"abs_rel_error_{label}"]
        print(f"    |step error| on {label} steps: p50 {e['p50']:.1%}  p90 {e['p90']:.1%}")
    return report


def compare(real_runs: list[dict[str, Any]], sim_runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    print(f"{'metric':<18} {'real (median; min-max of runs)':>34} {'sim':>10} {'error':>8}")
    for key in [*METRICS, "core_ttft_p50_s", "core_ttft_p99_s", "client_ttft_p50_s", "client_ttft_p99_s",
                "itl_mean_s"]:
        reals = [r[key] for r in real_runs if key in r]
        if not reals:
            continue
        real = statistics.median(reals)
        sim = statistics.median(s[key] for s in sim_runs)
        error = abs(sim - real) / real if real else float("inf")
        rows[key] = {"real": real, "real_min": min(reals), "real_max": max(reals), "sim": sim, "error": error}
        spread = f"{real * 1000:.1f} ms ({min(reals) * 1000:.1f}-{max(reals) * 1000:.1f})"
        goal = "" if key in METRICS else "  (diagnostic)"
        print(f"{key.removesuffix('_s'):<18} {spread:>34} {sim * 1000:>7.1f} ms {error:>7.1%}{goal}")
    reals = [r["bunched_gaps_share"] for r in real_runs if "bunched_gaps_share" in r]
    if reals:
        sims = [s["bunched_gaps_share"] for s in sim_runs]
        print(f"gaps under {BUNCHED_GAP_S * 1e3:.1f} ms (two tokens together): real "
              f"{' / '.join(f'{r:.1%}' for r in reals)}, sim {' / '.join(f'{x:.1%}' for x in sims)}  (diagnostic)")
        rows["bunched_gaps_share"] = {"real": reals, "sim": sims}
    return rows


def paired_ttft_errors(real_runs: list[dict[str, Any]], sim_ttfts: list[float]) -> dict[str, float]:
    """The same request's TTFT in the sim against its median over the real runs: (sim − real) / real."""
    runs = [r["ttfts_s"] for r in real_runs if len(r.get("ttfts_s", [])) == len(sim_ttfts)]
    if not runs:
        return {}
    errors = sorted((sim - statistics.median(reals)) / statistics.median(reals)
                    for sim, *reals in zip(sim_ttfts, *runs, strict=True) if statistics.median(reals) > 0)
    return {"p10": percentile(errors, 10), "p50": percentile(errors, 50), "p90": percentile(errors, 90)}


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim-only", action="store_true",
                        help="Skip the real engine: refit from the saved results' probe steps (or --step-costs) "
                             "and compare with their real figures.")
    parser.add_argument("--step-costs", help="MeasuredStepTime fields as JSON (instead of the fit).")
    parser.add_argument("--terms", default="step_s,per_seq_s,per_prefill_token_s,per_prefill_seq_s,"
                                           "per_attention_pair_s,per_context_token_s", help="Step-time terms to fit.")
    parser.add_argument("--fit-on", choices=("workload", "held-out", "probes"), default="workload",
                        help="Which real steps configure the sim: the workload runs' own (default; the latencies "
                             "compared are not fitted: they come of the sim's queueing, batching and chunked "
                             "prefill), the first run's only, compared with the other runs' figures only "
                             "(held-out), or the probes' (a different mix of requests; the others are the check).")
    parser.add_argument("--jitter", choices=("add", "scale", "none"), default="add",
                        help="The measured spread of the fitted steps' times around the model (this machine's "
                             "noise), drawn per step, seeded: as seconds added (add, the default: interruptions "
                             "add time whatever the step computes), as a factor (scale: stretches a long prefill "
                             "as much as a decode; overshoots the TTFT tail), or none.")
    parser.add_argument("--frontend", choices=("probes", "workload", "none"), default="probes",
                        help="Which real requests' frontend delays (TTFT - core queue - core prefill) the sim's "
                             "requests draw theirs from: the probes' isolated prompts (default), the workload's "
                             "own requests (in-sample), or none.")
    # 300 at four a second: the same 75 s of traffic as 150 at two, and a TTFT p99 that is the third slowest request,
    # not the second (at 150 the sim's own three runs read it 50.5-67.4 ms apart).
    parser.add_argument("--num-requests", type=int, default=300)
    # Four a second: at two, ~1 % of the gaps are decodes beside another request's prefill, so the ITL p99 sat on
    # the knee where those begin and the real engine's own two runs read it 17-28 % apart; at four they are ~2 %,
    # the p99 falls inside them and the real runs agree within ~11 % (docs/routing.md, "The jitter's tail, and
    # the knee").
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second.")
    parser.add_argument("--repeats", type=int, default=2, help="Real workload runs (the spread is reported).")
    parser.add_argument("--sim-repeats", type=int, default=3,
                        help="Sim runs, each with its own noise seed; the median of their figures is compared.")
    # Three wall seconds a sim second: the replica shares the bench's process and event loop with the client, and at
    # one its steps' tokens often left a step late (3.5-4.4 % of the gaps under 0.3 ms against the real engine's
    # 1.4-1.6 %; decode time 4 % short); at three, 0.4-0.8 % (docs/routing.md, "The jitter's tail, and the knee").
    parser.add_argument("--time-scale", type=float, default=3.0, help="The sim's wall seconds per sim second.")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    from tessera.engine.sim.step_time import MeasuredStepTime
    from tessera.engine.sim.step_time_fit import StepSample, fit_measured_step_time, jitter_factors, jitter_seconds

    saved = json.loads(args.results.read_text()) if args.sim_only else {}
    if saved:  # the sim meets the workload the saved real half ran, whatever the flags say
        args.num_requests = saved["workload"]["num_requests"]
        args.rate = saved["workload"]["rate_per_s"]
    requests = make_workload(args.num_requests, args.rate)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    if args.sim_only:
        probe = [StepSample(**s) for s in saved["probe_samples"]]
        workload = [StepSample(**s) for s in saved["workload_samples"]]
        by_run = [[StepSample(**s) for s in run] for run in saved.get("workload_samples_by_run", [])]
        real_summaries = saved["real"]["runs"]
        real_extra = {k: v for k, v in saved["real"].items() if k != "runs"}
        frontends = {"probes": saved.get("probe_frontend_s"), "workload": saved.get("workload_frontend_s")}
    else:
        real = run_real(requests, args.repeats)
        probe = [s for phase in real["probe_steps"] for s in step_samples(phase, real["core_steps"])]
        by_run = [step_samples(run["steps"], real["core_steps"]) for run in real["runs"]]
        workload = [s for run in by_run for s in run]
        real_summaries = [{**summarize(r["outcomes"]), "load_average_1m": r["load_average_1m"],
                           "num_steps": len(r["steps"]), **per_request(r["outcomes"])} for r in real["runs"]]
        overheads = sorted(o for r in real["runs"] for o in frontend_overhead_s(r["outcomes"]))
        frontends = {"probes": sorted(frontend_overhead_s(real["probe_outcomes"])), "workload": overheads}
        core_itls = sorted(i for r in real["runs"] for i in r["core_itls_s"])
        real_extra = {"frontend_overhead_p50_s": percentile(overheads, 50),
                      "frontend_overhead_p90_s": percentile(overheads, 90),
                      "core_itl_p50_s": percentile(core_itls, 50), "core_itl_p99_s": percentile(core_itls, 99)}
        # The real half is the expensive one: kept at once, so ``--sim-only`` can go on from it whatever follows.
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({
            "date": started, "real_date": started, "real": {"runs": real_summaries, **real_extra},
            "probe_samples": [asdict(s) for s in probe], "workload_samples": [asdict(s) for s in workload],
            "workload_samples_by_run": [[asdict(s) for s in run] for run in by_run],
            "probe_frontend_s": frontends["probes"], "workload_frontend_s": frontends["workload"]}))
    terms = [t.strip() for t in args.terms.split(",") if t.strip()]
    fits = {"probes": fit_report("probes", fit_measured_step_time(probe, terms), probe, workload, "workload"),
            "workload": fit_report("workload", fit_measured_step_time(workload, terms), workload, probe, "probes")}
    if len(by_run) >= 2:
        held_out = [s for run in by_run[1:] for s in run]
        fits["held-out"] = fit_report("the first run", fit_measured_step_time(by_run[0], terms), by_run[0], held_out,
                                      "later runs")
    elif args.fit_on == "held-out":
        raise SystemExit("--fit-on held-out needs two real runs' steps apart (--repeats 2; results saved before "
                         "2026-12-07 pool them)")
    # Held out, the sim is compared with the runs it was not fitted on.
    compared = real_summaries[1:] if args.fit_on == "held-out" else real_summaries
    costs = json.loads(args.step_costs) if args.step_costs else dict(fits[args.fit_on]["costs"])
    if args.jitter != "none" and not args.step_costs:
        # The machine's noise as the real engine met it, on the steps the costs were fitted on.
        fitted = MeasuredStepTime(**costs)
        jitter_steps = {"probes": probe, "held-out": by_run[0] if by_run else []}.get(args.fit_on, workload)
        costs["jitter_seed"] = SEED
        if args.jitter == "scale":
            costs["jitter_factors"] = list(jitter_factors(fitted, jitter_steps))
            print("step jitter (measured/modelled) at p10/p50/p90/p99: " + " / ".join(
                f"{percentile(costs['jitter_factors'], q):.2f}" for q in (10, 50, 90, 99)))
        else:
            costs["jitter_s"] = list(jitter_seconds(fitted, jitter_steps))
            print("step jitter (measured - modelled) at p10/p50/p90/p99: " + " / ".join(
                f"{percentile(costs['jitter_s'], q) * 1000:+.2f} ms" for q in (10, 50, 90, 99)))
    MeasuredStepTime(**costs)  # a typo in --step-costs fails here, not in the sim
    print(f"real engine: frontend overhead (TTFT - core queue - core prefill) p50 "
          f"{real_extra.get('frontend_overhead_p50_s', float('nan')) * 1000:.2f} ms, p90 "
          f"{real_extra.get('frontend_overhead_p90_s', float('nan')) * 1000:.2f} ms; its own ITL (core clock) "
          f"p50 {real_extra.get('core_itl_p50_s', float('nan')) * 1000:.2f} ms, p99 "
          f"{real_extra.get('core_itl_p99_s', float('nan')) * 1000:.2f} ms", flush=True)
    frontend_delays = [] if args.frontend == "none" else frontends.get(args.frontend)
    if frontend_delays is None:
        raise SystemExit(f"the saved real half has no {args.frontend} frontend delays (it predates them): "
                         "run without --sim-only, or pass --frontend none")
    if frontend_delays:
        print(f"sim frontend delays: {len(frontend_delays)} from the {args.frontend}, p50 "
              f"{percentile(frontend_delays, 50) * 1000:.2f} ms, p90 {percentile(frontend_delays, 90) * 1000:.2f} ms")
    sim_summaries: list[dict[str, Any]] = []
    for repeat in range(args.sim_repeats):
        # A seed of its own a run: the ITL p99 sits where the ~1 % of gaps beside another request's prefill begin,
        # so one run's figure moves with which steps drew the noise's tail; the median of several holds still.
        seeded = {**costs, "jitter_seed": SEED + repeat}
        outcomes, num_steps = run_sim(seeded, requests, args.time_scale, frontend_delays)
        sim_summaries.append({**summarize(outcomes), "num_steps": num_steps, **per_request(outcomes)})
        print(f"sim run {repeat + 1}/{args.sim_repeats}: {fmt_summary(sim_summaries[-1])}", flush=True)
    shown = {k: v for k, v in costs.items() if k not in ("jitter_factors", "jitter_s")}
    jittered = "jitter_factors" in costs or "jitter_s" in costs
    print(f"sim configured with: {json.dumps(shown)} (fitted on {args.fit_on if not args.step_costs else '-'}"
          f"{f', with jitter ({args.jitter})' if jittered else ''})")
    print(f"engine steps per workload run: real {[r.get('num_steps') for r in compared]}, "
          f"sim {[r['num_steps'] for r in sim_summaries]}")
    rows = compare(compared, sim_summaries)
    paired = paired_ttft_errors(compared, sim_summaries[0]["ttfts_s"])
    if paired:
        print(f"request by request, sim TTFT vs real: median {paired['p50']:+.1%}, "
              f"10th-90th percentile {paired['p10']:+.1%} to {paired['p90']:+.1%}")
    met = all(rows[k]["error"] <= GOAL_ERROR for k in METRICS)
    print(f"goal (TTFT and ITL p50/p99 within {GOAL_ERROR:.0%} of the real median"
          f"{', the runs held out' if args.fit_on == 'held-out' else ''}): {'met' if met else 'NOT met'}")
    result = {
        "date": started, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "workload": {"num_requests": args.num_requests, "rate_per_s": args.rate, "max_tokens": MAX_TOKENS,
                     "shared_prefix_tokens": SHARED_PREFIX_TOKENS, "unique_tokens": UNIQUE_TOKENS, "seed": SEED},
        "sim_costs": costs, "fit_on": args.fit_on if not args.step_costs else "given", "fits": fits,
        "frontend": args.frontend, "probe_frontend_s": frontends.get("probes"),
        "workload_frontend_s": frontends.get("workload"),
        "real": {"runs": real_summaries, **real_extra}, "sim": {"runs": sim_summaries}, "comparison": rows,
        "goal_met": met, "paired_ttft_error": paired, "probe_samples": [asdict(s) for s in probe],
        "workload_samples": [asdict(s) for s in workload],
        "workload_samples_by_run": [[asdict(s) for s in run] for run in by_run],
    }
    if args.sim_only:
        result["real_date"] = saved.get("real_date", saved.get("date"))
    else:
        result["real_date"] = started
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
