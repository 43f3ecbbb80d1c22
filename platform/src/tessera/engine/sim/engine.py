"""One simulated engine: the scheduler stepped in (scaled) real time, and each request's tokens handed to
whoever streams them.

Time: a ``SimClock`` maps wall-clock time to simulated time (``time_scale`` wall seconds per simulated
second). A step that the model says takes ``dt`` simulated seconds ends ``dt`` simulated seconds after it
began, and the next one begins at that end (or at the last arrival, if later) as long as the loop woke no
more than ``timer_slack_s`` late: asyncio's timers wake a millisecond or so late, which would otherwise add
to every step. If the process falls further behind (a thousand engines on two cores), simulated time
follows the wall clock, so lag shows up as latency rather than vanishing. Every duration in a request's stats is
simulated; the ``*_ts`` timestamps are the clock's epoch plus simulated time. KV-event batches carry the
wall-clock time they were published, as vLLM's do.

Frontend: a real engine's request reaches its scheduler a few milliseconds after the replica received it
(input processing, the hop to the engine core). With ``frontend_delays_s`` each request enters the scheduler
that long after its arrival (one measured value drawn per request): its TTFT counts the delay, its queue
time starts at the scheduler, and nothing else waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.engine.protocol import GenerateRequest, RequestStats
from tessera.engine.sim.block_pool import BlockPool
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.hash_chain import BlockHashChain
from tessera.engine.sim.kv_wire import KVEvent
from tessera.engine.sim.scheduler import SimRequest, SimScheduler
from tessera.engine.sim.step_time import StepTimeFn, step_time_fn

logger = logging.getLogger(__name__)


class SimClock:
    """Simulated seconds since the clock started; shared by every engine of a fleet."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._start_wall = time.monotonic()
        self.epoch_s = time.time()

    def now(self) -> float:
        return (time.monotonic() - self._start_wall) / self.time_scale

    async def sleep_until(self, sim_s: float) -> None:
        delay = (sim_s - self.now()) * self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass(slots=True, eq=False)
class RequestStream:
    """What the HTTP side reads of one request: tokens as they come, then the end."""

    request: SimRequest
    num_sent: int = 0
    done: bool = False
    error: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class RequestRejected(ValueError):
    """A request this engine can never serve (too long for the model or the whole KV cache)."""


