"""When speculative decoding pays for itself: a pure decision over acceptance counts and a step-cost model.

The model is the planner's (``tessera.planner.serving``, Leviathan et al. 2023). A drafting step proposes k
tokens; each is accepted with probability α, independently, until the first rejection, so the step yields
``E(α, k) = (1 − α^(k+1)) / (1 − α)`` tokens. Measured per window of finished requests:

* ``S`` decode steps (output tokens − accepted drafts: every step yields one token plus its accepted drafts),
  ``D`` drafted tokens, ``A`` accepted tokens, measured while ``k`` tokens were drafted per step;
* ``q = D / (S·k)``, the share of steps that drafted (n-gram drafts only where the context repeats: a random
  model drafts on almost no step, a repetitive one on nearly all);
* ``α`` fitted so that the planner's ``E(α, k) − 1`` equals the accepted tokens per drafting step ``A·k / D``
  (:func:`per_token_acceptance`). vLLM's own "acceptance rate" ``A / D`` is reported beside it; it is
  ``(α + … + α^k) / k``, below α, and would turn speculation off too early.

Per step, relative to one decode step without speculation, drafting k' tokens costs and yields

    tokens(k') = 1 + q·(E(α, k') − 1)            cost(k') = 1 + c(b)·q·k' + p          tokens(0) = cost(0) = 1

with ``c(b)`` the verification cost of one extra token at batch size ``b`` (near 0 while the step is
memory-bound, up to 1 once it is compute-bound: :class:`StepCost`) and ``p`` the drafter's own cost per step
(the n-gram search, the rejection sampler's setup; vLLM's GPU build also loses async scheduling).
The gain is ``tokens / cost``. **Break-even** (gain 1) at k tokens:

    E(α, k) = 1 + c(b)·k + p / q

so a drafter that drafts on every step (q = 1) must reach ``E = 1 + c·k + p``; one that rarely drafts must
accept far more per draft, and one that never drafts (q = 0) never pays while p > 0.

:func:`decide` turns this into a state machine with hysteresis (``on`` with k, ``off``, ``probe``): off
below ``1 − off_margin``, back on only from a probe window at ``1 + on_margin`` or more, k changed only for a
gain ``switch_margin`` better than the current k's. While off nothing is drafted, so nothing is measured: the
state keeps the last fitted α and q, and probes again after ``probe_interval_s`` or as soon as the current
batch makes that last estimate pay (turned off at a large batch, the engine probes when the batch shrinks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from tessera.planner.serving import expected_tokens_per_step

Phase = Literal["on", "off", "probe"]
# Bisection steps for α: 2^-50 is far below any difference the counts can show.
_ALPHA_ITERATIONS = 50


@dataclass(frozen=True, slots=True)
class AcceptanceWindow:
    """Counts over a window of finished requests, measured while ``num_speculative_tokens`` were drafted."""

    num_decode_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.num_decode_steps, self.num_draft_tokens, self.num_accepted_tokens,
               self.num_speculative_tokens) < 0:
            raise ValueError(f"counts must be >= 0: {self}")
        if self.num_accepted_tokens > self.num_draft_tokens:
            raise ValueError(f"accepted ({self.num_accepted_tokens}) exceeds drafted ({self.num_draft_tokens})")

    @property
    def acceptance_rate(self) -> float:
        """vLLM's draft acceptance rate, accepted / drafted (0 without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def drafting_share(self) -> float:
        """q: drafted tokens over what k per step would draft (1 when every step drafted k)."""
        full = self.num_decode_steps * self.num_speculative_tokens
        return min(1.0, self.num_draft_tokens / full) if full else 0.0

    def __add__(self, other: AcceptanceWindow) -> AcceptanceWindow:
        if self.num_speculative_tokens and other.num_speculative_tokens and (
                self.num_speculative_tokens != other.num_speculative_tokens):
            raise ValueError("windows measured at different k do not add")
        return AcceptanceWindow(
            self.num_decode_steps + other.num_decode_steps, self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            self.num_speculative_tokens or other.num_speculative_tokens)


