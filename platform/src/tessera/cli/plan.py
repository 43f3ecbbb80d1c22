"""``tessera plan train | diagnose | serve``: the planner on the command line.

Each command prints tables, or with ``--json`` one JSON object (keys in docs/planner.md). The tables are
rendered from the same dictionaries as the JSON (``tessera.planner.report``, ``tessera.cli.plan_tables``).

NOTE: the planner, pydantic and rich are imported inside the commands: this module is loaded for every
``tessera`` invocation (typer needs the signatures), and ``--help`` should cost none of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from pydantic import ValidationError

plan_app = typer.Typer(
    no_args_is_help=True, help="Capacity and performance planning: train, diagnose, serve."
)

ModelOption = Annotated[
    str,
    typer.Option("--model", help="Preset name (e.g. llama-3-70b) or a Hugging Face config.json / model dir."),
]
GpuOption = Annotated[str, typer.Option("--gpu", help="a100-40gb, a100-80gb, h100-sxm or h200.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


def _print_json(report: dict[str, Any]) -> None:
    typer.echo(json.dumps(report, indent=2))


@plan_app.command("train")
def train(
    model: ModelOption,
    gpu: GpuOption = "h100-sxm",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 8192,
    micro_batch: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 1,
    num_microbatches: Annotated[int, typer.Option(help="Micro-batches per step per DP rank.")] = 1,
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel degree.")] = 1,
    dp: Annotated[int, typer.Option(help="Data-parallel degree.")] = 1,
    cp: Annotated[int, typer.Option(help="Context-parallel degree.")] = 1,
    sp: Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism.")] = True,
    virtual_stages: Annotated[int, typer.Option(help="Interleaved chunks per stage.")] = 1,
    zero: Annotated[int, typer.Option(help="ZeRO stage 0-3.")] = 1,
    recompute: Annotated[str, typer.Option(help="none, selective or full.")] = "selective",
    flash: Annotated[bool, typer.Option("--flash/--no-flash", help="Fused (Flash) attention.")] = True,
    attention: Annotated[str, typer.Option(help="MFU/HFU convention: 6N, causal or full.")] = "causal",
    tokens_per_s: Annotated[float | None, typer.Option(help="Measured global throughput, tokens/s.")] = None,
    step_time: Annotated[float | None, typer.Option(help="Measured step time, seconds.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Parameters, FLOPs, memory per GPU, communication, bubble, and MFU/HFU of a training run."""
    from pydantic import ValidationError
    from rich.console import Console

    from tessera.cli.plan_tables import render_training
    from tessera.planner import TrainingSetup, get_gpu, plan_training, resolve_model
    from tessera.planner.report import training_report

    try:
        setup = TrainingSetup.model_validate(
            {
                "seq_len": seq_len,
                "micro_batch_size": micro_batch,
                "num_microbatches": num_microbatches,
                "tp": tp,
                "pp": pp,
                "dp": dp,
                "cp": cp,
                "sequence_parallel": sp,
                "virtual_stages": virtual_stages,
                "zero_stage": zero,
                "recompute": recompute,
                "flash_attention": flash,
                "attention": attention,
            }
        )
        plan = plan_training(
            resolve_model(model), get_gpu(gpu), setup, tokens_per_s=tokens_per_s, step_time_s=step_time
        )
    except ValidationError as exc:
        raise _fail(_validation_message(exc)) from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    report = training_report(plan)
    if as_json:
        _print_json(report)
    else:
        render_training(report, Console())


