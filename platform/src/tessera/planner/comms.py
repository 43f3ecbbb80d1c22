"""Communication of a training step: TP/SP, CP, PP and DP volume per GPU, and its time on each link.

Ring collectives over n ranks, for a buffer of S bytes, send per rank: all-reduce ``2(n−1)/n · S``;
all-gather and reduce-scatter ``(n−1)/n · S`` each. A rank sends as much as it receives, so the time is
the volume over one direction's bandwidth (NVLink 4's "900 GB/s" is 450 GB/s each way).

Per training step, per GPU:

* TP (Megatron): 2 all-reduces in the forward and 2 in the backward of every layer, on ``b·s·h``
  elements; full recomputation repeats the 2 forward ones. Sequence parallelism swaps each all-reduce
  for an all-gather plus a reduce-scatter: the same volume.
* CP (ring / all-gather attention): the forward gathers every rank's K and V (``2·b·s·g·d`` elements,
  the kv heads this TP rank owns); the backward gathers them again and reduce-scatters their gradients.
* PP: each micro-batch sends its activation forward and its gradient back across each stage boundary,
  ``b·s·h`` elements each, split over the TP ranks (Megatron's scatter/gather); v interleaved chunks make
  v× as many crossings.
* DP: gradients of this GPU's shard of parameters, once per step. ZeRO-0 all-reduces them; ZeRO-1/2
  reduce-scatter the gradients and all-gather the updated BF16 weights (the same volume); ZeRO-3 also
  all-gathers the weights in every micro-batch's forward and backward (1.5× per micro-batch, as in the
  ZeRO paper). The gradient reduce spans the DP×CP ranks, as in Megatron.

Times assume nothing overlaps compute: they are what the step would pay if none of it were hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.planner.hardware import AcceleratorSpec, Link
from tessera.planner.parallelism import RANK_ORDER, TrainingSetup
from tessera.planner.pipeline import stage_layers
from tessera.planner.shapes import ModelShape, count_params, kv_heads_per_gpu

ACTIVATION_BYTES = 2


def all_reduce_bytes_per_rank(size_bytes: float, num_ranks: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``size_bytes``: ``2(n−1)/n · S``."""
    return 2.0 * (num_ranks - 1) / num_ranks * size_bytes


def all_gather_bytes_per_rank(size_bytes: float, num_ranks: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) of a ``size_bytes`` result."""
    return (num_ranks - 1) / num_ranks * size_bytes


reduce_scatter_bytes_per_rank = all_gather_bytes_per_rank


@dataclass(frozen=True, slots=True)
class CommTraffic:
    """One parallel dimension's traffic in a training step, for one GPU."""

    dimension: str
    degree: int
    collective: str
    bytes_per_step: float
    link: Link
    time_nvlink_s: float
    time_infiniband_s: float

    @property
    def time_s(self) -> float:
        """Time on the link the group actually runs on."""
        return self.time_nvlink_s if self.link == "nvlink" else self.time_infiniband_s


def group_link(setup: TrainingSetup, dimension: str, gpus_per_node: int) -> Link:
    """NVLink when the group's ranks share a node, given Megatron's tp → cp → dp → pp rank order."""
    inner = 1
    for name in RANK_ORDER:
        if name == dimension:
            return "nvlink" if inner * setup.degree(name) <= gpus_per_node else "infiniband"
        inner *= setup.degree(name)
    raise ValueError(f"unknown parallel dimension {dimension!r}; valid: {', '.join(RANK_ORDER)}")


def _traffic(
    dimension: str, setup: TrainingSetup, gpu: AcceleratorSpec, collective: str, volume: float, link_of: str
) -> CommTraffic:
    return CommTraffic(
        dimension=dimension,
        degree=setup.degree(link_of),
        collective=collective,
        bytes_per_step=volume,
        link=group_link(setup, link_of, gpu.gpus_per_node),
        time_nvlink_s=volume / gpu.link_bandwidth("nvlink"),
        time_infiniband_s=volume / gpu.link_bandwidth("infiniband"),
    )


