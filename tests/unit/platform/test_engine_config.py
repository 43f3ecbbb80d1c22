from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera.engine.config import EngineConfig, SpeculativeConfig


def test_defaults_are_fp8_ngram_prefix_caching_priority() -> None:
    config = EngineConfig(model="/m")
    assert config.kv_cache_dtype == "fp8"
    assert config.speculative is not None and config.speculative.method == "ngram"
    assert config.enable_prefix_caching and config.scheduling_policy == "priority"
    assert config.kv_events.enabled
    kwargs = config.to_vllm_kwargs()
    assert kwargs["kv_cache_dtype"] == "fp8"
    assert kwargs["speculative_config"]["method"] == "ngram"
    assert kwargs["kv_events_config"].enable_kv_cache_events


def test_unknown_field_is_an_error_naming_it() -> None:
    with pytest.raises(ValidationError) as info:
        EngineConfig.model_validate({"model": "/m", "kv_cache_dtyp": "fp8"})
    assert "kv_cache_dtyp" in str(info.value)


def test_unknown_nested_field_is_an_error_naming_it() -> None:
    with pytest.raises(ValidationError) as info:
        EngineConfig.model_validate({"model": "/m", "speculative": {"method": "ngram", "tokens": 3}})
    assert "tokens" in str(info.value)


def test_camel_case_aliases_round_trip() -> None:
    config = EngineConfig.model_validate({"model": "/m", "kvCacheDtype": "auto", "maxNumSeqs": 8,
                                          "speculative": {"method": "ngram", "numSpeculativeTokens": 5}})
    assert config.kv_cache_dtype == "auto" and config.max_num_seqs == 8
    assert EngineConfig.model_validate(config.model_dump(by_alias=True)) == config


def test_bad_kv_dtype_lists_the_valid_ones() -> None:
    with pytest.raises(ValidationError) as info:
        EngineConfig(model="/m", kv_cache_dtype="int3")  # type: ignore[arg-type]
    assert "fp8_e5m2" in str(info.value)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_draft_methods_need_a_draft_model(method: str) -> None:
    with pytest.raises(ValidationError, match="draft_model"):
        SpeculativeConfig(method=method)  # type: ignore[arg-type]
    spec = SpeculativeConfig(method=method, draft_model="/draft")  # type: ignore[arg-type]
    assert spec.to_vllm()["model"] == "/draft"


def test_ngram_rejects_a_draft_model() -> None:
    with pytest.raises(ValidationError, match="only used by"):
        SpeculativeConfig(method="ngram", draft_model="/draft")


def test_speculation_can_be_turned_off() -> None:
    assert "speculative_config" not in EngineConfig(model="/m", speculative=None).to_vllm_kwargs()


def test_block_override_must_hold_the_context() -> None:
    with pytest.raises(ValidationError, match="exceeds the KV capacity"):
        EngineConfig(model="/m", num_gpu_blocks_override=4, block_size=32, max_model_len=256)
    EngineConfig(model="/m", num_gpu_blocks_override=8, block_size=32, max_model_len=256)


def test_cpu_block_size_must_be_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        EngineConfig(model="/m", block_size=16).validate_for_cpu()


def test_dynamic_kv_scales_map_to_per_token_head_fp8() -> None:
    assert EngineConfig(model="/m", kv_scale_mode="dynamic").vllm_kv_cache_dtype == "fp8_per_token_head"
    with pytest.raises(ValidationError, match="kv_scale_mode"):
        EngineConfig(model="/m", kv_cache_dtype="auto", kv_scale_mode="dynamic")


def test_free_port_honours_a_range() -> None:
    from tessera.engine.ports import free_port

    assert 41000 <= free_port(port_range="41000-41010") <= 41010
    with pytest.raises(ValueError, match="port range"):
        free_port(port_range="9-2")
