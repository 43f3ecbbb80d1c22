"""The sim's configuration (config.py): strict, and the KV cache sized by the planner unless given."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.step_time import RooflineStepTime, roofline_num_gpu_blocks


def test_the_default_is_the_h100_llama_70b_tp8_fp8_preset_sized_by_the_planner() -> None:
    config = SimEngineConfig()
    assert config.step_time == RooflineStepTime()
    assert config.resolved_num_gpu_blocks() == roofline_num_gpu_blocks(RooflineStepTime(), 16, 8192)


def test_the_measured_model_needs_a_block_count() -> None:
    with pytest.raises(ValidationError, match="num_gpu_blocks is required"):
        SimEngineConfig.model_validate({"step_time": {"kind": "measured", "step_s": 0.01, "per_seq_s": 0,
                                                      "per_prefill_token_s": 0}})
    given = SimEngineConfig.model_validate({"num_gpu_blocks": 50, "step_time": {
        "kind": "measured", "step_s": 0.01, "per_seq_s": 0, "per_prefill_token_s": 0}})
    assert given.resolved_num_gpu_blocks() == 50


@pytest.mark.parametrize("field, value", [("max_num_seq", 4), ("time_scale", 0), ("block_size", 0)])
def test_a_typo_or_an_impossible_value_is_an_error(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        SimEngineConfig.model_validate({field: value})
