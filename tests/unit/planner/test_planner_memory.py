"""ZeRO model states, activations per layer (Table 2 and its GQA/SwiGLU form), pipeline in-flight layers."""

from __future__ import annotations

import pytest

from tessera.planner import (
    ModelShape,
    TrainingSetup,
    activation_bytes_per_layer,
    activation_memory,
    activation_terms,
    get_gpu,
    get_model,
    layers_in_flight,
    model_state_bytes,
    pipeline_bubble,
    plan_training,
)


@pytest.mark.parametrize(
    ("stage", "weights", "gradients", "optimizer"),
    [(0, 2000, 2000, 12000), (1, 2000, 2000, 3000), (2, 2000, 500, 3000), (3, 500, 500, 3000)],
)
def test_zero_stages(stage: int, weights: float, gradients: float, optimizer: float) -> None:
    states = model_state_bytes(1000, stage, 4)
    assert (states.weights, states.gradients, states.optimizer) == (weights, gradients, optimizer)


def test_zero_rejects_unknown_stage() -> None:
    with pytest.raises(ValueError, match="0, 1, 2, 3"):
        model_state_bytes(1000, 4, 4)


def test_gqa_swiglu_terms_by_hand(tiny: ModelShape) -> None:
    # s=4, b=1: replicated 4·8·(2+2+2+2) = 256 (no dropout masks);
    # TP-split: Q 2·8 + K 2·4 + V 2·4 + context 2·8 = 48, SwiGLU 3·2·16 = 96 → 4·144 = 576;
    # scores: softmax output only, 2·a·s²·b = 2·2·16 = 64.
    terms = activation_terms(tiny, 4, 1)
    assert (terms.replicated, terms.tensor_parallel, terms.scores, terms.layer_input) == (256, 576, 64, 64)
    assert activation_bytes_per_layer(terms, tp=1, sequence_parallel=False, recompute="none") == 896
    assert activation_bytes_per_layer(terms, tp=2, sequence_parallel=False, recompute="none") == 256 + 640 / 2
    assert activation_bytes_per_layer(terms, tp=2, sequence_parallel=True, recompute="none") == 896 / 2
    assert (
        activation_bytes_per_layer(terms, tp=2, sequence_parallel=False, recompute="selective") == 256 + 288
    )
    assert activation_bytes_per_layer(terms, tp=2, sequence_parallel=True, recompute="selective") == 832 / 2
    assert activation_bytes_per_layer(terms, tp=2, sequence_parallel=False, recompute="full") == 64
    assert activation_bytes_per_layer(terms, tp=2, sequence_parallel=True, recompute="full") == 32


def test_flash_attention_stores_only_the_log_sum_exp(tiny: ModelShape) -> None:
    assert activation_terms(tiny, 4, 1, flash_attention=True).scores == 4 * 2 * 4  # FP32 per query per head


def test_context_parallel_splits_the_sequence(tiny: ModelShape) -> None:
    whole, half = activation_terms(tiny, 4, 1), activation_terms(tiny, 4, 1, cp=2)
    assert half.replicated == whole.replicated / 2
    assert half.scores == whole.scores / 2  # s/c local queries against all s keys
    with pytest.raises(ValueError, match="multiple"):
        activation_terms(tiny, 5, 1, cp=2)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_gpt_shapes_recover_table_2(t: int) -> None:
    shape = get_model("megatron-22b")
    s, b, h, a = 2048, 1, shape.hidden_size, shape.num_heads
    sbh = s * b * h
    terms = activation_terms(shape, s, b)
    assert terms.total == pytest.approx(sbh * (34 + 5 * a * s / h))
    if t == 1:
        return
    expected = {
        ("none", False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", True): sbh * (34 / t + 5 * a * s / (h * t)),
        ("selective", False): sbh * (10 + 24 / t),
        ("selective", True): sbh * 34 / t,
        ("full", False): 2 * sbh,
    }
    for (mode, sp), value in expected.items():
        got = activation_bytes_per_layer(terms, tp=t, sequence_parallel=sp, recompute=mode)  # type: ignore[arg-type]
        assert got == pytest.approx(value)


def test_full_recomputation_keeps_one_layer_as_working_set(tiny: ModelShape) -> None:
    memory = activation_memory(
        tiny, 4, 1, tp=1, sequence_parallel=False, recompute="full", layers_in_flight=2, include_logits=False
    )
    assert memory.layers == 2 * 64 + 896
    with_logits = activation_memory(
        tiny, 4, 1, tp=1, sequence_parallel=False, recompute="none", layers_in_flight=2
    )
    assert with_logits.logits == 4 * 4 * 10  # FP32 logits, s·b·V


def test_pipeline_bubble() -> None:
    assert pipeline_bubble(4, 8).fraction_of_ideal == 3 / 8
    assert pipeline_bubble(4, 8).share_of_step == pytest.approx(0.375 / 1.375)
    assert pipeline_bubble(4, 8, 2).fraction_of_ideal == 3 / 16
    assert pipeline_bubble(1, 1).fraction_of_ideal == 0
    with pytest.raises(ValueError, match="multiple of pp"):
        pipeline_bubble(4, 6, 2)


def test_layers_in_flight() -> None:
    assert layers_in_flight(32, 4, 8) == 32  # the first stage holds p micro-batches of L/p layers
    assert layers_in_flight(32, 4, 8, rank=3) == 8
    assert layers_in_flight(32, 4, 2) == 16  # fewer micro-batches than stages
    assert layers_in_flight(32, 4, 8, 2) == 32 * (1 + 3 / 8)  # Korthikanti's interleaved factor
    assert layers_in_flight(126, 16, 32) == 8 * 16  # uneven split rounds up


def test_training_plan_memory_and_states() -> None:
    setup = TrainingSetup(seq_len=4096, tp=8, pp=2, dp=4, num_microbatches=8, zero_stage=1)
    plan = plan_training(get_model("llama-3-8b"), get_gpu("h100-sxm"), setup)
    states = plan.memory.states
    assert states.optimizer == pytest.approx(12 * plan.memory.params / 4)
    assert states.weights == pytest.approx(2 * plan.memory.params)
    assert plan.memory.total == pytest.approx(states.total + plan.memory.activations.total)
    assert plan.fits
    modes = {(row.recompute, row.sequence_parallel): row.bytes_per_gpu for row in plan.activation_modes}
    assert modes[("full", True)] < modes[("selective", True)] < modes[("selective", False)]


def test_training_plan_rejects_heads_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="divide"):
        plan_training(get_model("llama-3-8b"), get_gpu("h100-sxm"), TrainingSetup(seq_len=1024, tp=3))
