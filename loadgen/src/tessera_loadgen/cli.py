"""``tessera-loadgen``: run, sweep, mock-server, validate, report."""

# NOTE: the commands import what they use when they run (pydantic and YAML for a workload, numpy and uvloop
# for a run), so ``tessera-loadgen --help`` costs only argparse. (No note in the docstring: it is --help's text.)

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessera_loadgen.client import Target
    from tessera_loadgen.tokenizer_spec import TokenizerSpec
    from tessera_loadgen.workload import Workload

DEFAULT_RUNS_DIR = Path("runs")


def _raise_fd_limit() -> None:
    # An open-loop client facing a slow server holds one socket per request in flight.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _keys(pairs: Sequence[str]) -> dict[str, str]:
    keys = {}
    for pair in pairs:
        tenant, sep, key = pair.partition("=")
        if not sep or not tenant:
            raise SystemExit(f"--key expects TENANT=KEY, got {pair!r}")
        keys[tenant] = key
    return keys


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _load(args: argparse.Namespace, require_target: bool = True) -> Workload:
    from tessera_loadgen.workload import Workload, load_workload

    workload = load_workload(args.workload)
    updates: dict[str, Any] = {}
    for field in ("model", "seed", "duration_s", "num_requests", "warmup_s"):
        value = getattr(args, field, None)
        if value is not None:
            updates[field] = value
    if getattr(args, "target", None):
        updates["target"] = args.target
    data = workload.model_dump() | updates
    workload = Workload.model_validate(data)
    if args.key:
        workload = workload.with_keys(_keys(args.key))
    if workload.target is None and require_target:
        raise SystemExit("no target: pass --target URL or set 'target' in the workload")
    return workload


def _warn_context(workload: Workload, max_model_len_by_tenant: dict[str, int], models: dict[str, str] | None) -> int:
    """Print a warning for every class that cannot fit its model's context; returns how many."""
    from tessera_loadgen.context_check import context_overflows

    overflows = context_overflows(workload, max_model_len_by_tenant, models)
    for overflow in overflows:
        _warn(overflow.message())
    return len(overflows)


def _prepare(
    args: argparse.Namespace, workload: Workload, target: Target
) -> tuple[dict[str, str], dict[str, TokenizerSpec]]:
    """Each tenant's model and each model's tokenizer (``--tokenizer``); says which lengths are exact."""
    from tessera_loadgen.runner import resolve_models, run_in_loop
    from tessera_loadgen.tokenizer_source import resolve_tokenizers

    models = run_in_loop(resolve_models(workload, target))
    resolution = run_in_loop(resolve_tokenizers(args.tokenizer, target, workload, models))
    for message in resolution.warnings:
        _warn(message)
    for model, found in resolution.specs.items():
        print(f"prompt lengths for {model} in its tokens (tokenizer: {found.source})", file=sys.stderr)
    limits = {
        tenant: spec.max_model_len
        for tenant, model in models.items()
        if (spec := resolution.specs.get(model)) is not None and spec.max_model_len is not None
    }
    _warn_context(workload, limits, models)
    return models, resolution.specs


def _run_dir(args: argparse.Namespace, workload: Workload) -> Path:
    if args.out:
        return Path(args.out)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return DEFAULT_RUNS_DIR / f"{workload.name}-{stamp}"


def cmd_run(args: argparse.Namespace) -> int:
    from tessera_loadgen.client import Target
    from tessera_loadgen.execute import execute
    from tessera_loadgen.results import format_prompt_lengths, format_table

    workload = _load(args)
    assert workload.target is not None
    target = Target.parse(workload.target)
    models, tokenizers = _prepare(args, workload, target)
    run_dir = _run_dir(args, workload)
    output = execute(
        workload,
        target,
        run_dir,
        num_workers=args.workers,
        progress=not args.no_progress,
        plots=not args.no_plots,
        models=models,
        tokenizers=tokenizers,
    )
    print(format_table(output.result["summary"]))
    print()
    print(format_prompt_lengths(output.result["summary"], output.result["run"]["prompt_lengths"]))
    print(f"results: {run_dir}")
    overall = output.result["summary"]["overall"]
    if overall["client_lagging"]:
        print(
            "warning: the client itself was late (schedule-lag p99 above 5 ms); try --workers",
            file=sys.stderr,
        )
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from tessera_loadgen.client import Target
    from tessera_loadgen.execute import execute
    from tessera_loadgen.sweep import format_points, geometric_rates, run_sweep

    workload = _load(args)
    assert workload.target is not None
    target = Target.parse(workload.target)
    models, tokenizers = _prepare(args, workload, target)
    if args.rates:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    elif args.start and args.max:
        rates = geometric_rates(args.start, args.factor, args.max)
    else:
        raise SystemExit("give --rates R1,R2,... or --start R --max R [--factor F]")
    out_dir = _run_dir(args, workload)

    def run_point(scaled: Workload, run_dir: Path) -> dict[str, Any]:
        output = execute(
            scaled,
            target,
            run_dir,
            num_workers=args.workers,
            progress=not args.no_progress,
            plots=False,
            models=models,
            tokenizers=tokenizers,
        )
        summary: dict[str, Any] = output.result["summary"]
        return summary

    def show(point: Any) -> None:
        print(
            f"rate {point.rate_rps:g} req/s: achieved {point.achieved_rate_rps or 0:.1f}, "
            f"attainment {(point.slo_attainment or 0) * 100:.1f}%, {'ok' if point.ok else 'FAILED'}",
            flush=True,
        )

    points, best = run_sweep(workload, rates, out_dir, run_point, refine_steps=args.refine, on_point=show)
    print(format_points(points, best))
    print(f"results: {out_dir}")
    return 0