def per_token_acceptance(accepted_per_draft: float, k: int) -> float:
    """α with ``E(α, k) − 1 = accepted_per_draft`` (the planner's formula inverted; monotone in α).

    0 accepted per draft gives 0, k (every draft accepted) gives 1."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0.0 <= accepted_per_draft <= k:
        raise ValueError(f"accepted per draft must lie in [0, {k}], got {accepted_per_draft}")
    if accepted_per_draft <= 0.0:
        return 0.0
    if accepted_per_draft >= k:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(_ALPHA_ITERATIONS):
        mid = (low + high) / 2
        if expected_tokens_per_step(mid, k) - 1.0 < accepted_per_draft:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass(frozen=True, slots=True)
class StepCost:
    """Per-step cost of speculation, relative to one decode step without it.

    ``verify_cost_per_token``: (largest batch size, c) pairs sorted by batch size; a batch uses the first
    pair whose size covers it, and batches beyond the last pair use the last c. ``proposer_cost_per_step``: p.
    """

    verify_cost_per_token: tuple[tuple[int, float], ...] = ((1 << 30, 0.1),)
    proposer_cost_per_step: float = 0.05

    def __post_init__(self) -> None:
        if not self.verify_cost_per_token:
            raise ValueError("verify_cost_per_token needs at least one (max batch, cost) pair")
        sizes = [size for size, _ in self.verify_cost_per_token]
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"verify_cost_per_token batch sizes must be >= 1 and strictly increasing: {sizes}")
        if any(cost < 0 for _, cost in self.verify_cost_per_token) or self.proposer_cost_per_step < 0:
            raise ValueError("costs must be >= 0")

    def verify_cost(self, num_running: int) -> float:
        for max_batch, cost in self.verify_cost_per_token:
            if num_running <= max_batch:
                return cost
        return self.verify_cost_per_token[-1][1]


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """Thresholds of :func:`decide` (the engine config's ``speculative.adaptive`` block maps onto these)."""

    min_decode_steps: int = 256
    off_margin: float = 0.03
    on_margin: float = 0.03
    switch_margin: float = 0.05
    probe_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_decode_steps < 1 or self.probe_interval_s < 0:
            raise ValueError("min_decode_steps must be >= 1 and probe_interval_s >= 0")
        if not (0 <= self.off_margin < 1 and self.on_margin >= 0 and self.switch_margin >= 0):
            raise ValueError("need 0 <= off_margin < 1, on_margin >= 0, switch_margin >= 0")


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a window says at one batch size: the fit, and the gain at the measured k and at the best k."""

    alpha: float
    acceptance_rate: float
    drafting_share: float
    num_speculative_tokens: int
    expected_tokens_per_step: float  # E(α, k) of a drafting step, the planner's formula
    break_even_tokens_per_step: float  # E at which the gain is 1 (inf where q = 0 and p > 0)
    gain: float
    best_num_speculative_tokens: int  # the best k >= 1, whether or not it pays
    best_gain: float

    @property
    def recommended_num_speculative_tokens(self) -> int:
        """The best k where it pays (gain above 1), else 0."""
        return self.best_num_speculative_tokens if self.best_gain > 1.0 else 0


def gain(alpha: float, drafting_share: float, k: int, verify_cost: float, proposer_cost: float) -> float:
    """tokens(k) / cost(k) of the module docstring; 1.0 at k = 0."""
    if k == 0:
        return 1.0
    tokens = 1.0 + drafting_share * (expected_tokens_per_step(alpha, k) - 1.0)
    return tokens / (1.0 + verify_cost * drafting_share * k + proposer_cost)


def best_k(alpha: float, drafting_share: float, max_k: int, verify_cost: float,
           proposer_cost: float) -> tuple[int, float]:
    """The k in 1..max_k with the highest gain (the smallest on ties) and that gain, which may be below 1."""
    return max(((k, gain(alpha, drafting_share, k, verify_cost, proposer_cost)) for k in range(1, max_k + 1)),
               key=lambda kv: (kv[1], -kv[0]))


def estimate(window: AcceptanceWindow, num_running: int, max_k: int, cost: StepCost) -> Estimate:
    k = window.num_speculative_tokens
    if not 1 <= k <= max_k:
        raise ValueError(f"window measured at k={k}; need 1 <= k <= max_k={max_k}")
    q = window.drafting_share
    alpha = per_token_acceptance(window.num_accepted_tokens * k / window.num_draft_tokens, k) \
        if window.num_draft_tokens else 0.0
    c, p = cost.verify_cost(num_running), cost.proposer_cost_per_step
    top_k, top_gain = best_k(alpha, q, max_k, c, p)
    return Estimate(
        alpha=alpha, acceptance_rate=window.acceptance_rate, drafting_share=q, num_speculative_tokens=k,
        expected_tokens_per_step=expected_tokens_per_step(alpha, k),
        break_even_tokens_per_step=1.0 + c * k + p / q if q else (float("inf") if p else 1.0 + c * k),
        gain=gain(alpha, q, k, c, p), best_num_speculative_tokens=top_k, best_gain=top_gain)


@dataclass(frozen=True, slots=True)
class SpeculationState:
    """What the engine runs: ``num_speculative_tokens`` is 0 exactly when ``phase`` is off. ``alpha`` and
    ``drafting_share`` are the last fit (kept while off, where nothing is measured)."""

    phase: Phase
    num_speculative_tokens: int
    since_s: float
    alpha: float | None = None
    drafting_share: float | None = None

    def __post_init__(self) -> None:
        assert (self.phase == "off") == (self.num_speculative_tokens == 0), self


@dataclass(frozen=True, slots=True)
class Decision:
    """The next state; ``changed`` when the engine must be told a new k (and the window restarted)."""

    state: SpeculationState
    changed: bool
    reason: str
    estimate: Estimate | None = None


def decide(state: SpeculationState, window: AcceptanceWindow, num_running: int, max_k: int, cost: StepCost,
           settings: PolicySettings, now_s: float) -> Decision:
    """The next speculation state of an engine; pure. ``window`` was measured in ``state`` (at its k)."""
    if state.phase == "off":
        return _from_off(state, num_running, max_k, cost, settings, now_s)
    if window.num_decode_steps < settings.min_decode_steps:
        return Decision(state, False, f"{window.num_decode_steps} of {settings.min_decode_steps} decode steps")
    est = estimate(window, num_running, max_k, cost)
    why = (f"α={est.alpha:.3f} q={est.drafting_share:.3f}: E={est.expected_tokens_per_step:.3f} at "
           f"k={est.num_speculative_tokens} (break-even {est.break_even_tokens_per_step:.3f}), "
           f"gain {est.gain:.3f}; best k={est.best_num_speculative_tokens} gain {est.best_gain:.3f}")
    if state.phase == "probe":
        if est.best_gain >= 1.0 + settings.on_margin:
            return Decision(SpeculationState("on", est.best_num_speculative_tokens, now_s, est.alpha,
                                             est.drafting_share), True, f"probe pays: {why}", est)
        return Decision(SpeculationState("off", 0, now_s, est.alpha, est.drafting_share), True,
                        f"probe does not pay: {why}", est)
    if est.best_gain < 1.0 - settings.off_margin:
        return Decision(SpeculationState("off", 0, now_s, est.alpha, est.drafting_share), True,
                        f"below break-even: {why}", est)
    if est.best_num_speculative_tokens != state.num_speculative_tokens and \
            est.best_gain >= est.gain * (1.0 + settings.switch_margin):
        return Decision(SpeculationState("on", est.best_num_speculative_tokens, now_s, est.alpha,
                                         est.drafting_share), True, f"better k: {why}", est)
    fitted = replace(state, alpha=est.alpha, drafting_share=est.drafting_share)
    return Decision(fitted, False, f"keeps k={state.num_speculative_tokens}: {why}", est)


def _from_off(state: SpeculationState, num_running: int, max_k: int, cost: StepCost, settings: PolicySettings,
              now_s: float) -> Decision:
    probe = SpeculationState("probe", max_k, now_s, state.alpha, state.drafting_share)
    if now_s - state.since_s >= settings.probe_interval_s:
        return Decision(probe, True, f"off for {now_s - state.since_s:.0f} s: probe")
    if state.alpha is not None and state.drafting_share is not None:
        _, predicted = best_k(state.alpha, state.drafting_share, max_k, cost.verify_cost(num_running),
                              cost.proposer_cost_per_step)
        if predicted >= 1.0 + settings.on_margin:
            return Decision(probe, True, f"batch {num_running} makes the last fit pay ({predicted:.3f}): probe")
    return Decision(state, False, "off")
