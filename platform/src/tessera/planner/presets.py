"""Named models and accelerators, so a plan can say ``llama-3-70b`` on ``h100-sxm``.

Model shapes come from the models' papers and released ``config.json`` files; the Megatron models are the
GPT shapes of Korthikanti et al. 2022 (Table 3), with their padded vocabulary of 51,200 and tied
embeddings. Accelerator memory is the total the driver reports (``nvidia-smi``), which is what vLLM's
``gpu_memory_utilization`` multiplies; peaks are dense BF16/FP8 from NVIDIA's datasheets.
"""

from __future__ import annotations

from pathlib import Path

from tessera.planner._units import GB, MIB, TFLOP
from tessera.planner.hardware import AcceleratorSpec
from tessera.planner.shapes import ModelShape, read_hf_config


def _llama(
    name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int
) -> ModelShape:
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        gated_mlp=True,
        tie_embeddings=False,
        norm="rmsnorm",
    )


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, positions: int) -> ModelShape:
    """A GPT-3 / Megatron GPT model: multi-head attention, 4h GeLU MLP, LayerNorm, biases, dropout."""
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        ffn_hidden_size=4 * hidden,
        vocab_size=vocab,
        gated_mlp=False,
        tie_embeddings=True,
        norm="layernorm",
        attention_bias=True,
        mlp_bias=True,
        learned_positions=positions,
        dropout=True,
    )


MODEL_PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
        _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
        _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
        _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
        _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),
        _llama("llama-3-405b", 126, 16384, 128, 8, 53248, 128256),
        _gpt("gpt-3-175b", 96, 12288, 96, 50257, 2048),
        _gpt("megatron-22b", 48, 6144, 64, 51200, 2048),
        _gpt("megatron-175b", 96, 12288, 96, 51200, 2048),
        _gpt("megatron-530b", 105, 20480, 128, 51200, 2048),
        _gpt("megatron-1t", 128, 25600, 160, 51200, 2048),
        # PaLM 540B (Chowdhery et al. 2022, Table 1): multi-query attention with d = 256, SwiGLU with
        # f = 4h, shared input/output embeddings, no biases. The reference's MFU numbers use it.
        ModelShape(
            name="palm-540b",
            num_layers=118,
            hidden_size=18432,
            num_heads=48,
            num_kv_heads=1,
            head_dim=256,
            ffn_hidden_size=4 * 18432,
            vocab_size=256000,
            gated_mlp=True,
            tie_embeddings=True,
            norm="rmsnorm",
        ),
        # OPT-13B (Zhang et al. 2022), the vLLM paper's running example for KV bytes per token.
        ModelShape(
            name="opt-13b",
            num_layers=40,
            hidden_size=5120,
            num_heads=40,
            ffn_hidden_size=20480,
            vocab_size=50272,
            gated_mlp=False,
            tie_embeddings=True,
            norm="layernorm",
            attention_bias=True,
            mlp_bias=True,
            learned_positions=2050,
        ),
    )
}

GPU_PRESETS: dict[str, AcceleratorSpec] = {
    spec.name: spec
    for spec in (
        AcceleratorSpec(
            name="a100-40gb",
            memory_bytes=40960 * MIB,
            hbm_bandwidth_bytes_per_s=1555 * GB,
            peak_bf16_flops=312 * TFLOP,
            nvlink_bandwidth_bytes_per_s=600 * GB,
            infiniband_bandwidth_bytes_per_s=25 * GB,
        ),
        AcceleratorSpec(
            name="a100-80gb",
            memory_bytes=81920 * MIB,
            hbm_bandwidth_bytes_per_s=2039 * GB,
            peak_bf16_flops=312 * TFLOP,
            nvlink_bandwidth_bytes_per_s=600 * GB,
            infiniband_bandwidth_bytes_per_s=25 * GB,
        ),
        AcceleratorSpec(
            name="h100-sxm",
            memory_bytes=81559 * MIB,
            hbm_bandwidth_bytes_per_s=3350 * GB,
            peak_bf16_flops=989.4 * TFLOP,
            peak_fp8_flops=1978.9 * TFLOP,
            nvlink_bandwidth_bytes_per_s=900 * GB,
            infiniband_bandwidth_bytes_per_s=50 * GB,
        ),
        AcceleratorSpec(
            name="h200",
            memory_bytes=143771 * MIB,
            hbm_bandwidth_bytes_per_s=4800 * GB,
            peak_bf16_flops=989.4 * TFLOP,
            peak_fp8_flops=1978.9 * TFLOP,
            nvlink_bandwidth_bytes_per_s=900 * GB,
            infiniband_bandwidth_bytes_per_s=50 * GB,
        ),
    )
}


def get_model(name: str) -> ModelShape:
    """A preset model by name; ``ValueError`` lists the valid names."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(sorted(MODEL_PRESETS))}") from None


def get_gpu(name: str) -> AcceleratorSpec:
    """A preset accelerator by name; ``ValueError`` lists the valid names."""
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(sorted(GPU_PRESETS))}") from None


def resolve_model(name_or_path: str) -> ModelShape:
    """A preset name, or a path to a Hugging Face ``config.json`` (or the model directory holding it)."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_dir():
        if not path.exists():
            raise ValueError(f"{name_or_path}: no such file or directory")
        return read_hf_config(path)
    return get_model(name_or_path)
