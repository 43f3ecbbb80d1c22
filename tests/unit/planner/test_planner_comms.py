"""Collective volumes and per-dimension traffic, against hand-worked values for the tiny model (conftest)."""

from __future__ import annotations

import pytest

from tessera.planner import (
    AcceleratorSpec,
    ModelShape,
    TrainingSetup,
    all_gather_bytes_per_rank,
    all_reduce_bytes_per_rank,
    communication,
    get_gpu,
    reduce_scatter_bytes_per_rank,
)
from tessera.planner.comms import (
    context_parallel_traffic,
    data_parallel_traffic,
    group_link,
    pipeline_traffic,
    tensor_parallel_traffic,
    total_exposed_time_s,
)


def test_ring_collectives() -> None:
    assert all_reduce_bytes_per_rank(100, 4) == 150  # 2(n−1)/n · S
    assert all_gather_bytes_per_rank(100, 4) == 75  # (n−1)/n · S
    assert reduce_scatter_bytes_per_rank(100, 4) == 75
    assert all_reduce_bytes_per_rank(100, 1) == 0


def test_nvlink_is_counted_one_direction() -> None:
    h100 = get_gpu("h100-sxm")
    assert h100.link_bandwidth("nvlink") == 450e9  # "900 GB/s" is both directions
    assert h100.link_bandwidth("infiniband") == 50e9


def test_tensor_parallel_by_hand(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    # one b·s·h tensor: 1·4·8·2 bytes = 64; all-reduce over 2 ranks sends 2·(1/2)·64 = 64;
    # 4 per layer × 2 layers × 1 micro-batch = 512 bytes.
    setup = TrainingSetup(seq_len=4, tp=2, sequence_parallel=False, recompute="selective")
    row = tensor_parallel_traffic(tiny, toy_gpu, setup)
    assert row is not None and (row.dimension, row.bytes_per_step, row.link) == ("tp", 512, "nvlink")
    assert row.time_nvlink_s == 512 / 450
    assert row.time_infiniband_s == 512 / 50
    with_sp = tensor_parallel_traffic(tiny, toy_gpu, setup.model_copy(update={"sequence_parallel": True}))
    assert with_sp is not None and (with_sp.dimension, with_sp.bytes_per_step) == (
        "tp+sp",
        512,
    )  # same volume
    full = tensor_parallel_traffic(tiny, toy_gpu, setup.model_copy(update={"recompute": "full"}))
    assert full is not None and full.bytes_per_step == 768  # the 2 forward all-reduces run again


def test_pipeline_by_hand(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    # message b·s·h·2 / t = 64 / 2 = 32 bytes; activation + gradient per micro-batch × 3 micro-batches
    setup = TrainingSetup(seq_len=4, tp=2, pp=2, num_microbatches=3)
    row = pipeline_traffic(tiny, toy_gpu, setup)
    assert row is not None and row.bytes_per_step == 192
    tp = tensor_parallel_traffic(tiny, toy_gpu, setup)
    assert tp is not None and tp.bytes_per_step == 64 * 4 * 1 * 3  # one layer per stage


@pytest.mark.parametrize(("stage", "expected"), [(0, 4056), (1, 4056), (2, 4056)])
def test_data_parallel_by_hand(
    tiny: ModelShape, toy_gpu: AcceleratorSpec, stage: int, expected: float
) -> None:
    # 1352 parameters × 2 bytes = 2704; all-reduce over 4: 2·(3/4)·2704 = 4056; ZeRO-1/2:
    # reduce-scatter + all-gather of the same size, the same volume.
    setup = TrainingSetup(seq_len=4, dp=4, zero_stage=stage)  # type: ignore[arg-type]
    row = data_parallel_traffic(tiny, toy_gpu, setup)
    assert row is not None and row.bytes_per_step == expected


def test_zero_3_gathers_weights_every_micro_batch(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    setup = TrainingSetup(seq_len=4, dp=4, zero_stage=3, num_microbatches=2)
    row = data_parallel_traffic(tiny, toy_gpu, setup)
    assert row is not None and row.bytes_per_step == 2 * (
        2028 + 2 * 2028
    )  # 1.5× an all-reduce, per micro-batch


def test_context_parallel_by_hand(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    # K and V of the whole sequence: 2·b·s·g·d·2 = 2·1·4·1·4·2 = 64 bytes; a gather over 2 sends 32;
    # 3 per layer (forward gather, backward gather and gradient scatter) × 2 layers = 192.
    setup = TrainingSetup(seq_len=4, cp=2)
    row = context_parallel_traffic(tiny, toy_gpu, setup)
    assert row is not None and row.bytes_per_step == 192
    reduce = data_parallel_traffic(tiny, toy_gpu, setup)  # gradients reduce over DP×CP
    assert reduce is not None and reduce.dimension == "dp×cp" and reduce.degree == 2


def test_links_follow_the_rank_order() -> None:
    setup = TrainingSetup(seq_len=8, tp=8, dp=2, pp=2)
    assert [group_link(setup, dim, 8) for dim in ("tp", "dp", "pp")] == ["nvlink", "infiniband", "infiniband"]
    small = TrainingSetup(seq_len=8, tp=2, cp=2, dp=2)
    assert {group_link(small, dim, 8) for dim in ("tp", "cp", "dp")} == {"nvlink"}


def test_communication_lists_only_parallel_dimensions(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    assert communication(tiny, toy_gpu, TrainingSetup(seq_len=4)) == ()
    rows = communication(tiny, toy_gpu, TrainingSetup(seq_len=4, tp=2, pp=2, dp=2))
    assert [row.dimension for row in rows] == ["tp+sp", "dp", "pp"]
    assert total_exposed_time_s(rows) == pytest.approx(sum(row.time_s for row in rows))
