"""Which request classes can ask for more than the model's context: longest prompt + max_tokens > max_model_len.

A server rejects such a request (400) instead of serving it, so a class that overflows measures
rejections, not latency. The longest prompt is the prompt distribution's largest value plus the class's
prefix; for multi-turn sessions, the last turn of the longest session, which carries every earlier
question and answer. Distributions without a largest value (lognormal or normal without ``max``,
exponential) count with their 99.9th percentile and say so. ShareGPT prompts have no asked length and are
not checked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tessera_loadgen.workload import RequestClass, Workload


@dataclass(frozen=True, slots=True)
class ClassLengths:
    """The longest request a class can send, in (asked) tokens."""

    prompt_tokens: int
    output_tokens: int
    bounded: bool
    num_turns: int = 1

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class ContextOverflow:
    """A class whose longest request does not fit the model's context."""

    tenant: str
    request_class: str
    model: str | None
    lengths: ClassLengths
    max_model_len: int

    def message(self) -> str:
        lengths = self.lengths
        bound = "up to" if lengths.bounded else "at p99.9 up to"
        model = f" of {self.model}" if self.model else ""
        turn = f" (turn {lengths.num_turns} with its history)" if lengths.num_turns > 1 else ""
        return (
            f"tenant {self.tenant!r} class {self.request_class!r}: prompt {bound} {lengths.prompt_tokens}{turn} + "
            f"max_tokens up to {lengths.output_tokens} = {lengths.total_tokens} tokens > max_model_len "
            f"{self.max_model_len}{model}; the server will reject such requests"
        )


def class_lengths(request_class: RequestClass, prefix_tokens: int) -> ClassLengths | None:
    """The longest prompt and output of ``request_class``; ``None`` for ShareGPT prompts (no asked length)."""
    if request_class.prompt.source != "synthetic":
        return None
    prompt, prompt_bounded = request_class.prompt.tokens.upper()
    output, output_bounded = request_class.output_tokens.upper()
    prompt_tokens, output_tokens = math.ceil(prompt), math.ceil(output)
    bounded = prompt_bounded and output_bounded
    if request_class.session is not None:
        turns, turns_bounded = request_class.session.turns.upper()
        num_turns = max(1, math.ceil(turns))
        # The last turn sends every earlier question and answer, then its own question.
        prompt_tokens = num_turns * prompt_tokens + (num_turns - 1) * output_tokens
        bounded = bounded and turns_bounded
        return ClassLengths(prefix_tokens + prompt_tokens, output_tokens, bounded, num_turns)
    return ClassLengths(prefix_tokens + prompt_tokens, output_tokens, bounded)


def context_overflows(
    workload: Workload, max_model_len_by_tenant: Mapping[str, int], models: Mapping[str, str] | None = None
) -> list[ContextOverflow]:
    """Every class of a tenant with a known context length whose longest request exceeds it."""
    overflows = []
    for tenant in workload.tenants:
        max_model_len = max_model_len_by_tenant.get(tenant.name)
        if max_model_len is None:
            continue
        for request_class in tenant.classes:
            group = request_class.prompt.prefix_group
            prefix_tokens = 0 if group is None else workload.prefix_groups[group].prefix_tokens
            lengths = class_lengths(request_class, prefix_tokens)
            if lengths is not None and lengths.total_tokens > max_model_len:
                model = (models or {}).get(tenant.name)
                overflows.append(ContextOverflow(tenant.name, request_class.name, model, lengths, max_model_len))
    return overflows
