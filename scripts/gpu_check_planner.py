#!/usr/bin/env python
"""Check the planner's serving lower bounds against one real GPU (issue 8's GPU check), in under 5 minutes.

What it measures, with CUDA events after a warm-up, each the median of several timed runs:

1. HBM copy bandwidth: ``dst.copy_(src)`` on 2 GiB, counting the bytes read and written. Compared with
   the datasheet bandwidth the planner uses (measured / datasheet; about 0.9 is typical).
2. BF16 matmul rate: an 8192³ ``torch.matmul`` (2·n³ FLOPs). Compared with the dense BF16 peak.
3. A memory-bound decode step of one Llama 3 70B-shaped layer (h 8192, 64 query heads, 8 KV heads,
   d 128, SwiGLU f 28672): the fused QKV, output, gate/up and down projections for a batch of 16 tokens,
   plus attention over a KV cache of 16 sequences × 32k tokens, once at BF16 and once at FP8 KV.
   PyTorch has no attention kernel that reads FP8 directly, so both dtypes run the same decode-attention
   function (scores and weighted sum as broadcast-multiply-and-reduce, the FP8 → BF16 conversion inside
   it) compiled by ``torch.compile``, which fuses the conversion into the kernels that read the cache;
   the BF16 case is also timed with PyTorch's SDPA for reference. Without compilation (``--quick``, or
   if compiling fails, which the report then says) a batched-matmul version runs instead, and its FP8
   row pays an extra BF16 copy of the cache.
   Compared with ``tessera.planner.decode_step_bound`` for a one-layer model of that shape: the ratio
   bound / measured is the share of the roofline the step reached (it cannot exceed 1 beyond noise).

It writes the ratios, the date, the card and the software versions to ``docs/planner-gpu-check.md``
(or ``--out``) and prints the same as JSON. Run it from the repository root on a machine with one
NVIDIA GPU and the project installed::

    .venv/bin/python scripts/gpu_check_planner.py            # full check, ~2-4 minutes
    .venv/bin/python scripts/gpu_check_planner.py --quick    # small sizes, no compile (the GPU test)

The card is matched to a planner preset by name (H200, H100 SXM, A100 40/80 GB); ``--gpu`` overrides.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tessera.planner import AcceleratorSpec, ModelShape, decode_step_bound, get_gpu

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "planner-gpu-check.md"
# One Llama 3 70B layer; vocab_size=1 so the one-layer model's logit layer is negligible in N_mm.
LAYER = ModelShape(
    name="llama-3-70b-layer",
    num_layers=1,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    ffn_hidden_size=28672,
    vocab_size=1,
)


@dataclass(frozen=True)
class Check:
    name: str
    measured: float
    planner: float
    unit: str
    ratio: float
    note: str


def time_cuda(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds per call of ``fn`` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def match_preset(name: str, memory_bytes: int) -> str:
    upper = name.upper()
    if "H200" in upper:
        return "h200"
    if "H100" in upper and "PCIE" not in upper:
        return "h100-sxm"
    if "A100" in upper:
        return "a100-80gb" if memory_bytes > 60 * 2**30 else "a100-40gb"
    raise SystemExit(f"no planner preset for {name!r}; pass --gpu a100-40gb|a100-80gb|h100-sxm|h200")


def check_copy(spec: AcceleratorSpec, size_bytes: int) -> Check:
    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src))
    measured = 2 * size_bytes / seconds  # every byte read once and written once
    return Check(
        "HBM copy bandwidth",
        measured / 1e9,
        spec.hbm_bandwidth_bytes_per_s / 1e9,
        "GB/s",
        measured / spec.hbm_bandwidth_bytes_per_s,
        f"dst.copy_(src), {size_bytes / 2**30:.1f} GiB; ratio = measured / datasheet",
    )


def check_matmul(spec: AcceleratorSpec, n: int) -> Check:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = time_cuda(lambda: torch.matmul(a, b))
    measured = 2 * n**3 / seconds
    return Check(
        "BF16 matmul rate",
        measured / 1e12,
        spec.peak_flops("bf16") / 1e12,
        "TFLOP/s",
        measured / spec.peak_flops("bf16"),
        f"{n}×{n}×{n} torch.matmul; ratio = measured / dense peak",
    )


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One decode query per head against the cache; q [B, g, a/g, d], k and v [B, g, C, d] in any dtype.

    Written as broadcast-multiply-and-reduce so that ``torch.compile`` fuses the cache's conversion to
    BF16 into the kernels that read it (eager mode would materialise a [B, g, a/g, C, d] product).
    """
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    scores = (q.unsqueeze(3) * k16.unsqueeze(2)).sum(-1, dtype=torch.float32) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    return (weights.unsqueeze(-1) * v16.unsqueeze(2)).sum(3)


