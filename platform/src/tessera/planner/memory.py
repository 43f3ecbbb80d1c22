"""Training memory per GPU: model states under ZeRO 0–3 and activations under each recomputation mode.

Model states, mixed-precision Adam (ZeRO paper): 2 bytes of BF16 weights, 2 of BF16 gradients and 12 of
optimizer state (FP32 master weights, momentum, variance) per parameter, 16Ψ in all. ZeRO-1 shards the
optimizer state over the n_d data-parallel ranks (``4Ψ + 12Ψ/n_d``), ZeRO-2 the gradients too
(``2Ψ + 14Ψ/n_d``), ZeRO-3 everything (``16Ψ/n_d``).

Activations per layer follow Korthikanti et al. 2022 (Table 2), derived term by term so that they hold
for GQA and SwiGLU too. Bytes per layer for one micro-batch of b sequences of s tokens, 16-bit, masks
1 byte per element:

* replicated under tensor parallelism (split only by sequence parallelism): the two norm inputs (2sbh
  each), the QKV projection input and the MLP input (2sbh each), and with dropout the two residual
  dropout masks (sbh each). GPT: 10·sbh.
* split by tensor parallelism: Q (2·s·b·a·d), K and V (2·s·b·g·d each: GQA shrinks these by a/g), the
  attention output that feeds the output projection (2·s·b·a·d), and the MLP intermediates. A 4h GeLU MLP
  keeps the activation's input and output (2·2·s·b·f = 16sbh); SwiGLU keeps the gate and up outputs
  and their product (3·2·s·b·f), its SiLU being recomputed from the gate. GPT: 24·sbh.
* the score matrices, split by tensor parallelism: softmax output (2·a·s²·b), and with dropout its
  mask and output (3·a·s²·b). GPT: 5·a·s²·b. FlashAttention stores none of them, only the FP32
  log-sum-exp per query (4·a·s·b).

So GPT recovers Table 2 exactly: ``sbh(34 + 5as/h)`` alone, ``sbh(10 + 24/t + 5as/(ht))`` with TP,
``sbh(34/t + 5as/(ht))`` with TP+SP; selective recomputation drops the score term; full recomputation
keeps only the layer input, ``2sbh`` (÷t with SP). Context parallelism splits s over c ranks (the scores
of the s/c local queries against all s keys).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.planner.flops import RecomputeMode
from tessera.planner.shapes import ModelShape

ZERO_STAGES = (0, 1, 2, 3)
WEIGHT_BYTES = 2
GRADIENT_BYTES = 2
OPTIMIZER_BYTES = 12


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Bytes of weights, gradients and optimizer state one GPU holds."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(
    num_params: float,
    zero_stage: int,
    dp: int,
    *,
    weight_bytes: float = WEIGHT_BYTES,
    gradient_bytes: float = GRADIENT_BYTES,
    optimizer_bytes: float = OPTIMIZER_BYTES,
) -> ModelStateBytes:
    """Model states of ``num_params`` parameters (already divided by TP×PP) under a ZeRO stage."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"unknown ZeRO stage {zero_stage}; valid: {', '.join(map(str, ZERO_STAGES))}")
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    return ModelStateBytes(
        weights=num_params * weight_bytes / (dp if zero_stage >= 3 else 1),
        gradients=num_params * gradient_bytes / (dp if zero_stage >= 2 else 1),
        optimizer=num_params * optimizer_bytes / (dp if zero_stage >= 1 else 1),
    )


@dataclass(frozen=True, slots=True)
class ActivationTerms:
    """One layer's stored activations for one micro-batch, bytes, before any parallel split."""

    replicated: float
    tensor_parallel: float
    scores: float
    layer_input: float

    @property
    def total(self) -> float:
        return self.replicated + self.tensor_parallel + self.scores


def activation_terms(
    shape: ModelShape, seq_len: int, micro_batch: int, *, flash_attention: bool = False, cp: int = 1
) -> ActivationTerms:
    """The three groups of the module docstring for ``s/cp`` local tokens of ``micro_batch`` sequences."""
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} must be a multiple of the context-parallel degree {cp}")
    local_tokens = seq_len // cp * micro_batch
    h, f = shape.hidden_size, shape.ffn_hidden_size
    masks = 2 if shape.dropout else 0
    replicated = local_tokens * h * (2 + 2 + 2 + 2 + masks)
    attention_tp = 2 * shape.query_width + 2 * shape.kv_width + 2 * shape.kv_width + 2 * shape.query_width
    mlp_tp = (3 if shape.gated_mlp else 2) * 2 * f
    tensor_parallel = local_tokens * (attention_tp + mlp_tp)
    if flash_attention:
        scores = 4.0 * shape.num_heads * local_tokens
    else:
        per_score = 2 + (3 if shape.dropout else 0)
        scores = float(per_score * shape.num_heads * local_tokens * seq_len)
    return ActivationTerms(
        replicated=float(replicated),
        tensor_parallel=float(tensor_parallel),
        scores=scores,
        layer_input=float(2 * local_tokens * h),
    )


def activation_bytes_per_layer(
    terms: ActivationTerms, *, tp: int, sequence_parallel: bool, recompute: RecomputeMode
) -> float:
    """Stored bytes per layer per micro-batch on one GPU (Korthikanti et al. Table 2, generalised)."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    replicated = terms.replicated / tp if sequence_parallel else terms.replicated
    if recompute == "full":
        return terms.layer_input / tp if sequence_parallel else terms.layer_input
    if recompute == "selective":
        return replicated + terms.tensor_parallel / tp
    if recompute == "none":
        return replicated + (terms.tensor_parallel + terms.scores) / tp
    raise ValueError(f"unknown recomputation mode {recompute!r}; valid: none, selective, full")


@dataclass(frozen=True, slots=True)
class ActivationMemory:
    """Activations one GPU holds at its peak, bytes."""

    per_layer: float
    layers_in_flight: float
    recompute_working_set: float
    logits: float

    @property
    def layers(self) -> float:
        return self.per_layer * self.layers_in_flight + self.recompute_working_set

    @property
    def total(self) -> float:
        return self.layers + self.logits


def logits_bytes(shape: ModelShape, seq_len: int, micro_batch: int, *, tp: int, cp: int = 1) -> float:
    """FP32 logits kept for the cross-entropy backward on the last stage: ``4·s·b·V/t`` (÷cp)."""
    return 4.0 * (seq_len // cp) * micro_batch * shape.vocab_size / tp


def activation_memory(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    *,
    tp: int,
    sequence_parallel: bool,
    recompute: RecomputeMode,
    layers_in_flight: float,
    flash_attention: bool = False,
    cp: int = 1,
    include_logits: bool = True,
) -> ActivationMemory:
    """Peak activations on one GPU holding ``layers_in_flight`` layer-micro-batches (see pipeline.py).

    Full recomputation stores only each layer's input but, during the backward, rebuilds one layer's
    activations at a time: that one layer (stored as with no recomputation) is the working set.
    """
    terms = activation_terms(shape, seq_len, micro_batch, flash_attention=flash_attention, cp=cp)
    per_layer = activation_bytes_per_layer(
        terms, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute
    )
    working_set = 0.0
    if recompute == "full":
        working_set = activation_bytes_per_layer(
            terms, tp=tp, sequence_parallel=sequence_parallel, recompute="none"
        )
    logits = logits_bytes(shape, seq_len, micro_batch, tp=tp, cp=cp) if include_logits else 0.0
    return ActivationMemory(
        per_layer=per_layer,
        layers_in_flight=layers_in_flight,
        recompute_working_set=working_set,
        logits=logits,
    )