def tensor_parallel_traffic(
    shape: ModelShape, gpu: AcceleratorSpec, setup: TrainingSetup
) -> CommTraffic | None:
    """Megatron TP (with or without SP); ``None`` when t = 1."""
    t = setup.tp
    if t == 1:
        return None
    tensor_bytes = setup.micro_batch_size * (setup.seq_len // setup.cp) * shape.hidden_size * ACTIVATION_BYTES
    per_op = all_reduce_bytes_per_rank(tensor_bytes, t)
    ops_per_layer = 4 + (2 if setup.recompute == "full" else 0)
    volume = per_op * ops_per_layer * stage_layers(shape.num_layers, setup.pp) * setup.num_microbatches
    if setup.uses_sequence_parallel:
        collective = f"{ops_per_layer} × (all-gather + reduce-scatter) per layer"
        dimension = "tp+sp"
    else:
        collective = f"{ops_per_layer} × all-reduce per layer"
        dimension = "tp"
    return _traffic(dimension, setup, gpu, collective, volume, "tp")


def context_parallel_traffic(
    shape: ModelShape, gpu: AcceleratorSpec, setup: TrainingSetup
) -> CommTraffic | None:
    """K/V all-gathers and dK/dV reduce-scatters of context parallelism; ``None`` when c = 1."""
    c = setup.cp
    if c == 1:
        return None
    kv_heads_here = kv_heads_per_gpu(shape, setup.tp)
    kv_bytes = 2 * setup.micro_batch_size * setup.seq_len * kv_heads_here * shape.head_size * ACTIVATION_BYTES
    ops_per_layer = 3 + (1 if setup.recompute == "full" else 0)
    per_op = all_gather_bytes_per_rank(kv_bytes, c)
    volume = per_op * ops_per_layer * stage_layers(shape.num_layers, setup.pp) * setup.num_microbatches
    return _traffic("cp", setup, gpu, f"{ops_per_layer} × K/V gather or scatter per layer", volume, "cp")


def pipeline_traffic(shape: ModelShape, gpu: AcceleratorSpec, setup: TrainingSetup) -> CommTraffic | None:
    """Point-to-point activations and gradients between stages; ``None`` when p = 1."""
    if setup.pp == 1:
        return None
    message = (
        setup.micro_batch_size * (setup.seq_len // setup.cp) * shape.hidden_size * ACTIVATION_BYTES / setup.tp
    )
    volume = 2.0 * message * setup.num_microbatches * setup.virtual_stages
    return _traffic("pp", setup, gpu, "send activation + gradient per micro-batch", volume, "pp")


def data_parallel_traffic(
    shape: ModelShape, gpu: AcceleratorSpec, setup: TrainingSetup
) -> CommTraffic | None:
    """Gradient reduction (and ZeRO weight gathers) over the DP×CP ranks; ``None`` when that is 1."""
    n = setup.dp * setup.cp
    if n == 1:
        return None
    params_here = count_params(shape).total / (setup.tp * setup.pp)
    gradients = params_here * setup.gradient_bytes
    weights = params_here * ACTIVATION_BYTES
    if setup.zero_stage == 0:
        volume, collective = all_reduce_bytes_per_rank(gradients, n), "gradient all-reduce"
    elif setup.zero_stage in (1, 2):
        volume = reduce_scatter_bytes_per_rank(gradients, n) + all_gather_bytes_per_rank(weights, n)
        collective = "gradient reduce-scatter + weight all-gather"
    else:
        per_microbatch = reduce_scatter_bytes_per_rank(gradients, n) + 2 * all_gather_bytes_per_rank(
            weights, n
        )
        volume = per_microbatch * setup.num_microbatches
        collective = "per micro-batch: 2 weight all-gathers + gradient reduce-scatter"
    traffic = _traffic("dp", setup, gpu, collective, volume, "dp")
    if setup.cp > 1:
        # The reduce spans DP×CP ranks; it leaves the node as soon as either dimension does.
        link: Link = "nvlink" if setup.tp * setup.cp * setup.dp <= gpu.gpus_per_node else "infiniband"
        traffic = CommTraffic(
            dimension="dp×cp",
            degree=n,
            collective=collective,
            bytes_per_step=volume,
            link=link,
            time_nvlink_s=traffic.time_nvlink_s,
            time_infiniband_s=traffic.time_infiniband_s,
        )
    return traffic


def communication(shape: ModelShape, gpu: AcceleratorSpec, setup: TrainingSetup) -> tuple[CommTraffic, ...]:
    """Every dimension with a degree above one, innermost first."""
    rows = (
        tensor_parallel_traffic(shape, gpu, setup),
        context_parallel_traffic(shape, gpu, setup),
        data_parallel_traffic(shape, gpu, setup),
        pipeline_traffic(shape, gpu, setup),
    )
    return tuple(row for row in rows if row is not None)


def total_exposed_time_s(traffic: tuple[CommTraffic, ...]) -> float:
    """Sum of every dimension's time on its own link: the cost if no communication overlapped."""
    return math.fsum(row.time_s for row in traffic)
