"""A decoder-only transformer's shape, its parameter count, and reading one from a Hugging Face config.

Symbols follow the planner reference: L layers, h hidden size, a query heads, g KV heads, d head dim,
f FFN width, V vocabulary. ``N`` is every parameter; ``N_mm`` is the parameters that take part in a
matmul for each token: the layers' projection weights plus the output (logit) projection. The input
embedding is a table lookup, not a matmul, so it is not in ``N_mm`` unless it is tied to the output
projection, in which case the one matrix is counted once, as the logit layer. Biases and norm scales
are in ``N`` but not in ``N_mm`` (they cost O(h) per token, not O(h²)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Hugging Face model types whose MLP is gated (gate, up and down projections), whatever `hidden_act` says.
_GATED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo",
        "olmo2",
        "granite",
    }
)
_GATED_ACTIVATIONS = frozenset({"silu", "swish", "swiglu", "geglu"})
# Model types that add a learned absolute position table instead of rotary embeddings.
_LEARNED_POSITION_TYPES = frozenset({"gpt2", "opt", "gpt_neo", "gpt_bigcode"})
# OPT reserves two extra rows in its position table (padding offset).
_POSITION_OFFSET = {"opt": 2}


class ModelShape(BaseModel):
    """The shape of a decoder-only transformer: everything the planner's formulas need."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="custom", description="Label shown in reports.")
    num_layers: int = Field(ge=1, description="Transformer layers (L).")
    hidden_size: int = Field(ge=1, description="Model width (h).")
    num_heads: int = Field(ge=1, description="Query heads (a).")
    num_kv_heads: int | None = Field(
        default=None, ge=1, description="Key/value heads (g); null means a (multi-head attention)."
    )
    head_dim: int | None = Field(default=None, ge=1, description="Width of one head (d); null means h / a.")
    ffn_hidden_size: int = Field(ge=1, description="Inner width of the MLP (f).")
    vocab_size: int = Field(ge=1, description="Vocabulary size (V), padded as the checkpoint stores it.")
    gated_mlp: bool = Field(
        default=True,
        description="SwiGLU-style MLP (gate, up and down projections, 3·h·f weights); "
        "false: a 2-matrix GeLU MLP.",
    )
    tie_embeddings: bool = Field(
        default=False, description="Input embedding and output projection share one matrix."
    )
    norm: Literal["rmsnorm", "layernorm"] = Field(
        default="rmsnorm", description="Normalisation: RMSNorm (scale only) or LayerNorm (scale and bias)."
    )
    attention_bias: bool = Field(default=False, description="Q/K/V/output projections carry biases.")
    mlp_bias: bool = Field(default=False, description="MLP projections carry biases.")
    learned_positions: int = Field(
        default=0, ge=0, description="Rows of a learned absolute position table (GPT-2, OPT); 0 for rotary."
    )
    dropout: bool = Field(
        default=False,
        description="Trained with dropout (GPT/Megatron style): adds the dropout masks of Korthikanti "
        "et al. to activation memory. Llama models train without it.",
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelShape:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                "give head_dim"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}")
        return self

    @property
    def kv_heads(self) -> int:
        """g: key/value heads (equal to a for multi-head attention)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        """d: width of one attention head."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def query_width(self) -> int:
        """a·d: width of the concatenated query heads (equal to h in most models)."""
        return self.num_heads * self.head_size

    @property
    def kv_width(self) -> int:
        """g·d: width of the keys (and of the values) of one token in one layer."""
        return self.kv_heads * self.head_size


