"""A continuous-batching scheduler over a simulated block pool, after vLLM 0.32's v1 scheduler.

One ``schedule()`` picks what the next engine step computes; the caller times that step (``step_time.py``)
and hands the batch back to ``update()``, which advances the requests and samples their tokens. Nothing
here reads a clock or does I/O: time is whatever ``now_s`` the caller passes.

Per step, as vLLM does:
1. *Running* requests first, in order, each as many tokens as it still needs (a decode: one) within the
   token budget (``max_num_batched_tokens``). When the pool cannot give a request its blocks, a running
   request is preempted — the last one under ``fcfs``, the lowest-priority (largest ``(priority,
   arrival)``) one under ``priority`` — its blocks freed and its progress dropped (recomputed later),
   until the request fits or is itself the victim.
2. *Waiting* requests next, only if nothing was preempted this step, while fewer than ``max_num_seqs``
   run and budget is left: a new request first takes its longest cached prefix (never its last token,
   which must be computed to sample), then as much of the rest as the budget allows (chunked prefill) —
   or, without chunked prefill, waits until the whole rest fits. A request whose blocks do not fit stops
   the admission of waiting requests for this step.
With ``long_prefill_token_threshold`` (vLLM's, 0 by default: no cap), a prefill in either loop takes at most
that many tokens a step while more than one request runs or waits at the step's start.
Blocks become cached as soon as they are scheduled full, and are announced in that step's KV events.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from tessera.engine.sim.block_pool import Block, BlockPool
from tessera.engine.sim.hash_chain import BlockHashChain

SchedulingPolicy = Literal["fcfs", "priority"]


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's state in the simulated engine; times are simulated seconds."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    chain: BlockHashChain
    priority: int = 0
    cache_salt: str | None = None
    arrival_s: float = 0.0  # at the replica
    scheduler_arrival_s: float = 0.0  # at the scheduler (later by the frontend delay, engine.py)
    output_token_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks of ``blocks`` already cached in the pool
    num_cached_tokens: int = -1  # prefix hit at first scheduling (-1: not scheduled yet)
    num_preemptions: int = 0
    num_steps: int = 0
    status: Status = Status.WAITING
    scheduled_s: float = 0.0
    first_token_s: float = 0.0
    finished_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, for the step-time model: tokens, sequences, and attention work."""

    num_scheduled_tokens: int
    num_prefill_tokens: int  # tokens of requests still in their prompt (or recomputing after preemption)
    num_decode_seqs: int
    num_seqs: int
    # Σ over sequences of new tokens × (cached context + (new + 1) / 2): query-key pairs of causal attention.
    attention_pairs: float
    num_context_tokens: int  # Σ (cached context + new tokens): the KV the step reads


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    num_new_tokens: dict[str, int]  # request id -> tokens computed this step
    shape: StepShape
    preempted: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StepOutput:
    new_tokens: dict[str, int]  # request id -> token sampled this step
    finished: tuple[SimRequest, ...]


def _tokens_this_step(num_left: int, cap: int, budget: int) -> int:
    """A request's tokens this step: what it has left, at most ``cap`` (0: no cap) and the step's ``budget``."""
    return min(cap if 0 < cap < num_left else num_left, budget)


