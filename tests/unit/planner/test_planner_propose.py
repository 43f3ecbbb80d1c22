"""Engine-setting proposals and the Helm values they become, validated by the engine's own config model."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from tessera.engine.config import EngineConfig
from tessera.planner import ServeRequest, get_gpu, get_model, plan_serving, propose_engine_settings
from tessera.planner.propose import proposed_utilization, tp_candidates
from tessera.planner.values import ENGINE_BLOCK_SIZE, engine_values, helm_values, render_values_yaml

H100 = get_gpu("h100-sxm")


def propose(model: str, **request: object):  # type: ignore[no-untyped-def]
    return propose_engine_settings(
        get_model(model), H100, ServeRequest.model_validate({"context_len": 8192, **request}), block_size=16
    )


def test_llama_3_8b_fits_one_h100() -> None:
    proposal = propose("llama-3-8b")
    assert proposal is not None
    assert (proposal.tensor_parallel_size, proposal.kv_cache_dtype, proposal.max_model_len) == (
        1,
        "fp8",
        8192,
    )
    assert proposal.max_num_seqs % 8 == 0 and 16 <= proposal.max_num_seqs <= proposal.capacity.concurrent_seqs
    assert (proposal.speculative_method, proposal.num_speculative_tokens) == ("ngram", 3)


def test_llama_3_70b_takes_the_smallest_tp_that_holds_16_sequences() -> None:
    proposal = propose("llama-3-70b")
    assert proposal is not None and proposal.tensor_parallel_size == 4
    at_two = propose("llama-3-70b", tp=2, min_concurrent_seqs=1)
    assert at_two is not None and at_two.capacity.concurrent_seqs < 16  # why 2 was passed over


def test_405b_needs_fp8_weights_on_one_node() -> None:
    assert propose("llama-3-405b") is None
    fp8 = propose("llama-3-405b", weight_dtype="fp8")
    assert fp8 is not None and fp8.tensor_parallel_size == 8


def test_bf16_kv_is_auto_for_the_engine_and_replicas_follow_gpus() -> None:
    proposal = propose("llama-2-70b", kv_dtype="bf16", gpus=16)
    assert proposal is not None
    assert proposal.kv_cache_dtype == "auto"
    assert proposal.replicas == 16 // proposal.tensor_parallel_size


def test_utilization_rule() -> None:
    assert proposed_utilization(H100, 3.0) == 0.95  # capped
    assert proposed_utilization(get_gpu("a100-40gb"), 3.0) == 0.92  # 1 − 3/40 = 0.925, rounded down
    assert propose("llama-3-8b", gpu_memory_utilization=0.8).gpu_memory_utilization == 0.8  # type: ignore[union-attr]


def test_speculation_off_when_verification_makes_the_step_compute_bound() -> None:
    proposal = propose(
        "llama-3-8b",
        context_len=512,
        acceptance_rate=0.2,
        num_speculative_tokens=2,
        max_num_seqs_cap=1024,
    )
    assert proposal is not None and proposal.speculative_method is None
    assert proposal.reasons[-1].startswith("speculative decoding off")
    assert propose("llama-3-8b", speculative_method="none").speculative_method is None  # type: ignore[union-attr]


def test_tp_candidates_split_heads() -> None:
    assert tp_candidates(get_model("llama-3-70b"), H100, 8) == (1, 2, 4, 8)
    assert tp_candidates(get_model("megatron-22b"), H100, 8) == (1, 2, 4, 8)
    assert tp_candidates(get_model("llama-2-13b"), H100, 8) == (1, 2, 4, 8)  # 40 heads


def test_values_parse_back_into_engine_config() -> None:
    proposal = propose("llama-3-8b")
    assert proposal is not None
    values = helm_values(proposal, model_path="/models/llama-3-8b", served_model_name="llama-3-8b")
    text = render_values_yaml(values, header=proposal.reasons)
    loaded = yaml.safe_load(text)
    entry = loaded["models"][0]
    assert (entry["name"], entry["replicas"]) == ("llama-3-8b", 1)
    engine = entry["engine"]
    # proposed fields are written even when they equal the engine's defaults
    assert engine["kvCacheDtype"] == "fp8" and "gpuMemoryUtilization" in engine
    assert engine["speculative"] == {"method": "ngram", "numSpeculativeTokens": 3}
    config = EngineConfig.model_validate(engine)
    assert (config.tensor_parallel_size, config.max_num_seqs, config.max_model_len) == (
        1,
        proposal.max_num_seqs,
        8192,
    )
    assert config.speculative is not None and config.speculative.num_speculative_tokens == 3
    assert text.startswith("# tensor_parallel_size=1")


def test_values_turn_speculation_off_explicitly() -> None:
    proposal = propose("llama-3-8b", speculative_method="none")
    assert proposal is not None
    config = EngineConfig.model_validate(
        helm_values(proposal, model_path="/m", served_model_name="m")["models"][0]["engine"]
    )
    assert config.speculative is None


def test_engine_refuses_a_draft_method_without_a_checkpoint() -> None:
    proposal = propose("llama-3-8b", speculative_method="eagle")
    assert proposal is not None and proposal.speculative_method == "eagle"
    with pytest.raises(ValidationError, match="draft_model"):
        helm_values(proposal, model_path="/m", served_model_name="m")
    with_draft = propose("llama-3-8b", speculative_method="eagle", draft_model="/models/eagle")
    assert with_draft is not None
    engine = helm_values(with_draft, model_path="/m", served_model_name="m")["models"][0]["engine"]
    assert engine["speculative"]["draftModel"] == "/models/eagle"


def test_engine_values_keep_other_non_defaults() -> None:
    config = EngineConfig(model="/m", served_model_name="m", block_size=16, enforce_eager=False)
    block = engine_values(config)
    assert list(block)[:2] == ["model", "servedModelName"]
    assert block["blockSize"] == 16 and block["enforceEager"] is False


def test_plan_serving_uses_the_proposal() -> None:
    plan = plan_serving(
        get_model("llama-3-70b"), H100, ServeRequest(context_len=8192), block_size=ENGINE_BLOCK_SIZE
    )
    assert plan.proposal is not None and plan.tp == plan.proposal.tensor_parallel_size
    assert [row.kv_dtype for row in plan.kv_rows] == ["bf16", "fp8", "int8"]
    assert plan.decode_batch == plan.proposal.max_num_seqs
    assert plan.decode.regime == "memory-bound" and plan.prefill.regime == "compute-bound"
    too_big = plan_serving(get_model("llama-3-405b"), H100, ServeRequest(context_len=8192))
    assert too_big.proposal is None and too_big.tp == 8 and not too_big.kv_rows[0].fits


def test_a_tp_that_cannot_split_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="valid up to a node: 1, 2, 4, 8"):
        propose("llama-3-70b", tp=3)
