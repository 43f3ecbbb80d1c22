"""The ``measured`` step-time model fitted on a real engine's own step timings.

A sample is one engine step as the engine saw it: what it computed (sequences, of them how many still in
their prompt, prompt tokens, query-key pairs of causal attention, tokens of KV read: ``attention_work`` counts
the last two from the engine's own schedule) and how long it took, wall clock, from the
end of the step before to its own end — so the fit holds the engine's whole per-step cost (scheduling,
input preparation, the forward pass, sampling, output handling), not the forward pass alone.

The fit is a least-squares over step shapes, made robust for a noisy shared machine:

* samples of the same shape are reduced to their median (a step slowed down by a neighbour's burst moves
  a median little; one outlier cannot pull the line);
* each shape's row is weighted by ``sqrt(count) / max(median, typical step)``, i.e. the fit minimises
  *relative* error, so the many short decode steps (which set ITL) are not drowned by a few long prefills
  (which set TTFT); gaps under a quarter of the typical step (two outputs that reached the frontend at
  once) are left out;
* coefficients are non-negative (a term the data does not support is dropped and the rest refitted), as
  the model's config requires.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tessera.engine.sim.scheduler import StepShape
from tessera.engine.sim.step_time import MeasuredStepTime, StepTimeFn, measured_step_time

# The model's terms, in MeasuredStepTime's field names; ``step_s`` (the intercept) is always fitted.
TERMS = ("step_s", "per_seq_s", "per_prefill_token_s", "per_prefill_seq_s", "per_attention_pair_s",
         "per_context_token_s")
# Shorter gaps than this share of the median step are not steps: outputs a frontend heard of together (where the
# steps were timed there; the calibration bench now reads the engine core's clock, which does not bunch).
MIN_FRACTION_OF_TYPICAL = 0.25


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured engine step."""

    duration_s: float  # wall seconds from the previous step's end to this one's
    num_seqs: int
    num_prefill_seqs: int  # sequences computing prompt tokens (vLLM: context requests)
    num_prefill_tokens: int
    attention_pairs: float  # Σ new × (context + (new + 1) / 2), as StepShape counts them
    num_context_tokens: int = 0  # Σ (context + new): the KV the step reads (0 where it was not measured)

    def shape(self) -> StepShape:
        num_decode = self.num_seqs - self.num_prefill_seqs
        return StepShape(self.num_prefill_tokens + num_decode, self.num_prefill_tokens, num_decode, self.num_seqs,
                         self.attention_pairs, self.num_context_tokens)


def attention_work(num_scheduled_tokens: Mapping[str, int],
                   num_computed_tokens: Mapping[str, int]) -> tuple[float, int]:
    """A step's query-key pairs of causal attention and tokens of KV read, counted as the sim's scheduler counts
    them (``StepShape``), from what a real engine scheduled: each request's new tokens this step and the tokens
    it had computed before it (its prefix-cache hit included; a request missing from ``num_computed_tokens``
    had none)."""
    pairs, context = 0.0, 0
    for request_id, new in num_scheduled_tokens.items():
        computed = num_computed_tokens.get(request_id, 0)
        pairs += new * (computed + (new + 1) / 2)
        context += computed + new
    return pairs, context


def _features(sample: StepSample) -> list[float]:
    return [1.0, float(max(0, sample.num_seqs - 1)), float(sample.num_prefill_tokens),
            float(sample.num_prefill_seqs), float(sample.attention_pairs), float(sample.num_context_tokens)]


