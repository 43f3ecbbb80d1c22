"""A routing experiment in virtual time: the simulated engine's scheduler and block pool
(``tessera.engine.sim``), the gateway's real policies, and what a gateway sees of the fleet — registry
heartbeats, its router's periodic re-read of them, its own in-flight counts, and an index fed by the
engines' KV events after a lag — with no HTTP, Redis or wall clock in between.

What it models, and why each matters to a policy:

* **Engines**: ``SimScheduler`` + ``BlockPool`` (vLLM's continuous batching and free-block eviction order),
  stepped by the ``measured`` step-time model, one event queue for the whole fleet. A run of hundreds of
  requests takes a second or two of CPU, so regimes can be swept and mechanisms counted.
* **Load signals**: each engine heartbeats its running/waiting counts every ``heartbeat_s`` (registry.py);
  each gateway worker re-reads the registry every ``registry_refresh_s`` (router.py) and passes the same
  views to its policy until the next read, plus the pod's in-flight counts (current).
* **Index**: an engine's blocks become visible ``index_lag_s`` after the step that stored or evicted them
  (KV events → feeder → index); a lookup counts the leading blocks of the chain each engine holds.
* **Gateway workers**: ``workers`` routers, each with its own policy instance (its own approx_prefix memory,
  its own round-robin counter), as ``make run``'s worker processes; they share one count of the requests in
  flight to each engine and of their prompt tokens not yet prefilled, as the pod's table
  (routing/pod_in_flight.py) makes a gateway's workers share them; and each its own prefill clock
  (routing/prefill_clock.py: the fit learned from its requests, its prompts' first-come-first-served finish
  per engine), whose waits the pod sums, as the table's fourth column does (``prefill_clock=False``: none, the
  policies price backlogs in tokens).

Nothing here is a benchmark figure of a real engine: every latency is simulated seconds under the step
costs given. ``bench_routing.py --backend sim`` runs its regimes on it; the real-engine backend is the
default there.
"""

from __future__ import annotations

import heapq
import itertools
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from routing_figures import ideal_cached_tokens

from tessera.engine.sim.block_pool import BlockPool
from tessera.engine.sim.hash_chain import BlockHashChain
from tessera.engine.sim.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tessera.engine.sim.scheduler import ScheduledBatch, SimRequest, SimScheduler
from tessera.engine.sim.step_time import MeasuredStepTime, measured_step_time
from tessera.routing.policies import make_policy
from tessera.routing.prefill_clock import PrefillClock
from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot

# Step costs standing for the slow 2-core machine (a 1,000-token prefill ~0.9 s, TTFT p50 in
# seconds at 6 requests/s): an assumption, not a measurement; ``--step-costs`` takes measured ones
# (bench_sim_calibration.py measures them on a real engine).
SLOW_CPU_STEP_COSTS = MeasuredStepTime(step_s=0.015, per_seq_s=0.002, per_prefill_token_s=0.0009)


@dataclass(frozen=True)
class SimSetup:
    """A fleet and what its gateways see of it."""

    num_engines: int = 3
    num_gpu_blocks: int = 200
    block_size: int = 32
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    step_costs: MeasuredStepTime = SLOW_CPU_STEP_COSTS
    workers: int = 2
    heartbeat_s: float = 1.0
    registry_refresh_s: float = 1.0
    index_lag_s: float = 0.01
    # The workers' prefill clocks reach the policies (the gateway's default); False: backlogs in tokens only.
    prefill_clock: bool = True


@dataclass(frozen=True)
class WorkloadSpec:
    """bench_routing's workload: tenants with a few long system prompts each (Zipf popularity within a
    tenant), a unique suffix per request, Poisson arrivals, requests spread over the gateway workers."""

    tenants: int = 4
    prompts_per_tenant: int = 3
    system_tokens: int = 1024
    suffix_tokens: tuple[int, int] = (32, 160)
    users_per_prompt: int = 4
    max_tokens: int = 4
    block_size: int = 32
    workers: int = 2
    vocab_size: int = 32000
    seed: int = 2024

    @property
    def mean_prompt_tokens(self) -> float:
        return self.system_tokens + sum(self.suffix_tokens) / 2

    @property
    def working_set_tokens(self) -> int:
        """Tokens of every system prompt: what one cache must hold to hit on all of them."""
        return self.tenants * self.prompts_per_tenant * self.system_tokens