class SimEngine:
    def __init__(self, config: SimEngineConfig, engine_id: str, clock: SimClock,
                 publish: Callable[[float, list[KVEvent]], None] | None = None,
                 step_time: StepTimeFn | None = None) -> None:
        self.config = config
        self.engine_id = engine_id
        self.clock = clock
        self.num_gpu_blocks = config.resolved_num_gpu_blocks()
        self.pool = BlockPool(self.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = SimScheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                      max_num_batched_tokens=config.max_num_batched_tokens,
                                      enable_chunked_prefill=config.enable_chunked_prefill,
                                      policy=config.scheduling_policy,
                                      long_prefill_token_threshold=config.long_prefill_token_threshold)
        self._step_time = step_time or step_time_fn(config.step_time)
        self._publish = publish
        self._streams: dict[str, RequestStream] = {}
        self._work = asyncio.Event()
        self.num_steps = 0
        self.busy_s = 0.0  # simulated seconds spent in steps
        self._last_end_s = 0.0  # simulated end of the last step
        self._last_add_s = 0.0  # simulated arrival of the last request
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._frontend_rng = random.Random(config.frontend_seed)

    # -- requests -----------------------------------------------------------------------------------------

    def add(self, body: GenerateRequest) -> RequestStream:
        """Queues a request; ``RequestRejected`` when it can never run here, ``ValueError`` on a duplicate id."""
        num_tokens = len(body.prompt_token_ids) + body.max_tokens
        if num_tokens > self.config.max_model_len:
            raise RequestRejected(f"prompt ({len(body.prompt_token_ids)} tokens) plus max_tokens "
                                  f"({body.max_tokens}) exceeds max_model_len {self.config.max_model_len}")
        if -(-num_tokens // self.config.block_size) > self.num_gpu_blocks - 1:
            raise RequestRejected(f"{num_tokens} tokens do not fit in the KV cache "
                                  f"({self.num_gpu_blocks - 1} blocks of {self.config.block_size})")
        if body.request_id in self._streams:
            raise ValueError(f"request {body.request_id!r} is already running")
        arrival_s = self.clock.now()
        request = SimRequest(body.request_id, list(body.prompt_token_ids), body.max_tokens,
                             BlockHashChain(body.prompt_token_ids, self.config.block_size, body.cache_salt),
                             priority=body.priority, cache_salt=body.cache_salt, arrival_s=arrival_s)
        stream = RequestStream(request)
        self._streams[body.request_id] = stream
        delay_s = self._frontend_delay_s()
        if delay_s > 0:
            asyncio.get_running_loop().call_later(delay_s * self.clock.time_scale, self._enter, stream,
                                                  arrival_s + delay_s)
        else:
            self._enter(stream, arrival_s)
        return stream

    def _frontend_delay_s(self) -> float:
        delays = self.config.frontend_delays_s
        return self._frontend_rng.choice(delays) if delays else 0.0

    def _enter(self, stream: RequestStream, at_s: float) -> None:
        """The request reaches the scheduler at simulated ``at_s`` (unless it was aborted on the way)."""
        if stream.done:
            return
        stream.request.scheduler_arrival_s = at_s
        self._last_add_s = max(self._last_add_s, at_s)
        self.scheduler.add_request(stream.request)
        self._work.set()

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stops a request still queued or running (its blocks freed); its stream ends with ``reason``."""
        stream = self._streams.get(request_id)
        if stream is None or stream.done:
            return False
        self.scheduler.abort(request_id)
        stream.done = True
        stream.error = reason
        stream.changed.set()
        return True

    def release(self, stream: RequestStream) -> None:
        """The HTTP side is done with ``stream`` (sent, or the client left: then the request is aborted)."""
        self.abort(stream.request.request_id, "the client left")
        self._streams.pop(stream.request.request_id, None)

    def stats_of(self, stream: RequestStream) -> RequestStats:
        r, epoch = stream.request, self.clock.epoch_s
        end_s = r.finished_s or self.clock.now()
        return RequestStats(
            num_prompt_tokens=len(r.prompt_token_ids), num_cached_tokens=max(0, r.num_cached_tokens),
            num_output_tokens=len(r.output_token_ids), num_steps=r.num_steps, num_preemptions=r.num_preemptions,
            queued_s=max(0.0, r.scheduled_s - r.scheduler_arrival_s) if r.num_cached_tokens >= 0 else 0.0,
            prefill_s=max(0.0, r.first_token_s - r.scheduled_s) if r.first_token_s else 0.0,
            ttft_s=r.first_token_s - r.arrival_s if r.first_token_s else 0.0,
            decode_s=end_s - r.first_token_s if r.first_token_s else 0.0,
            e2e_s=end_s - r.arrival_s,
            arrival_ts=epoch + r.arrival_s, scheduled_ts=epoch + r.scheduled_s if r.num_cached_tokens >= 0 else 0.0,
            first_token_ts=epoch + r.first_token_s if r.first_token_s else 0.0,
            finished_ts=epoch + r.finished_s if r.finished_s else 0.0, engine_id=self.engine_id,
        )

    # -- the step loop --------------------------------------------------------------------------------------

    def _next_token(self, request: SimRequest) -> int:
        # Deterministic per request and position (crc32, not the salted str hash), so a rerun of the same
        # workload produces the same blocks.
        key = f"{request.request_id}:{len(request.output_token_ids)}".encode()
        return zlib.crc32(key) % self.config.vocab_size

    def _step_start(self) -> float:
        """When the next step begins in simulated time: where the last step ended (or the last request
        arrived, if later) when the loop is at most ``timer_slack_s`` late for it, else now (lag)."""
        now_s = self.clock.now()
        start_s = max(self._last_end_s, self._last_add_s)
        return start_s if now_s - start_s <= self.config.timer_slack_s / self.clock.time_scale else now_s

    async def run(self) -> None:
        """Steps while there is work, until cancelled."""
        while True:
            if not self.scheduler.has_work():
                self._work.clear()
                await self._work.wait()
            start_s = self._step_start()
            batch = self.scheduler.schedule(start_s)
            if not batch.num_new_tokens and batch.preempted:
                continue  # the running requests preempted each other: the next schedule admits from the queue
            if not batch.num_new_tokens:
                # Everything waits on blocks held by nobody running: only new work or aborts change that.
                self._work.clear()
                await self._work.wait()
                continue
            dt = self._step_time(batch.shape)
            await self.clock.sleep_until(start_s + dt)
            end_s = start_s + dt
            self._last_end_s = end_s
            self.num_steps += 1
            self.busy_s += dt
            out = self.scheduler.update(batch, end_s, self._next_token)
            events = self.pool.take_events()
            if events and self._publish is not None:
                # NOTE: a batch's ts is wall-clock, as vLLM's: it says when the batch left, which is what an
                # index's event-to-visible lag is measured against, whatever the time scale.
                self._publish(time.time(), events)
            for request_id in out.new_tokens:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.changed.set()
            for request in out.finished:
                self.prefix_queries += len(request.prompt_token_ids)
                self.prefix_hits += max(0, request.num_cached_tokens)
                stream = self._streams.get(request.request_id)
                if stream is not None:
                    stream.done = True
                    stream.changed.set()

    # -- load -----------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.pool.usage

    @property
    def pending_prefill_tokens(self) -> int:
        return self.scheduler.pending_prefill_tokens
