"""A tiny GQA/SwiGLU model and a toy accelerator whose numbers are easy to work out by hand.

tiny: L=2, h=8, a=2, g=1, d=4, f=16, V=10, untied, RMSNorm, no biases.
  attention per layer  h·a·d + 2·h·g·d + a·d·h = 64 + 64 + 64 = 192
  MLP per layer        3·h·f = 384
  norms per layer      2·h = 16                      → 592 per layer, 1184 for both
  embedding, output    V·h = 80 each; final norm 8   → N = 1352
  N_mm = 2·(192 + 384) + 80 = 1232
toy GPU: 10,000 bytes, 200 B/s HBM, 1,000 FLOP/s BF16 (ridge 5 FLOP/B), NVLink 900 B/s, IB 50 B/s.
"""

from __future__ import annotations

import pytest

from tessera.planner import AcceleratorSpec, ModelShape


@pytest.fixture
def tiny() -> ModelShape:
    return ModelShape(
        name="tiny",
        num_layers=2,
        hidden_size=8,
        num_heads=2,
        num_kv_heads=1,
        ffn_hidden_size=16,
        vocab_size=10,
        gated_mlp=True,
        tie_embeddings=False,
        norm="rmsnorm",
    )


@pytest.fixture
def toy_gpu() -> AcceleratorSpec:
    return AcceleratorSpec(
        name="toy",
        memory_bytes=10_000,
        hbm_bandwidth_bytes_per_s=200.0,
        peak_bf16_flops=1000.0,
        peak_fp8_flops=2000.0,
        nvlink_bandwidth_bytes_per_s=900.0,
        infiniband_bandwidth_bytes_per_s=50.0,
        gpus_per_node=8,
    )