@plan_app.command("diagnose")
def diagnose_command(
    model: ModelOption,
    mfu: Annotated[float, typer.Option("--mfu", help="Reported MFU, percent.")],
    hfu: Annotated[float, typer.Option("--hfu", help="Reported HFU, percent.")],
    seq_len: Annotated[int, typer.Option(help="Training sequence length, tokens.")],
    gpu: GpuOption = "h100-sxm",
    tolerance: Annotated[float, typer.Option(help="Rounding of the reported numbers, points.")] = 0.5,
    tokens_per_s_per_gpu: Annotated[
        float | None, typer.Option(help="Measured tokens/s per GPU, if known.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Explain a measured MFU/HFU pair; flag pairs no consistent accounting allows."""
    from pydantic import ValidationError
    from rich.console import Console

    from tessera.cli.plan_tables import render_diagnosis
    from tessera.planner import MeasuredPair, diagnose, get_gpu, resolve_model
    from tessera.planner.report import diagnosis_report

    try:
        pair = MeasuredPair(
            mfu_percent=mfu,
            hfu_percent=hfu,
            seq_len=seq_len,
            tolerance_points=tolerance,
            tokens_per_s_per_gpu=tokens_per_s_per_gpu,
        )
        shape, spec = resolve_model(model), get_gpu(gpu)
    except ValidationError as exc:
        raise _fail(_validation_message(exc)) from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    report = diagnosis_report(diagnose(shape, spec, pair), model=shape.name, gpu=spec.name)
    if as_json:
        _print_json(report)
        return
    render_diagnosis(report, Console())


@plan_app.command("serve")
def serve(
    model: ModelOption,
    gpu: GpuOption = "h100-sxm",
    context_len: Annotated[int, typer.Option(help="Longest sequence (max_model_len), tokens.")] = 8192,
    avg_seq_len: Annotated[int | None, typer.Option(help="Average tokens per sequence.")] = None,
    prompt_len: Annotated[int | None, typer.Option(help="Prompt length for the prefill bound.")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel size (default: proposed).")] = None,
    max_tp: Annotated[int, typer.Option(help="Largest tensor-parallel size to consider.")] = 8,
    gpus: Annotated[int | None, typer.Option(help="GPUs for this model (replicas = gpus // tp).")] = None,
    kv_dtype: Annotated[str, typer.Option(help="KV cache dtype to deploy: fp8 or bf16.")] = "fp8",
    weight_dtype: Annotated[str, typer.Option(help="Weight dtype: bf16, fp8, int8 or int4.")] = "bf16",
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="Default: proposed.")] = None,
    min_seqs: Annotated[int, typer.Option(help="Sequences the KV cache must hold.")] = 16,
    max_seqs_cap: Annotated[int, typer.Option(help="Upper limit on max_num_seqs.")] = 256,
    batch: Annotated[int | None, typer.Option(help="Decode batch for the bounds.")] = None,
    spec_method: Annotated[
        str, typer.Option(help="ngram, mtp, eagle, eagle3, draft_model or none.")
    ] = "ngram",
    draft_model: Annotated[str | None, typer.Option(help="Draft checkpoint path.")] = None,
    acceptance_rate: Annotated[float, typer.Option(help="Assumed draft acceptance rate α.")] = 0.7,
    spec_tokens: Annotated[int | None, typer.Option(help="Drafted tokens γ (default: proposed).")] = None,
    draft_cost: Annotated[float, typer.Option(help="Draft/target step-time ratio c.")] = 0.0,
    model_path: Annotated[str | None, typer.Option(help="Model path in the values file.")] = None,
    served_name: Annotated[str | None, typer.Option(help="Served model name in the values file.")] = None,
    values_out: Annotated[Path | None, typer.Option(help="Write a Helm values file here.")] = None,
    as_json: JsonOption = False,
) -> None:
    """KV capacity, decode/prefill bounds, speculative speedup, and proposed engine settings."""
    from pydantic import ValidationError
    from rich.console import Console

    from tessera.cli.plan_tables import render_serving
    from tessera.planner import ServeRequest, get_gpu, plan_serving, resolve_model
    from tessera.planner.report import serving_report
    from tessera.planner.values import ENGINE_BLOCK_SIZE, helm_values, render_values_yaml

    try:
        request = ServeRequest.model_validate(
            {
                "context_len": context_len,
                "avg_seq_len": avg_seq_len,
                "prompt_len": prompt_len,
                "tp": tp,
                "max_tp": max_tp,
                "gpus": gpus,
                "kv_dtype": kv_dtype,
                "weight_dtype": weight_dtype,
                "gpu_memory_utilization": gpu_memory_utilization,
                "min_concurrent_seqs": min_seqs,
                "max_num_seqs_cap": max_seqs_cap,
                "batch": batch,
                "speculative_method": spec_method,
                "draft_model": draft_model,
                "acceptance_rate": acceptance_rate,
                "num_speculative_tokens": spec_tokens,
                "draft_cost_ratio": draft_cost,
            }
        )
        shape = resolve_model(model)
        plan = plan_serving(shape, get_gpu(gpu), request, block_size=ENGINE_BLOCK_SIZE)
    except ValidationError as exc:
        raise _fail(_validation_message(exc)) from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    report = serving_report(plan)
    report["values_file"] = None
    if values_out is not None:
        if plan.proposal is None:
            raise _fail("no engine settings fit, so no values file was written")
        name = served_name or shape.name
        try:
            values = helm_values(
                plan.proposal, model_path=model_path or f"/models/{shape.name}", served_model_name=name
            )
        except ValidationError as exc:
            raise _fail(f"the engine refuses the proposal: {_validation_message(exc)}") from None
        header = (f"Generated by `tessera plan serve --model {model} --gpu {gpu}`.", *plan.proposal.reasons)
        values_out.write_text(render_values_yaml(values, header=header), encoding="utf-8")
        report["values_file"] = str(values_out)
    if as_json:
        _print_json(report)
        return
    console = Console()
    render_serving(report, console)
    if values_out is not None:
        console.print(f"values written to {values_out}")