@dataclass(frozen=True)
class SimRequestSpec:
    """One request of a workload; ``ideal_cached`` is what one unbounded cache would reuse for it."""

    arrival_s: float
    tenant: str
    salt: str
    prompt: list[int]
    prefix_text: str
    session_id: str
    worker: int
    max_tokens: int
    chain: tuple[int, ...]
    ideal_cached: int = 0


def make_workload(spec: WorkloadSpec, num_requests: int, rate_per_s: float,
                  decode: Callable[[list[int]], str] | None = None) -> list[SimRequestSpec]:
    """The same seeded sequence for every policy; ``decode`` turns token ids into the text approx_prefix
    reads (a tokenizer's, or by default the ids written out)."""
    from tessera.routing.hashing import block_hash_chain

    text_of = decode or (lambda ids: " ".join(map(str, ids)))
    rng = random.Random(spec.seed)
    systems = {(t, p): [rng.randrange(10, spec.vocab_size) for _ in range(spec.system_tokens)]
               for t in range(spec.tenants) for p in range(spec.prompts_per_tenant)}
    weights = [1 / (p + 1) for p in range(spec.prompts_per_tenant)]
    requests, clock = [], 0.0
    for _ in range(num_requests):
        clock += rng.expovariate(rate_per_s)
        tenant = rng.randrange(spec.tenants)
        prompt_id = rng.choices(range(spec.prompts_per_tenant), weights)[0]
        prompt = systems[(tenant, prompt_id)] + [rng.randrange(10, spec.vocab_size)
                                                  for _ in range(rng.randint(*spec.suffix_tokens))]
        salt = f"salt-tenant-{tenant}"
        requests.append(SimRequestSpec(
            arrival_s=clock, tenant=f"tenant-{tenant}", salt=salt, prompt=prompt,
            prefix_text=text_of(prompt[:2048]), worker=rng.randrange(spec.workers),
            session_id=f"tenant-{tenant}/app-{prompt_id}/user-{rng.randrange(spec.users_per_prompt)}",
            max_tokens=spec.max_tokens, chain=block_hash_chain(prompt, spec.block_size, salt),
        ))
    ideal = ideal_cached_tokens([r.chain for r in requests], [len(r.prompt) for r in requests], spec.block_size)
    return [replace(r, ideal_cached=n) for r, n in zip(requests, ideal, strict=True)]


@dataclass
class Outcome:
    """One request's result in bench_routing's figures, from a real engine or a simulated one."""

    engine_id: str
    reason: str  # the routing decision's
    ttft_s: float  # scheduled arrival -> first token
    done_s: float  # from the run's start to the last token
    cached: int  # the engine's num_cached_tokens
    prompt_tokens: int
    output_tokens: int


@dataclass
class SimOutcome(Outcome):
    """A simulated request's result, with what the simulation alone can count."""

    # What the router expected (the policy's credit) and what the engine reused, for staleness counts.
    expected_cached: int = 0
    # The chosen engine's load in the router's view against its true load at the decision.
    seen_load: int = 0
    true_load: int = 0
    # The most cached tokens any engine's index entry offered this request.
    best_cached: int = 0


@dataclass
class _Engine:
    engine_id: str
    pool: BlockPool
    scheduler: SimScheduler
    busy: bool = False
    # running, waiting, KV usage and prompt tokens awaiting a first token, at the last heartbeat
    beat: tuple[int, int, float, int] = (0, 0, 0.0, 0)
    index: dict[int, int] = field(default_factory=dict)  # hash -> copies, as the index has heard


@dataclass
class _Worker:
    policy: Callable[[RouteSnapshot, RouteRequest], Any]
    views: tuple[EngineView, ...] = ()
    # engine id -> requests the pod's workers sent there that have not ended (one dict for all, the pod table)
    in_flight: dict[str, int] = field(default_factory=dict)
    # engine id -> their prompt tokens not prefilled yet (the first token not out); shared as in_flight is
    pending_prefill: dict[str, int] = field(default_factory=dict)
    clock: PrefillClock = field(default_factory=PrefillClock)


