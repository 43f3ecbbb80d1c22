"""Speculation that pays for itself: measures acceptance per engine and per tenant, and turns the engine's
n-gram drafting down or off (and back on) by the pure rule of ``speculation_policy``.

Mechanism (vLLM 0.32). The scheduler's k is fixed at start (``Scheduler.num_spec_tokens``; the per-batch-size
schedule ``num_speculative_tokens_per_batch_size`` is fixed at start as well) and no engine-core utility
reaches the scheduler. What runs per step is the worker's drafter: ``GPUModelRunner.propose_draft_token_ids``
(the CPU runner inherits it) calls ``NgramProposer.propose(k, …)``, and the scheduler schedules, verifies and
allocates for exactly the drafts it returns (variable length; an empty draft is a plain decode step, no
rejection sampler). So the switch is a cap on the drafter, set in each worker through vLLM's documented
extension point: the engine argument ``worker_extension_cls`` names :class:`SpeculationWorkerExtension`, and
``AsyncLLM.collective_rpc("tessera_set_num_speculative_tokens", args=(k,))`` runs its method in every worker
(by name: no pickled code). At cap 0 the n-gram search is skipped too, and a step without drafts runs no
rejection sampler. What a runtime switch cannot undo is what vLLM fixes at start: on a GPU an n-gram engine
runs without async scheduling (``VllmConfig``: only EAGLE/MTP/draft-model/ngram_gpu keep it; the CPU build
has none either way), the scheduler reserves KV lookahead slots for k drafts, and a speculative engine's
fixed per-step overhead stays (see ``bench/bench_speculation.py``: "adaptive" against "off" on noise).
Regaining those takes a restart with ``speculative: null``, which is also the path for every method but
n-gram (the controller then only advises: ``runtime_toggle`` is false).

The host calls two hooks (see the report of issue #19 for the exact lines): :meth:`SpeculationControl.observe`
with every finished request's ``RequestStats`` and tenant, and :meth:`SpeculationControl.maybe_apply` on a
timer with the engine and its running-request count. :meth:`facts` and :meth:`prometheus_text` show the state.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tessera.engine.protocol import RequestStats
from tessera.engine.speculation_policy import (
    AcceptanceWindow,
    Decision,
    PolicySettings,
    SpeculationState,
    StepCost,
    decide,
    estimate,
)

if TYPE_CHECKING:
    from tessera.engine.config import SpeculativeConfig

logger = logging.getLogger(__name__)

SET_K_METHOD = "tessera_set_num_speculative_tokens"
GET_K_METHOD = "tessera_num_speculative_tokens"
WORKER_EXTENSION = f"{__name__}.SpeculationWorkerExtension"
# Drafters whose k the worker extension can cap at run time.
RUNTIME_METHODS: frozenset[str] = frozenset({"ngram"})


class _Window:
    """Sliding window over the last ``max_requests`` finished requests' (steps, drafted, accepted)."""

    __slots__ = ("_samples", "accepted", "drafted", "steps")

    def __init__(self, max_requests: int) -> None:
        self._samples: deque[tuple[int, int, int]] = deque(maxlen=max_requests)
        self.steps = self.drafted = self.accepted = 0

    def add(self, steps: int, drafted: int, accepted: int) -> None:
        if len(self._samples) == self._samples.maxlen:
            old_steps, old_drafted, old_accepted = self._samples[0]
            self.steps -= old_steps
            self.drafted -= old_drafted
            self.accepted -= old_accepted
        self._samples.append((steps, drafted, accepted))
        self.steps += steps
        self.drafted += drafted
        self.accepted += accepted

    def clear(self) -> None:
        self._samples.clear()
        self.steps = self.drafted = self.accepted = 0

    def __len__(self) -> int:
        return len(self._samples)

    def at(self, k: int) -> AcceptanceWindow:
        return AcceptanceWindow(self.steps, self.drafted, self.accepted, k)


def request_sample(stats: RequestStats) -> tuple[int, int, int] | None:
    """(verification steps, drafted, accepted) of one finished request; None where vLLM gave no exact counts.

    The prefill step yields the first token and drafts for the next; each later step verifies the previous
    step's draft and yields one token plus the accepted drafts, so steps = output − 1 − accepted.
    """
    drafted, accepted = stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens
    if drafted == 0 and accepted > 0:
        return None  # no per-request metrics (n > 1): accepted is the host's upper bound, not a count
    steps = stats.num_output_tokens - 1 - accepted
    if steps <= 0 or accepted > drafted:
        return None
    return steps, drafted, accepted