def decode_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same attention with batched matmuls: small intermediates, but FP8 is first copied to BF16."""
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    scores = torch.einsum("bgqd,bgcd->bgqc", q, k16).float() * q.shape[-1] ** -0.5
    weights = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    return torch.einsum("bgqc,bgcd->bgqd", weights, v16)


def check_decode(
    spec: AcceleratorSpec, *, batch: int, context: int, kv_dtype: str, compiled: bool
) -> tuple[Check, Check | None, str]:
    h, a, g, d, f = 8192, 64, 8, 128, 28672
    dev, bf16 = "cuda", torch.bfloat16
    w_qkv = torch.randn(h, (a + 2 * g) * d, dtype=bf16, device=dev) * 0.01
    w_o = torch.randn(a * d, h, dtype=bf16, device=dev) * 0.01
    w_gate_up = torch.randn(h, 2 * f, dtype=bf16, device=dev) * 0.01
    w_down = torch.randn(f, h, dtype=bf16, device=dev) * 0.01
    cache_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else bf16
    k_cache = torch.randn(batch, g, context, d, dtype=bf16, device=dev).to(cache_dtype)
    v_cache = torch.randn(batch, g, context, d, dtype=bf16, device=dev).to(cache_dtype)
    x = torch.randn(batch, h, dtype=bf16, device=dev)
    attend: Callable[..., torch.Tensor] = decode_attention_eager
    mode = "eager (FP8 copied to BF16 first)" if kv_dtype == "fp8" else "eager"
    if compiled:
        try:
            attend = torch.compile(decode_attention, dynamic=False)
            q0 = torch.randn(batch, g, a // g, d, dtype=bf16, device=dev)
            attend(q0, k_cache, v_cache)  # compile now, outside the timing
            mode = "torch.compile"
        except Exception as exc:  # a failed compile is reported, and the eager path still measures
            attend, mode = decode_attention_eager, f"eager (compile failed: {type(exc).__name__})"

    def step() -> torch.Tensor:
        qkv = x @ w_qkv
        q = qkv[:, : a * d].view(batch, g, a // g, d)
        ctx = attend(q, k_cache, v_cache).reshape(batch, a * d)
        hidden = x + ctx @ w_o
        gate, up = (hidden @ w_gate_up).chunk(2, dim=-1)
        return hidden + (F.silu(gate) * up) @ w_down

    seconds = time_cuda(step)
    bound = decode_step_bound(
        LAYER, spec, batch=batch, context_len=context, kv_dtype="fp8" if kv_dtype == "fp8" else "bf16"
    )
    main = Check(
        f"decode step, 70B layer, {kv_dtype} KV",
        seconds * 1e3,
        bound.time_s * 1e3,
        "ms",
        bound.time_s / seconds,
        f"batch {batch}, context {context}, attention {mode}; bound is {bound.regime}; "
        "ratio = bound / measured",
    )
    reference = None
    if kv_dtype == "bf16":
        q_sdpa = torch.randn(batch, a, 1, d, dtype=bf16, device=dev)
        sdpa_s = time_cuda(lambda: F.scaled_dot_product_attention(q_sdpa, k_cache, v_cache, enable_gqa=True))
        kv_bound = 2 * batch * context * g * d * 2 / spec.hbm_bandwidth_bytes_per_s
        reference = Check(
            "SDPA over the BF16 cache alone",
            sdpa_s * 1e3,
            kv_bound * 1e3,
            "ms",
            kv_bound / sdpa_s,
            "torch SDPA (enable_gqa); planner bound = KV bytes / HBM bandwidth",
        )
    return main, reference, mode


def render(checks: list[Check], meta: dict[str, Any]) -> str:
    lines = [
        "# Planner GPU check",
        "",
        f"Run {meta['date']} on **{meta['card']}** ({meta['memory_gib']:.1f} GiB; planner preset "
        f"`{meta['preset']}`), PyTorch {meta['torch']}, CUDA {meta['cuda']}. Written by "
        "`scripts/gpu_check_planner.py`; the method is in its docstring and in docs/planner.md.",
        "",
        "| check | measured | planner | unit | ratio | how |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        row = (c.name, f"{c.measured:.3f}", f"{c.planner:.3f}", c.unit, f"{c.ratio:.2f}", c.note)
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Ratios: bandwidth and matmul are measured / datasheet; decode rows are planner bound / measured "
        "time, the share of the roofline reached (a value above 1 would mean the bound is wrong).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", help="planner preset to compare with (default: matched from the card)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report path")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, no compile (seconds; the GPU test)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    preset = args.gpu or match_preset(props.name, props.total_memory)
    spec = get_gpu(preset)
    copy_bytes, matmul_n, context = (256 * 2**20, 4096, 4096) if args.quick else (2 * 2**30, 8192, 32768)
    checks = [check_copy(spec, copy_bytes), check_matmul(spec, matmul_n)]
    for kv_dtype in ("bf16", "fp8"):
        main_check, reference, _ = check_decode(
            spec, batch=16, context=context, kv_dtype=kv_dtype, compiled=not args.quick
        )
        torch.cuda.empty_cache()  # the layer and its cache went out of scope with check_decode
        checks.append(main_check)
        if reference is not None:
            checks.append(reference)
    meta = {
        "date": dt.date.today().isoformat(),
        "card": props.name,
        "memory_gib": props.total_memory / 2**30,
        "preset": preset,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quick": args.quick,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(checks, meta), encoding="utf-8")
    print(json.dumps({"meta": meta, "checks": [asdict(c) for c in checks]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