def fit_measured_step_time(samples: Iterable[StepSample], terms: Sequence[str] = TERMS) -> MeasuredStepTime:
    """The non-negative, relative-error least-squares fit of ``terms`` (others stay 0); ``ValueError``
    without samples or with an unknown term."""
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise ValueError(f"unknown step-time terms {sorted(unknown)}; valid: {', '.join(TERMS)}")
    timed = [s for s in samples if s.duration_s > 0]
    if not timed:
        raise ValueError("no step samples to fit")
    # A step far shorter than the typical one is not a step: its output reached the frontend together with
    # the one before (whose gap holds both); such gaps are left out.
    typical_s = statistics.median(s.duration_s for s in timed)
    groups: dict[tuple[float, ...], list[float]] = defaultdict(list)
    for sample in timed:
        if sample.duration_s >= MIN_FRACTION_OF_TYPICAL * typical_s:
            groups[tuple(_features(sample))].append(sample.duration_s)
    rows = np.array(list(groups), dtype=float)
    medians = np.array([statistics.median(d) for d in groups.values()])
    weights = np.sqrt([len(d) for d in groups.values()]) / np.maximum(medians, typical_s)
    active = [0] + [TERMS.index(t) for t in terms if t != "step_s"]
    coefficients = np.zeros(len(TERMS))
    while True:
        columns = rows[:, active]
        # Columns scaled to unit size: pairs run to 1e6 where the intercept is 1 (conditioning).
        scale = np.maximum(np.abs(columns).max(axis=0), 1e-12)
        solution, *_ = np.linalg.lstsq(columns / scale * weights[:, None], medians * weights, rcond=None)
        solution = solution / scale
        negative = [i for i, value in enumerate(solution) if value < 0 and active[i] != 0]
        if not negative:
            break
        active.pop(min(negative, key=lambda i: solution[i]))
    coefficients[active] = solution
    return MeasuredStepTime(**{name: max(0.0, float(value)) for name, value in zip(TERMS, coefficients, strict=True)})


def _noiseless(config: MeasuredStepTime) -> StepTimeFn:
    """``config``'s model time per step, without its jitter: what measured steps are compared with."""
    return measured_step_time(config.model_copy(update={"jitter_factors": (), "jitter_s": ()}))


# Quantiles a jitter keeps: enough that the draws' tail is the samples' tail. A draw interpolates between two
# neighbouring quantiles, so the last interval (here q99.9 to the largest sample) gets 1/(n-1) of the draws spread
# evenly up to that one largest sample. With 101, the top 1 % of steps drew +3 to +15 ms where the samples' top
# 1 % sat mostly at +3 to +7 ms (one outlier at 15): the sim's decode gaps beyond p98 were long ones, and its ITL
# p99 (on a workload whose 1 % of gaps beside a prefill put the p99 at the knee) came out 30-45 % long
# (docs/routing.md, "The jitter's tail, and the knee").
JITTER_QUANTILES = 1001


def _quantiles(values: list[float], num_quantiles: int) -> tuple[float, ...]:
    if not values or num_quantiles < 2:
        raise ValueError("jitter needs step samples and at least 2 quantiles")
    return tuple(float(np.quantile(values, i / (num_quantiles - 1))) for i in range(num_quantiles))


def relative_errors(config: MeasuredStepTime, samples: Iterable[StepSample]) -> list[float]:
    """Each sample's (modelled − measured) / measured step time: how well ``config`` explains the steps."""
    model = _noiseless(config)
    return [(model(s.shape()) - s.duration_s) / s.duration_s for s in samples if s.duration_s > 0]


def jitter_seconds(config: MeasuredStepTime, samples: Iterable[StepSample],
                   num_quantiles: int = JITTER_QUANTILES) -> tuple[float, ...]:
    """The measured − modelled step times of ``samples`` at ``num_quantiles`` evenly spaced quantiles:
    ``MeasuredStepTime.jitter_s`` for a sim whose steps meet the machine's interruptions as the real engine's did."""
    model = _noiseless(config)
    return _quantiles([s.duration_s - model(s.shape()) for s in samples if s.duration_s > 0], num_quantiles)


def jitter_factors(config: MeasuredStepTime, samples: Iterable[StepSample],
                   num_quantiles: int = JITTER_QUANTILES) -> tuple[float, ...]:
    """The measured/modelled step-time ratios of ``samples`` at ``num_quantiles`` evenly spaced quantiles:
    ``MeasuredStepTime.jitter_factors`` for a sim that reproduces a noisy machine's step-time spread."""
    model = _noiseless(config)
    return _quantiles([s.duration_s / model(s.shape()) for s in samples if s.duration_s > 0 and model(s.shape()) > 0],
                      num_quantiles)