class SpeculationControl:
    """Per-engine and per-tenant acceptance windows, the speculation state, and the switch.

    Per tenant, acceptance and the k that would pay are measured and shown; the engine applies one k for all
    (the drafter's cap is engine-wide).
    """

    def __init__(self, method: str, max_k: int, *, settings: PolicySettings | None = None,
                 cost: StepCost | None = None, window_requests: int = 256, max_tenants: int = 64,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if window_requests < 1 or max_tenants < 1:
            raise ValueError("window_requests and max_tenants must be >= 1")
        self.method = method
        self.max_k = max_k
        self.settings = settings or PolicySettings()
        self.cost = cost or StepCost()
        self.runtime_toggle = method in RUNTIME_METHODS
        self._clock, self._wall_clock = clock, wall_clock
        self._window_requests, self._max_tenants = window_requests, max_tenants
        self.state = SpeculationState("on", max_k, clock())
        self.engine_window = _Window(window_requests)
        self.tenant_windows: OrderedDict[str, _Window] = OrderedDict()
        self.last_decision: Decision | None = None
        self.num_running = 0
        self.num_switches = 0
        # Requests that arrived before the last switch ran (partly) at the old k: not counted.
        self._window_start_wall_s = 0.0

    # ---- hook 1: every finished request --------------------------------------------------------------

    def observe(self, stats: RequestStats, tenant: str) -> None:
        """Counts a finished request into the engine's and its tenant's window (cheap; no I/O)."""
        if self.state.phase == "off" or stats.arrival_ts < self._window_start_wall_s:
            return
        sample = request_sample(stats)
        if sample is None:
            return
        self.engine_window.add(*sample)
        window = self.tenant_windows.get(tenant)
        if window is None:
            window = self.tenant_windows[tenant] = _Window(self._window_requests)
            if len(self.tenant_windows) > self._max_tenants:
                self.tenant_windows.popitem(last=False)
        else:
            self.tenant_windows.move_to_end(tenant)
        window.add(*sample)

    # ---- hook 2: on a timer ------------------------------------------------------------------------------

    def decide(self, num_running: int) -> Decision:
        """The policy's next state for the current window and batch (pure; changes nothing)."""
        return decide(self.state, self.engine_window.at(self.state.num_speculative_tokens), num_running,
                      self.max_k, self.cost, self.settings, self._clock())

    async def maybe_apply(self, engine: Any, num_running: int) -> Decision:
        """Decides and, on a change, sets the drafters' k through ``engine.collective_rpc`` (an ``AsyncLLM``)."""
        self.num_running = num_running
        decision = self.decide(num_running)
        if decision.changed:
            if self.runtime_toggle:
                await set_num_speculative_tokens(engine, decision.state.num_speculative_tokens)
            logger.info("speculation %s k=%d -> %s k=%d (%s)%s", self.state.phase, self.state.num_speculative_tokens,
                        decision.state.phase, decision.state.num_speculative_tokens, decision.reason,
                        "" if self.runtime_toggle else f"; {self.method} has no runtime switch: advice only")
            self.num_switches += 1
            self._window_start_wall_s = self._wall_clock()
            self.engine_window.clear()
            for window in self.tenant_windows.values():
                window.clear()
        self.state = decision.state
        self.last_decision = decision
        return decision

    # ---- what it shows -------------------------------------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        """The speculation block of /stats: state, the engine's fit and each tenant's."""
        k = self.state.num_speculative_tokens or self.max_k
        est = self.last_decision.estimate if self.last_decision else None
        return {
            "method": self.method,
            "runtime_toggle": self.runtime_toggle,
            "phase": self.state.phase,
            "num_speculative_tokens": self.state.num_speculative_tokens,
            "max_num_speculative_tokens": self.max_k,
            "alpha": self.state.alpha,
            "acceptance_rate": est.acceptance_rate if est else None,
            "drafting_share": self.state.drafting_share,
            "expected_tokens_per_step": est.expected_tokens_per_step if est else None,
            "break_even_tokens_per_step": est.break_even_tokens_per_step if est else None,
            "gain": est.gain if est else None,
            "num_switches": self.num_switches,
            "reason": self.last_decision.reason if self.last_decision else "",
            "window": {"num_requests": len(self.engine_window), "num_decode_steps": self.engine_window.steps,
                       "num_draft_tokens": self.engine_window.drafted,
                       "num_accepted_tokens": self.engine_window.accepted},
            "tenants": {tenant: self._tenant_facts(window, k) for tenant, window in self.tenant_windows.items()},
        }

    def _tenant_facts(self, window: _Window, k: int) -> dict[str, Any]:
        facts: dict[str, Any] = {"num_requests": len(window), "num_decode_steps": window.steps,
                                 "num_draft_tokens": window.drafted, "num_accepted_tokens": window.accepted}
        if window.steps:
            est = estimate(window.at(k), self.num_running, self.max_k, self.cost)
            facts |= {"alpha": est.alpha, "acceptance_rate": est.acceptance_rate,
                      "drafting_share": est.drafting_share, "expected_tokens_per_step": est.expected_tokens_per_step,
                      "gain": est.gain, "best_num_speculative_tokens": est.recommended_num_speculative_tokens}
        return facts

    def prometheus_text(self, engine_id: str, model: str) -> bytes:
        """``tessera_engine_speculation_*`` in Prometheus text, to append to the engine's /metrics."""
        registry = CollectorRegistry()
        labels = {"engine_id": engine_id, "model": model}
        facts = self.facts()
        gauges = {
            "tessera_engine_speculation_on": ("1 while the engine drafts (phase on or probe)",
                                              float(self.state.phase != "off")),
            "tessera_engine_speculation_num_speculative_tokens": ("Tokens drafted per step now (0: off)",
                                                                  self.state.num_speculative_tokens),
            "tessera_engine_speculation_alpha": ("Per-token acceptance α fitted to the planner's formula",
                                                 facts["alpha"]),
            "tessera_engine_speculation_expected_tokens_per_step": ("E(α, k) of a drafting step",
                                                                    facts["expected_tokens_per_step"]),
            "tessera_engine_speculation_gain": ("Tokens per step over cost per step at the current k",
                                                facts["gain"]),
        }
        for name, (help_text, value) in gauges.items():
            if value is not None:
                Gauge(name, help_text, list(labels), registry=registry).labels(**labels).set(value)
        Counter("tessera_engine_speculation_switches", "Speculation state changes", list(labels),
                registry=registry).labels(**labels).inc(self.num_switches)
        tenant_alpha = Gauge("tessera_engine_speculation_tenant_alpha", "Per-token acceptance α per tenant",
                             [*labels, "tenant"], registry=registry)
        for tenant, tenant_facts in facts["tenants"].items():
            if "alpha" in tenant_facts:
                tenant_alpha.labels(**labels, tenant=tenant or "-").set(tenant_facts["alpha"])
        return generate_latest(registry)


async def set_num_speculative_tokens(engine: Any, k: int) -> None:
    """Caps every worker's drafter at ``k`` (needs ``worker_extension_cls=WORKER_EXTENSION``)."""
    applied = await engine.collective_rpc(SET_K_METHOD, args=(k,))
    assert all(a == k for a in applied), f"workers applied {applied}, asked {k}"


async def num_speculative_tokens(engine: Any) -> list[int]:
    """Each worker's current drafter cap."""
    return list(await engine.collective_rpc(GET_K_METHOD))


class SpeculationWorkerExtension:
    """Mixed into vLLM's worker class (engine argument ``worker_extension_cls``); its methods run in each worker
    through ``AsyncLLM.collective_rpc`` by name. ``self`` is the vLLM worker (``self.model_runner.drafter``)."""

    model_runner: Any

    def tessera_set_num_speculative_tokens(self, k: int) -> int:
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        limit = int(self.model_runner.speculative_config.num_speculative_tokens)
        if not 0 <= k <= limit:
            raise ValueError(f"k must lie in [0, {limit}] (the engine's num_speculative_tokens), got {k}")
        if not isinstance(self.model_runner.drafter, NgramProposer):
            raise NotImplementedError(f"no runtime k for {type(self.model_runner.drafter).__name__}; "
                                      f"valid: {sorted(RUNTIME_METHODS)}")
        drafter: Any = self.model_runner.drafter
        # NOTE: a subclass swap, not a wrapper: the model runner asserts isinstance(drafter, NgramProposer).
        drafter.__class__ = _capped_ngram_proposer()
        drafter.tessera_cap = k
        return k

    def tessera_num_speculative_tokens(self) -> int:
        drafter = self.model_runner.drafter
        return int(getattr(drafter, "tessera_cap", self.model_runner.speculative_config.num_speculative_tokens))


@functools.cache
def _capped_ngram_proposer() -> type:
    """vLLM's ``NgramProposer`` with ``propose`` capped at ``tessera_cap`` tokens (0: no search, no draft)."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    class CappedNgramProposer(NgramProposer):
        tessera_cap: int

        def propose(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]], *args: Any,
                    **kwargs: Any) -> list[list[int]]:
            cap = min(num_speculative_tokens, self.tessera_cap)
            if cap == 0:
                return [[] for _ in sampled_token_ids]
            return super().propose(cap, sampled_token_ids, *args, **kwargs)

    return CappedNgramProposer


def speculation_control_for(spec: SpeculativeConfig | None) -> SpeculationControl | None:
    """The controller an engine runs with ``spec`` (what runs, after capabilities), or None without
    speculation or with ``adaptive.enabled: false``."""
    if spec is None or not spec.adaptive.enabled:
        return None
    adaptive = spec.adaptive
    return SpeculationControl(
        spec.method, spec.num_speculative_tokens,
        settings=PolicySettings(adaptive.min_decode_steps, adaptive.off_margin, adaptive.on_margin,
                                adaptive.switch_margin, adaptive.probe_interval_s),
        cost=StepCost(((1 << 30, adaptive.verify_cost_per_token),), adaptive.proposer_cost_per_step),
        window_requests=adaptive.window_requests, max_tenants=adaptive.max_tenants)


async def speculation_loop(control: SpeculationControl, engine: Any, interval_s: float,
                           num_running: Callable[[], int]) -> None:
    """Runs beside the engine's server: decides every ``interval_s`` and applies a change to the workers."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await control.maybe_apply(engine, num_running())
        except Exception:  # a failed switch must not stop the engine; the next tick tries again
            logger.exception("speculation control: could not apply the decision")