def run(setup: SimSetup, policy_name: str, requests: list[SimRequestSpec], model: str = "sim") -> list[SimOutcome]:
    """Routes ``requests`` with ``policy_name`` over a cold fleet; outcomes in request order."""
    step_time = measured_step_time(setup.step_costs)
    engines = [_Engine(f"sim-{i}", pool := BlockPool(setup.num_gpu_blocks, setup.block_size),
                       SimScheduler(pool, max_num_seqs=setup.max_num_seqs,
                                    max_num_batched_tokens=setup.max_num_batched_tokens))
               for i in range(setup.num_engines)]
    by_id = {e.engine_id: e for e in engines}
    pod_in_flight: dict[str, int] = {}
    pod_pending: dict[str, int] = {}
    workers = [_Worker(make_policy(policy_name), (), pod_in_flight, pod_pending) for _ in range(setup.workers)]
    queue: list[tuple[float, int, str, Any]] = []
    order = itertools.count()

    def at(time_s: float, kind: str, payload: Any) -> None:
        heapq.heappush(queue, (time_s, next(order), kind, payload))

    for i, spec in enumerate(requests):
        at(spec.arrival_s, "arrive", i)
    # Heartbeats and registry reads at staggered phases, as independent processes' timers are.
    end_s = (requests[-1].arrival_s if requests else 0.0) + 3600.0
    for k, engine in enumerate(engines):
        at(setup.heartbeat_s * (k + 1) / (len(engines) + 1), "beat", engine)
    for k, worker in enumerate(workers):
        at(setup.registry_refresh_s * (k + 0.5) / len(workers), "read", worker)

    def view(engine: _Engine) -> EngineView:
        running, waiting, usage, pending = engine.beat
        return EngineView(engine.engine_id, "", running, waiting, usage, setup.num_gpu_blocks, setup.block_size,
                          False, pending)

    for worker in workers:  # the first request reads the registry itself (an idle fleet)
        worker.views = tuple(view(e) for e in engines)

    outcomes: dict[int, SimOutcome] = {}
    live: dict[str, tuple[int, SimRequest, _Worker]] = {}
    prefill_of: dict[str, int] = {}  # request id -> the tokens it added to the pod's pending_prefill
    tickets: dict[str, int] = {}  # request id -> its prefill clock ticket

    def pod_waits(now_s: float) -> dict[str, float]:
        """Every worker's prefill waits summed per engine (the pod table's fourth column, summed by a reader)."""
        waits: dict[str, float] = {}
        for w in workers:
            for engine_id, wait in w.clock.waits(now_s).items():
                waits[engine_id] = waits.get(engine_id, 0.0) + wait
        return waits
    num_done = 0

    def lookup(chain: tuple[int, ...]) -> dict[str, int]:
        found = {}
        for engine in engines:
            n = 0
            for block_hash in chain:
                if engine.index.get(block_hash, 0) <= 0:
                    break
                n += 1
            if n:
                found[engine.engine_id] = n
        return found

    def start_step(engine: _Engine, now_s: float) -> None:
        batch = engine.scheduler.schedule(now_s)
        if not batch.num_new_tokens:
            engine.busy = False  # waits for new work (or was all preemptions: retried on the next arrival)
            if batch.preempted and engine.scheduler.has_work():
                start_step(engine, now_s)
            return
        engine.busy = True
        at(now_s + step_time(batch.shape), "step", (engine, batch))

    def next_token(request: SimRequest) -> int:
        return zlib.crc32(f"{request.request_id}:{len(request.output_token_ids)}".encode()) % 32000

    while queue and num_done < len(requests):
        now_s, _, kind, payload = heapq.heappop(queue)
        if kind == "arrive":
            i = payload
            spec = requests[i]
            worker = workers[spec.worker % len(workers)]
            cached = lookup(spec.chain)
            fit = worker.clock.fit if setup.prefill_clock else None
            snapshot = RouteSnapshot(worker.views, cached, dict(worker.in_flight), dict(worker.pending_prefill),
                                     pod_waits(now_s) if fit is not None else {}, fit)
            decision = worker.policy(snapshot, RouteRequest(spec.tenant, model, len(spec.prompt), spec.chain,
                                                            spec.prefix_text, spec.session_id, spec.salt))
            engine = by_id[decision.ranked[0]]
            seen = next(v for v in worker.views if v.engine_id == engine.engine_id)
            request = SimRequest(f"r{i}", list(spec.prompt), spec.max_tokens,
                                 BlockHashChain(spec.prompt, setup.block_size, spec.salt), arrival_s=now_s)
            outcomes[i] = SimOutcome(engine.engine_id, decision.reason, 0.0, 0.0, 0, len(spec.prompt), 0,
                                     decision.expected_cached_tokens,
                                     max(seen.load, worker.in_flight.get(engine.engine_id, 0)),
                                     len(engine.scheduler.running) + engine.scheduler.num_waiting,
                                     max(cached.values(), default=0) * setup.block_size)
            worker.in_flight[engine.engine_id] = worker.in_flight.get(engine.engine_id, 0) + 1
            uncached = decision.tokens_to_prefill(len(spec.prompt))
            if uncached:
                # A sample of the fit where the pod had nothing there to prefill (router.Router.in_flight).
                isolated = engine.engine_id not in worker.pending_prefill
                tickets[request.request_id] = worker.clock.dispatch(engine.engine_id, uncached, now_s, isolated)
                worker.pending_prefill[engine.engine_id] = worker.pending_prefill.get(engine.engine_id, 0) + uncached
            prefill_of[request.request_id] = uncached
            engine.scheduler.add_request(request)
            live[request.request_id] = (i, request, worker)
            if not engine.busy:
                start_step(engine, now_s)
        elif kind == "step":
            engine, batch = payload
            assert isinstance(batch, ScheduledBatch)
            out = engine.scheduler.update(batch, now_s, next_token)
            for request_id in out.new_tokens:
                tokens = prefill_of.pop(request_id, 0)
                if tokens:  # its first token: prefilled
                    owner = live[request_id][2]
                    owner.clock.first_token(engine.engine_id, tickets.pop(request_id), now_s)
                    left = owner.pending_prefill[engine.engine_id] - tokens
                    if left:
                        owner.pending_prefill[engine.engine_id] = left
                    else:
                        del owner.pending_prefill[engine.engine_id]
            events = engine.pool.take_events()
            if events:
                at(now_s + setup.index_lag_s, "index", (engine, events))
            for request in out.finished:
                i, _, worker = live.pop(request.request_id)
                left = worker.in_flight[engine.engine_id] - 1
                if left:
                    worker.in_flight[engine.engine_id] = left
                else:
                    del worker.in_flight[engine.engine_id]
                o = outcomes[i]
                o.ttft_s = request.first_token_s - request.arrival_s
                o.done_s = request.finished_s
                o.cached = max(0, request.num_cached_tokens)
                o.output_tokens = len(request.output_token_ids)
                num_done += 1
            start_step(engine, now_s)
        elif kind == "index":
            engine, events = payload
            _apply(engine.index, events)
        elif kind == "beat":
            engine = payload
            engine.beat = (len(engine.scheduler.running), engine.scheduler.num_waiting, engine.pool.usage,
                           engine.scheduler.pending_prefill_tokens)
            if now_s < end_s:
                at(now_s + setup.heartbeat_s, "beat", engine)
        elif kind == "read":
            worker = payload
            worker.views = tuple(view(e) for e in engines)  # a new tuple: the policy's per-read cache resets
            if now_s < end_s:
                at(now_s + setup.registry_refresh_s, "read", worker)
    assert num_done == len(requests), "the simulation ended with requests unfinished"
    return [outcomes[i] for i in range(len(requests))]


def _apply(index: dict[int, int], events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                index[block_hash] = index.get(block_hash, 0) + 1
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                left = index.get(block_hash, 0) - 1
                if left > 0:
                    index[block_hash] = left
                else:
                    index.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            index.clear()