def can_split_heads(shape: ModelShape, tp: int) -> bool:
    """Whether ``tp`` GPUs can share the query heads evenly, and the KV heads evenly or by replication."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    return shape.num_heads % tp == 0 and (shape.kv_heads % tp == 0 or tp % shape.kv_heads == 0)


def kv_heads_per_gpu(shape: ModelShape, tp: int) -> float:
    """KV heads one GPU of a TP group holds: g/t, or one replicated head when t exceeds g."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    return shape.kv_heads / tp if tp <= shape.kv_heads else 1.0


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameters of a model, split the way the FLOP and memory formulas use them."""

    attention_per_layer: int
    mlp_per_layer: int
    norm_and_bias_per_layer: int
    embedding: int
    position_embedding: int
    output_projection: int
    final_norm: int

    def layers_matmul(self, num_layers: int) -> int:
        return num_layers * (self.attention_per_layer + self.mlp_per_layer)

    def layers_total(self, num_layers: int) -> int:
        return num_layers * (self.attention_per_layer + self.mlp_per_layer + self.norm_and_bias_per_layer)


@dataclass(frozen=True, slots=True)
class ModelParams:
    """``N`` (total), ``N_mm`` (matmul weights per token) and the pieces they are made of."""

    total: int
    matmul: int
    layers_matmul: int
    logits: int
    breakdown: ParamCount


def count_params(shape: ModelShape) -> ModelParams:
    """Count parameters from the shape (exact for Llama, GPT-2/3, OPT, Megatron GPT)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    attention = h * shape.query_width + 2 * h * shape.kv_width + shape.query_width * h
    mlp = (3 if shape.gated_mlp else 2) * h * f
    norm_params_each = h if shape.norm == "rmsnorm" else 2 * h
    biases = 0
    if shape.attention_bias:
        biases += shape.query_width + 2 * shape.kv_width + h
    if shape.mlp_bias:
        biases += (2 if shape.gated_mlp else 1) * f + h
    breakdown = ParamCount(
        attention_per_layer=attention,
        mlp_per_layer=mlp,
        norm_and_bias_per_layer=2 * norm_params_each + biases,
        embedding=shape.vocab_size * h,
        position_embedding=shape.learned_positions * h,
        output_projection=0 if shape.tie_embeddings else shape.vocab_size * h,
        final_norm=norm_params_each,
    )
    layers_matmul = breakdown.layers_matmul(shape.num_layers)
    logits = shape.vocab_size * h
    total = (
        breakdown.layers_total(shape.num_layers)
        + breakdown.embedding
        + breakdown.position_embedding
        + breakdown.output_projection
        + breakdown.final_norm
    )
    return ModelParams(
        total=total,
        matmul=layers_matmul + logits,
        layers_matmul=layers_matmul,
        logits=logits,
        breakdown=breakdown,
    )


def _first(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def shape_from_hf_config(config: dict[str, Any], name: str | None = None) -> ModelShape:
    """Build a :class:`ModelShape` from a Hugging Face ``config.json`` (already parsed).

    Understands the Llama family (Llama, Mistral, Qwen2/3, Gemma, Phi-3), GPT-2 and OPT key names, and
    multimodal configs that nest the language model under ``text_config``. Mixture-of-experts configs
    are refused: the planner's formulas are for dense models.
    """
    if "text_config" in config and "num_hidden_layers" not in config:
        config = {**config["text_config"], "_name_or_path": config.get("_name_or_path")}
    if _first(config, "num_local_experts", "num_experts", "n_routed_experts"):
        raise ValueError(
            "mixture-of-experts configs are not supported: the planner models dense transformers"
        )
    model_type = str(config.get("model_type", "")).lower()
    num_layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    vocab = _first(config, "vocab_size")
    missing = [
        key
        for key, value in (
            ("num_hidden_layers", num_layers),
            ("hidden_size", hidden),
            ("num_attention_heads", heads),
        )
        if value is None
    ]
    if vocab is None:
        missing.append("vocab_size")
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}; give the shape explicitly instead")
    kv_heads = _first(config, "num_key_value_heads")
    if kv_heads is None and config.get("multi_query"):
        kv_heads = 1
    ffn = _first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * int(hidden)
    activation = str(_first(config, "hidden_act", "activation_function", "hidden_activation") or "").lower()
    gated = model_type in _GATED_MODEL_TYPES or activation in _GATED_ACTIVATIONS
    learned_positions = 0
    if model_type in _LEARNED_POSITION_TYPES:
        positions = _first(config, "max_position_embeddings", "n_positions", "n_ctx") or 0
        learned_positions = int(positions) + _POSITION_OFFSET.get(model_type, 0)
    uses_rmsnorm = _first(config, "rms_norm_eps", "rms_norm_epsilon") is not None
    label = name or str(config.get("_name_or_path") or model_type or "hf-config")
    return ModelShape(
        name=label,
        num_layers=int(num_layers),
        hidden_size=int(hidden),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads) if kv_heads is not None else None,
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        ffn_hidden_size=int(ffn),
        vocab_size=int(vocab),
        gated_mlp=gated,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        norm="rmsnorm" if uses_rmsnorm else "layernorm",
        attention_bias=bool(config.get("attention_bias", model_type in {"qwen2", "gpt2", "opt"})),
        mlp_bias=bool(config.get("mlp_bias", model_type in {"gpt2", "opt"})),
        learned_positions=learned_positions,
    )


def read_hf_config(path: Path, name: str | None = None) -> ModelShape:
    """Read ``config.json`` (or a model directory holding one) into a :class:`ModelShape`."""
    config_path = path / "config.json" if path.is_dir() else path
    with config_path.open(encoding="utf-8") as handle:
        config = json.load(handle)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} does not hold a JSON object")
    return shape_from_hf_config(config, name=name or (path.name if path.is_dir() else path.parent.name))
