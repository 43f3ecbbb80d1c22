"""Presets, parameter counts against the released checkpoints, and reading Hugging Face configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tessera.planner import (
    GPU_PRESETS,
    MODEL_PRESETS,
    ModelShape,
    count_params,
    get_gpu,
    get_model,
    read_hf_config,
    resolve_model,
    shape_from_hf_config,
)

LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
OPT_13B_CONFIG = {
    "model_type": "opt",
    "activation_function": "relu",
    "hidden_size": 5120,
    "ffn_dim": 20480,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "do_layer_norm_before": True,
    "word_embed_proj_dim": 5120,
}
GPT2_CONFIG = {
    "model_type": "gpt2",
    "activation_function": "gelu_new",
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "n_inner": None,
    "vocab_size": 50257,
}


@pytest.mark.parametrize(
    ("preset", "released"),
    [
        # exact parameter counts of the released checkpoints
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-13b", 13_015_864_320),
        ("llama-2-70b", 68_976_648_192),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("llama-3-405b", 405_853_388_800),
    ],
)
def test_llama_parameter_counts_are_exact(preset: str, released: int) -> None:
    assert count_params(get_model(preset)).total == released


@pytest.mark.parametrize(
    ("preset", "nominal"),
    [("gpt-3-175b", 175e9), ("megatron-22b", 22e9), ("megatron-175b", 175e9), ("megatron-530b", 530e9)],
)
def test_gpt_parameter_counts_match_their_names(preset: str, nominal: float) -> None:
    assert count_params(get_model(preset)).total == pytest.approx(nominal, rel=0.005)


def test_megatron_1t_is_about_a_trillion() -> None:
    assert count_params(get_model("megatron-1t")).total == pytest.approx(1e12, rel=0.01)


def test_every_issue_preset_exists() -> None:
    wanted = {
        "llama-2-7b",
        "llama-2-13b",
        "llama-2-70b",
        "llama-3-8b",
        "llama-3-70b",
        "llama-3-405b",
        "gpt-3-175b",
        "megatron-22b",
        "megatron-175b",
        "megatron-530b",
        "megatron-1t",
    }
    assert wanted <= set(MODEL_PRESETS)
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200"} == set(GPU_PRESETS)


def test_unknown_presets_list_the_valid_names() -> None:
    with pytest.raises(ValueError, match="llama-3-8b"):
        get_model("llama-4")
    with pytest.raises(ValueError, match="h100-sxm"):
        get_gpu("b200")
    assert get_model("Llama-3-8B") is MODEL_PRESETS["llama-3-8b"]


def test_llama_config_reads_as_the_preset() -> None:
    shape = shape_from_hf_config(LLAMA_3_8B_CONFIG, name="llama-3-8b")
    assert shape == get_model("llama-3-8b")


def test_opt_and_gpt2_configs() -> None:
    opt = shape_from_hf_config(OPT_13B_CONFIG, name="opt-13b")
    assert opt == get_model("opt-13b")
    gpt2 = shape_from_hf_config(GPT2_CONFIG)
    assert (gpt2.gated_mlp, gpt2.norm, gpt2.tie_embeddings, gpt2.ffn_hidden_size) == (
        False,
        "layernorm",
        True,
        3072,
    )
    assert count_params(gpt2).total == 124_439_808  # GPT-2 small


def test_nested_text_config_and_refusals() -> None:
    nested = {"model_type": "llava", "text_config": LLAMA_3_8B_CONFIG}
    assert shape_from_hf_config(nested).num_kv_heads == 8
    with pytest.raises(ValueError, match="mixture-of-experts"):
        shape_from_hf_config({**LLAMA_3_8B_CONFIG, "num_local_experts": 8})
    with pytest.raises(ValueError, match="hidden_size"):
        shape_from_hf_config({"model_type": "llama", "num_hidden_layers": 2, "vocab_size": 10})


def test_read_config_from_file_or_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "llama-3-8b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_3_8B_CONFIG))
    assert read_hf_config(model_dir).name == "llama-3-8b"
    assert resolve_model(str(model_dir / "config.json")).kv_heads == 8
    assert resolve_model(str(model_dir)) == read_hf_config(model_dir)
    with pytest.raises(ValueError, match="no such file"):
        resolve_model(str(tmp_path / "missing.json"))


def test_shape_validation() -> None:
    base = {"num_layers": 2, "hidden_size": 10, "num_heads": 3, "ffn_hidden_size": 16, "vocab_size": 10}
    with pytest.raises(ValidationError, match="head_dim"):
        ModelShape.model_validate(base)
    with pytest.raises(ValidationError, match="multiple of num_kv_heads"):
        ModelShape.model_validate({**base, "hidden_size": 12, "num_kv_heads": 2})
    with pytest.raises(ValidationError, match="extra"):
        ModelShape.model_validate({**base, "hidden_size": 12, "num_experts": 8})
    explicit = ModelShape.model_validate({**base, "head_dim": 4})
    assert (explicit.head_size, explicit.query_width, explicit.kv_width) == (4, 12, 12)