class SimScheduler:
    def __init__(self, pool: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: SchedulingPolicy = "fcfs",
                 long_prefill_token_threshold: int = 0) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}; valid: fcfs, priority")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.running: list[SimRequest] = []
        self._fcfs: deque[SimRequest] = deque()
        self._heap: list[tuple[int, float, int, SimRequest]] = []
        self._order = itertools.count()
        self.requests: dict[str, SimRequest] = {}
        self.num_preemptions = 0

    # -- the queues ------------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._fcfs) + len(self._heap)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill before each request's first token (a waiting one's cache hit as the
        pool holds it now)."""
        total = 0
        size = self.pool.block_size
        for request in self.requests.values():
            if request.output_token_ids:
                continue
            if request.status == Status.RUNNING or request.num_computed_tokens:
                total += request.num_tokens - request.num_computed_tokens
            else:
                hit = self.pool.longest_cache_hit(request.chain.hashes[:(request.num_tokens - 1) // size])
                total += request.num_tokens - len(hit) * size
        return total

    def _push_waiting(self, request: SimRequest, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_s, next(self._order), request))
        elif front:
            self._fcfs.appendleft(request)
        else:
            self._fcfs.append(request)

    def _peek_waiting(self) -> SimRequest:
        return self._heap[0][3] if self.policy == "priority" else self._fcfs[0]

    def _pop_waiting(self) -> None:
        if self.policy == "priority":
            heapq.heappop(self._heap)
        else:
            self._fcfs.popleft()

    def add_request(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def abort(self, request_id: str) -> SimRequest | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == Status.RUNNING:
            self.running.remove(request)
        elif self.policy == "priority":
            self._heap = [entry for entry in self._heap if entry[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fcfs.remove(request)
        self._free(request)
        request.status = Status.FINISHED
        return request

    # -- blocks --------------------------------------------------------------------------------------------------

    def _allocate(self, request: SimRequest, num_new_tokens: int, hit: list[Block]) -> bool:
        """Blocks for ``num_new_tokens`` more tokens (after the ``hit`` blocks); False when they do not fit."""
        size = self.pool.block_size
        num_computed = request.num_computed_tokens + len(hit) * size
        num_required = -(-(num_computed + num_new_tokens) // size)
        num_new_blocks = max(0, num_required - len(request.blocks) - len(hit))
        # A hit on a free (cached, unreferenced) block takes it out of the free queue too.
        num_evictable_hits = sum(1 for block in hit if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return False
        if hit:
            self.pool.touch(hit)
            request.blocks.extend(hit)
            request.num_cached_blocks = len(hit)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        assert new_blocks is not None
        request.blocks.extend(new_blocks)
        num_full = min(num_computed + num_new_tokens, request.num_tokens) // size
        if num_full > request.num_cached_blocks:
            self.pool.cache_full_blocks(request.blocks, request.chain.hashes, request.num_cached_blocks, num_full,
                                        request.all_token_ids, request.cache_salt)
            request.num_cached_blocks = num_full
        return True

    def _free(self, request: SimRequest) -> None:
        self.pool.free_blocks(request.blocks[::-1])
        request.blocks = []
        request.num_cached_blocks = 0

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = Status.PREEMPTED
        self.num_preemptions += 1
        self._push_waiting(victim, front=True)

    def _victim(self) -> SimRequest:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_s))
        return self.running[-1]

    # -- one step ----------------------------------------------------------------------------------------------

    def schedule(self, now_s: float) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        contexts: dict[str, int] = {}
        preempted: list[str] = []
        # vLLM's long_prefill_token_threshold: a prefill takes at most this many tokens a step while any other
        # request runs or waits, so a long prompt does not hold the whole budget (and every request that
        # arrives behind it) for the length of its prefill; alone, it takes the budget.
        cap = self.long_prefill_token_threshold if len(self.running) + self.num_waiting > 1 else 0

        for request in list(self.running):
            if request.status != Status.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or no budget left for anyone
            num_new = _tokens_this_step(request.num_tokens - request.num_computed_tokens, cap, budget)
            if num_new <= 0:
                continue
            while not self._allocate(request, num_new, []):
                victim = self._victim()
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                    contexts.pop(victim.request_id)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                contexts[request.request_id] = request.num_computed_tokens
                budget -= num_new

        while not preempted and budget > 0 and self.num_waiting and len(self.running) < self.max_num_seqs:
            request = self._peek_waiting()
            hit: list[Block] = []
            if request.num_computed_tokens == 0:
                # vLLM never reuses the last token's block entry: that token must be computed to sample.
                max_hit_blocks = (request.num_tokens - 1) // self.pool.block_size
                hit = self.pool.longest_cache_hit(request.chain.hashes[:max_hit_blocks])
            num_computed = request.num_computed_tokens + len(hit) * self.pool.block_size
            num_new = request.num_tokens - num_computed
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = _tokens_this_step(num_new, cap, budget)
            if not self._allocate(request, num_new, hit):
                break
            self._pop_waiting()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                request.scheduled_s = now_s
            request.num_computed_tokens = num_computed
            request.status = Status.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            contexts[request.request_id] = num_computed
            budget -= num_new

        return ScheduledBatch(scheduled, self._shape(scheduled, contexts), tuple(preempted))

    def _shape(self, scheduled: dict[str, int], contexts: dict[str, int]) -> StepShape:
        num_prefill = num_decode = num_context = 0
        pairs = 0.0
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            context = contexts[request_id]
            # A decode computes the one token sampled last step; anything else is (re)computing the prompt.
            if num_new == 1 and request.output_token_ids and context == request.num_tokens - 1:
                num_decode += 1
            else:
                num_prefill += num_new
            pairs += num_new * (context + (num_new + 1) / 2)
            num_context += context + num_new
        return StepShape(sum(scheduled.values()), num_prefill, num_decode, len(scheduled), pairs, num_context)

    def update(self, batch: ScheduledBatch, now_s: float, next_token: Callable[[SimRequest], int]) -> StepOutput:
        """Applies a computed step: progress, one sampled token per request that caught up, finished
        requests out (their blocks freed, tail first)."""
        new_tokens: dict[str, int] = {}
        finished: list[SimRequest] = []
        for request_id, num_new in batch.num_new_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != Status.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new
            request.num_steps += 1
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no token yet
            token = next_token(request)
            request.output_token_ids.append(token)
            if request.num_tokens % self.pool.block_size == 0:  # a block just filled: hash it
                request.chain.extend(request.all_token_ids)
            new_tokens[request_id] = token
            if len(request.output_token_ids) == 1:
                request.first_token_s = now_s
            if len(request.output_token_ids) >= request.max_tokens:
                request.status = Status.FINISHED
                request.finished_s = now_s
                self.running.remove(request)
                self._free(request)
                del self.requests[request_id]
                finished.append(request)
        return StepOutput(new_tokens, tuple(finished))