def cmd_mock_server(args: argparse.Namespace) -> int:
    from tessera_loadgen.mock_server import MockConfig, serve

    config = MockConfig(
        model=args.model,
        ttft_s=args.ttft_s,
        itl_s=args.itl_s,
        tokens_per_chunk=args.tokens_per_chunk,
        default_max_tokens=args.default_max_tokens,
        error_rate=args.error_rate,
        error_status=args.error_status,
        reject_rate=args.reject_rate,
        retry_after_s=None if args.retry_after_s.lower() == "none" else float(args.retry_after_s),
        break_rate=args.break_rate,
        stall_after_requests=args.stall_after_requests,
        stall_s=args.stall_s,
        seed=args.seed,
    )
    try:
        serve(config, args.host, args.port, args.workers)
    except KeyboardInterrupt:
        pass
    return 0


def _context_limits(args: argparse.Namespace, workload: Workload) -> tuple[dict[str, int], dict[str, str] | None, str]:
    """Each tenant's ``max_model_len`` for validate, the tenants' models where known, and where the limits
    came from (or, with no limits, why there are none)."""
    from tessera_loadgen.tokenizer_source import TOKENIZER_AUTO, TOKENIZER_NONE

    if args.max_model_len is not None:
        return dict.fromkeys((t.name for t in workload.tenants), args.max_model_len), None, "--max-model-len"
    if args.tokenizer not in (TOKENIZER_AUTO, TOKENIZER_NONE):
        from tessera_loadgen.tokenizer_spec import context_length_from_config

        length = context_length_from_config(Path(args.tokenizer))
        if length is None:
            return {}, None, f"{args.tokenizer} has no config.json with a context length"
        return dict.fromkeys((t.name for t in workload.tenants), length), None, f"{args.tokenizer}/config.json"
    if args.tokenizer == TOKENIZER_NONE or workload.target is None:
        return {}, None, "pass --max-model-len N, --tokenizer DIR, or --target URL of a Tessera gateway"
    from tessera_loadgen.client import Target
    from tessera_loadgen.runner import resolve_models, run_in_loop
    from tessera_loadgen.tokenizer_source import resolve_tokenizers

    target = Target.parse(workload.target)
    # NOTE: any failure is caught: the server check is optional, and the file itself was valid.
    try:
        models = run_in_loop(resolve_models(workload, target))
    except Exception as exc:
        return {}, None, f"could not list the models of {target.url} ({type(exc).__name__}: {exc})"
    resolution = run_in_loop(resolve_tokenizers(TOKENIZER_AUTO, target, workload, models))
    limits = {
        tenant: spec.max_model_len
        for tenant, model in models.items()
        if (spec := resolution.specs.get(model)) is not None and spec.max_model_len is not None
    }
    if not limits:
        reasons = "; ".join(resolution.warnings) or "the server gave no context length"
        return {}, models, f"{reasons}; or pass --max-model-len N"
    return limits, models, f"{target.url}/v1/models/*/tokenizer"


