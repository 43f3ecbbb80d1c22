"""Rich tables for ``tessera plan``: each renderer prints one report dictionary (``tessera.planner.report``)
the way ``--json`` would print it, as tables and lines for a terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from tessera.planner.flops import CONVENTION_LABELS


def with_si_prefix(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def in_seconds(value: float) -> str:
    if value >= 1.0:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} µs"


def titled_table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    return table


def render_training(report: dict[str, Any], console: Console) -> None:
    setup = report["setup"]
    params = report["parameters"]
    console.print(
        f"[bold]{report['model']}[/] on {report['num_gpus']} × {report['gpu']}: "
        f"tp={setup['tp']} pp={setup['pp']} dp={setup['dp']} cp={setup['cp']} "
        f"sp={setup['sequence_parallel']} seq_len={setup['seq_len']} "
        f"micro_batch={setup['micro_batch_size']} micro_batches={setup['num_microbatches']} "
        f"zero={setup['zero_stage']} recompute={setup['recompute']} flash={setup['flash_attention']}"
    )
    console.print(
        f"parameters N = {params['total'] / 1e9:.2f} B, N_mm = {params['matmul'] / 1e9:.2f} B, "
        f"{params['per_gpu'] / 1e9:.3f} B on the fullest GPU"
    )
    flops = titled_table(
        "FLOPs per token (MFU numerator = model, HFU numerator = hardware)", "convention", "model", "hardware"
    )
    for convention, row in report["flops_per_token"].items():
        marker = "  ← stated" if convention == report["attention_convention"] else ""
        flops.add_row(
            CONVENTION_LABELS[convention] + marker,
            with_si_prefix(row["model"], "FLOP"),
            with_si_prefix(row["hardware"], "FLOP"),
        )
    console.print(flops)
    memory = report["memory_per_gpu_gib"]
    mem = titled_table("Memory per GPU, GiB", "item", "GiB")
    mem.add_row("peak on pipeline stage", memory["stage"])
    for key in ("weights", "gradients", "optimizer_states", "activations", "logits", "total", "capacity"):
        mem.add_row(key.replace("_", " "), f"{memory[key]:.2f}")
    mem.add_row("fits", "yes" if memory["fits"] else "[red]no[/]")
    console.print(mem)
    acts = titled_table("Activations by recomputation mode, GiB", "recompute", "SP", "per layer", "per GPU")
    for row in report["activation_gib_by_mode"]:
        acts.add_row(
            row["recompute"],
            "yes" if row["sequence_parallel"] else "no",
            f"{row['per_layer_gib']:.3f}",
            f"{row['per_gpu_gib']:.2f}",
        )
    console.print(acts)
    if report["communication"]:
        comm = titled_table(
            "Communication per step per GPU (not overlapped)",
            "dim",
            "degree",
            "volume",
            "link",
            "NVLink",
            "IB",
        )
        for row in report["communication"]:
            comm.add_row(
                row["dimension"],
                str(row["degree"]),
                with_si_prefix(row["bytes_per_step"], "B"),
                row["link"],
                in_seconds(row["time_nvlink_s"]),
                in_seconds(row["time_infiniband_s"]),
            )
        console.print(comm)
    bubble = report["pipeline_bubble"]
    console.print(
        f"pipeline bubble: {100 * bubble['fraction_of_ideal']:.1f} % of the ideal step "
        f"({100 * bubble['share_of_step']:.1f} % of the step); compute-bound step ≥ "
        f"{in_seconds(report['compute_time_lower_bound_s'])}"
    )
    measured = report["measured"]
    if measured is not None:
        console.print(
            f"measured {measured['tokens_per_s']:.0f} tokens/s: MFU {measured['mfu_percent']:.1f} %, "
            f"HFU {measured['hfu_percent']:.1f} % ({CONVENTION_LABELS[report['attention_convention']]})"
        )


def render_diagnosis(report: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]verdict: {report['verdict']}[/]")
    for line in report["summary"]:
        console.print(f"• {line}")
    if report["explanations"]:
        table = titled_table(
            "Accountings that reproduce the pair", "MFU counts", "HFU counts", "recompute", "flash", "ratio"
        )
        for row in report["explanations"]:
            table.add_row(
                row["mfu_convention"],
                row["hfu_convention"],
                row["recompute"],
                "yes" if row["flash_attention_counted"] else "no",
                f"{row['predicted_ratio']:.3f}",
            )
        console.print(table)


def render_serving(report: dict[str, Any], console: Console) -> None:
    console.print(
        f"[bold]{report['model']}[/] on {report['gpu']}, tensor parallel {report['tensor_parallel_size']}, "
        f"gpu_memory_utilization {report['gpu_memory_utilization']:.2f}, "
        f"context {report['context_len']} tokens"
    )
    console.print(
        f"weights {report['weights_gib_per_gpu']:.2f} GiB per GPU, activation peak "
        f"{report['activation_peak_gib']:.2f} GiB, runtime overhead {report['runtime_overhead_gib']:.2f} GiB"
    )
    kv = titled_table(
        "KV cache per GPU", "dtype", "bytes/token (model)", "bytes/token/GPU", "free GiB", "tokens", "seqs"
    )
    for row in report["kv"]:
        kv.add_row(
            row["kv_dtype"],
            f"{report['kv_bytes_per_token'][row['kv_dtype']]:,}",
            f"{row['bytes_per_token_per_gpu']:,.0f}",
            f"{row['free_gib']:.2f}",
            f"{row['capacity_tokens']:,}",
            str(row["concurrent_seqs"]),
        )
    console.print(kv)
    bounds = titled_table(
        f"Roofline lower bounds (ridge {report['ridge_point_flops_per_byte']:.0f} FLOP/B)",
        "step",
        "time",
        "memory",
        "compute",
        "FLOP/B",
        "regime",
    )
    decode, prefill = report["decode"], report["prefill"]
    for label, row in (
        (f"decode, batch {decode['batch']} at {decode['context_len']} tokens", decode),
        (f"prefill, {prefill['prompt_len']} tokens", prefill),
    ):
        bounds.add_row(
            label,
            in_seconds(row["time_s"]),
            in_seconds(row["memory_time_s"]),
            in_seconds(row["compute_time_s"]),
            f"{row['arithmetic_intensity']:.1f}",
            row["regime"],
        )
    console.print(bounds)
    spec = report["speculative"]
    console.print(
        f"speculative decoding at α={spec['acceptance_rate']:.2f}, γ={spec['num_speculative_tokens']}, "
        f"c={spec['draft_cost_ratio']:g}: {spec['expected_tokens_per_step']:.2f} tokens per target step, "
        f"speedup {spec['speedup']:.2f}× (Leviathan), {spec['roofline_speedup']:.2f}× on the roofline"
    )
    proposal = report["proposal"]
    if proposal is None:
        console.print("[red]no tensor-parallel size fits this model and context on this GPU[/]")
        return
    console.print("[bold]proposed engine settings[/]")
    for reason in proposal["reasons"]:
        console.print(f"• {reason}")
