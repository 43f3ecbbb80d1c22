"""An accelerator's datasheet numbers: memory, HBM bandwidth, dense matmul peaks, and its links.

Peaks are dense (no 2:4 sparsity), as MFU and HFU are conventionally quoted. NVLink is marketed as the
sum of both directions ("900 GB/s" for NVLink 4 is 450 GB/s each way); a ring collective is limited by
one direction, so :meth:`AcceleratorSpec.link_bandwidth` halves it. InfiniBand is given per GPU and per
direction (one 400 Gb/s NDR port per H100 is 50 GB/s each way).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Link = Literal["nvlink", "infiniband"]
ComputeDtype = Literal["bf16", "fp8"]


class AcceleratorSpec(BaseModel):
    """One accelerator and the links of the node it sits in."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Label shown in reports.")
    memory_bytes: int = Field(gt=0, description="Device memory as the driver reports its total, bytes.")
    hbm_bandwidth_bytes_per_s: float = Field(gt=0, description="Peak HBM bandwidth, bytes/s.")
    peak_bf16_flops: float = Field(gt=0, description="Dense BF16 tensor-core peak, FLOP/s.")
    peak_fp8_flops: float | None = Field(
        default=None, gt=0, description="Dense FP8 tensor-core peak, FLOP/s; null where the chip has none."
    )
    nvlink_bandwidth_bytes_per_s: float = Field(
        gt=0, description="NVLink bandwidth per GPU as marketed: both directions added, bytes/s."
    )
    infiniband_bandwidth_bytes_per_s: float = Field(
        gt=0, description="Scale-out network bandwidth per GPU, one direction, bytes/s."
    )
    gpus_per_node: int = Field(default=8, ge=1, description="GPUs joined by NVLink in one node.")

    def peak_flops(self, dtype: ComputeDtype = "bf16") -> float:
        """Dense matmul peak for ``dtype``; FP8 falls back to BF16 on chips without FP8 tensor cores."""
        if dtype == "fp8" and self.peak_fp8_flops is not None:
            return self.peak_fp8_flops
        return self.peak_bf16_flops

    def ridge_point(self, dtype: ComputeDtype = "bf16") -> float:
        """Roofline ridge, FLOP per byte: below it a kernel is bound by HBM bandwidth, above by compute."""
        return self.peak_flops(dtype) / self.hbm_bandwidth_bytes_per_s

    def link_bandwidth(self, link: Link) -> float:
        """Bytes/s one GPU can send in one direction over ``link`` (what a ring collective is limited by)."""
        if link == "nvlink":
            return self.nvlink_bandwidth_bytes_per_s / 2
        return self.infiniband_bandwidth_bytes_per_s