def cmd_validate(args: argparse.Namespace) -> int:
    workload = _load(args, require_target=False)
    rate = workload.open_loop_rate_rps()
    print(f"{args.workload}: ok, {len(workload.tenants)} tenants, open-loop total {rate:g} req/s")
    limits, models, source = _context_limits(args, workload)
    if not limits:
        print(f"context lengths not checked: {source}")
        return 0
    num_overflows = _warn_context(workload, limits, models)
    checked = ", ".join(sorted({str(n) for n in limits.values()}))
    verdict = (
        f"{num_overflows} class{'es' if num_overflows > 1 else ''} can exceed it"
        if num_overflows
        else "every class fits"
    )
    print(f"context: max_model_len {checked} (from {source}); {verdict}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from tessera_loadgen.results import format_prompt_lengths, format_table, load_result

    result = load_result(Path(args.run_dir))
    if args.json:
        print(json.dumps(result["summary"], indent=2))
    else:
        print(format_table(result["summary"]))
        print()
        print(format_prompt_lengths(result["summary"], result["run"].get("prompt_lengths")))
    return 0


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument("--target", help="server root URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--out", help="run directory (default: runs/NAME-TIMESTAMP)")
    parser.add_argument("--key", action="append", default=[], metavar="TENANT=KEY", help="API key of a tenant")
    parser.add_argument("--model", help="default model for tenants that set none")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--duration", dest="duration_s", type=float, help="measured seconds")
    parser.add_argument("--num-requests", type=int, help="measured requests")
    parser.add_argument("--warmup", dest="warmup_s", type=float, help="warm-up seconds")
    parser.add_argument("--workers", type=int, default=1, help="client processes (for rates beyond one core)")
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")
    _add_tokenizer(parser)


TOKENIZER_HELP = (
    "count prompt lengths in the model's tokens: 'auto' fetches each model's tokenizer from the Tessera "
    "gateway (GET /v1/models/MODEL/tokenizer), DIR is a local Hugging Face model directory, 'none' counts "
    "words (approximate). Default: auto, approximate with a warning where unavailable"
)
VALIDATE_TOKENIZER_HELP = (
    "where max_model_len comes from: 'auto' asks the gateway given by --target or the workload, DIR reads "
    "a local model directory's config.json, 'none' skips the context check (unless --max-model-len)"
)


def _add_tokenizer(parser: argparse.ArgumentParser, help_text: str = TOKENIZER_HELP) -> None:
    parser.add_argument("--tokenizer", default="auto", metavar="auto|none|DIR", help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera-loadgen", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a workload and write a run directory")
    _add_overrides(run)
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    run.set_defaults(func=cmd_run)

    sweep = commands.add_parser("sweep", help="run at increasing rates; report the highest meeting the SLOs")
    _add_overrides(sweep)
    sweep.add_argument("--rates", help="comma-separated total rates, req/s")
    sweep.add_argument("--start", type=float, help="first rate of a geometric series")
    sweep.add_argument("--factor", type=float, default=1.5, help="ratio of the series (default 1.5)")
    sweep.add_argument("--max", type=float, help="last rate of the series")
    sweep.add_argument("--refine", type=int, default=2, help="bisection steps after the first failure")
    sweep.set_defaults(func=cmd_sweep)

    mock = commands.add_parser("mock-server", help="OpenAI-compatible mock server with known timing")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, default=8100, help="0 picks a free port (printed)")
    mock.add_argument("--workers", type=int, default=1)
    mock.add_argument("--model", default="mock-model")
    mock.add_argument("--ttft-s", type=float, default=0.0, help="time to first token")
    mock.add_argument("--itl-s", type=float, default=0.0, help="delay per token")
    mock.add_argument("--tokens-per-chunk", type=int, default=1)
    mock.add_argument("--default-max-tokens", type=int, default=16)
    mock.add_argument("--error-rate", type=float, default=0.0)
    mock.add_argument("--error-status", type=int, default=500)
    mock.add_argument("--reject-rate", type=float, default=0.0, help="share of requests answered 429")
    mock.add_argument("--retry-after-s", default="1", help="Retry-After of a 429, or 'none'")
    mock.add_argument("--break-rate", type=float, default=0.0, help="share of streams cut mid-way")
    mock.add_argument("--stall-after-requests", type=int, help="stall once at the Nth request")
    mock.add_argument("--stall-s", type=float, default=0.0, help="stall length")
    mock.add_argument("--seed", type=int, default=0)
    mock.set_defaults(func=cmd_mock_server)

    validate = commands.add_parser(
        "validate", help="check a workload file, and that every class fits the model's context"
    )
    validate.add_argument("workload")
    validate.add_argument("--max-model-len", type=int, help="the model's context length, tokens")
    validate.add_argument("--target", help="a Tessera gateway to ask for each model's context length")
    validate.add_argument("--key", action="append", default=[], metavar="TENANT=KEY", help="API key of a tenant")
    validate.add_argument("--model", help="default model for tenants that set none")
    _add_tokenizer(validate, VALIDATE_TOKENIZER_HELP)
    validate.set_defaults(func=cmd_validate)

    report = commands.add_parser("report", help="print the summary of a run directory")
    report.add_argument("run_dir")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pydantic import ValidationError

    _raise_fd_limit()
    try:
        code: int = args.func(args)
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Before a run starts (model discovery, tokenizer fetch); during a run, execute handles Ctrl-C.
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
