"""Pipeline parallelism: the bubble, and how many layers' activations a stage holds at once.

With p stages and m micro-batches per step, the 1F1B schedule idles each stage for ``(p−1)`` micro-batch
slots of forward+backward while the pipeline fills and drains: the bubble is ``(p−1)/m`` of the ideal
(bubble-free) step time. Splitting each stage's layers into v interleaved chunks (Narayanan et al. 2021)
shrinks it to ``(p−1)/(v·m)`` at the price of v× more point-to-point messages.

Memory: in 1F1B, stage r starts ``p−r−1`` warm-up micro-batches before its first backward, so the first
stage holds activations of p micro-batches (of its L/p layers): L layers' worth, whatever p is. With v
chunks, Megatron's warm-up on rank r is ``2·(p−r−1) + (v−1)·p`` chunk-micro-batches of L/(p·v) layers;
on the first stage that is ``L·(1 + (p−1)/(p·v))`` layers (Korthikanti et al. 2022, section 4.2.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check(pp: int, num_microbatches: int, virtual_stages: int) -> None:
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError("pipeline degree, micro-batches and virtual stages must all be >= 1")
    if virtual_stages > 1 and (pp == 1 or num_microbatches % pp):
        raise ValueError(
            f"an interleaved schedule (virtual_stages={virtual_stages}) needs pp > 1 and num_microbatches a "
            f"multiple of pp; got pp={pp}, num_microbatches={num_microbatches}"
        )


@dataclass(frozen=True, slots=True)
class PipelineBubble:
    """Idle time of a pipeline step."""

    fraction_of_ideal: float

    @property
    def share_of_step(self) -> float:
        """Bubble over the whole (ideal + bubble) step time."""
        return self.fraction_of_ideal / (1.0 + self.fraction_of_ideal)


def pipeline_bubble(pp: int, num_microbatches: int, virtual_stages: int = 1) -> PipelineBubble:
    """``(p−1)/m`` plain, ``(p−1)/(v·m)`` interleaved, as a fraction of the ideal step time."""
    _check(pp, num_microbatches, virtual_stages)
    return PipelineBubble(fraction_of_ideal=(pp - 1) / (virtual_stages * num_microbatches))


def layers_in_flight(
    num_layers: int, pp: int, num_microbatches: int, virtual_stages: int = 1, rank: int = 0
) -> float:
    """Layer-micro-batches whose activations pipeline rank ``rank`` holds at its peak."""
    _check(pp, num_microbatches, virtual_stages)
    if not 0 <= rank < pp:
        raise ValueError(f"rank must lie in [0, {pp}), got {rank}")
    # NOTE: an uneven split (Llama 3 405B: 126 layers on 16 stages) is rounded up: the fullest chunk
    # sets the peak.
    layers_per_chunk = math.ceil(num_layers / (pp * virtual_stages))
    if virtual_stages == 1:
        return layers_per_chunk * min(pp - rank, num_microbatches)
    warmup = 2 * (pp - rank - 1) + (virtual_stages - 1) * pp
    return layers_per_chunk * min(warmup + 1, num_microbatches * virtual_stages)


def stage_layers(num_layers: int, pp: int) -> int:
    """Layers the fullest pipeline stage owns (its share of the weights)."""
    return math.ceil(num_layers / pp)
