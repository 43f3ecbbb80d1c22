"""One engine replica: a vLLM ``AsyncLLM`` and the lean streaming HTTP endpoint the gateway calls.

The host runs in a thread of its own with its own event loop, so it works the same inside a Ray Serve
replica (which only has to construct it and forward health checks) and in a plain process (benchmarks).
Endpoints:
  POST /generate           NDJSON stream (see protocol.py); the vLLM request is aborted if the caller leaves
  POST /abort              {"request_id", "reason"}: the controller's last-resort abort (gateway retries)
  GET  /requests           in-flight requests with tenant and priority (the controller picks victims)
  GET  /health             200 while the engine is alive, 503 once it is dead
  GET  /stats              engine load, KV geometry, speculative-decoding counters, and what runs
  GET  /metrics            the same in Prometheus text (tessera_engine_*)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from tessera.engine.capabilities import PlatformAnswers, Resolution, ask_vllm, kv_fallback_note, resolve
from tessera.engine.config import EngineConfig
from tessera.engine.metrics import render_engine_metrics
from tessera.engine.ports import below_ephemeral_range, free_port, reserve_port
from tessera.engine.protocol import GenerateRequest, RequestStats
from tessera.registry import EngineRecord, EngineRegistry, ModelInfo, register_model
from tessera.engine.root_cause import EngineErrorLog, start_failure_line
from tessera.engine.stats import EngineLoad, LoadTracker, make_stat_logger_factory

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-store")]
JSON_HEADERS = [(b"content-type", b"application/json")]
# One forward pass before the endpoint opens. Found on this project's CI machine kind (Xeon with AMX, in a
# VM, vLLM 0.32 CPU build): when the engine's first pass has fewer than 5 tokens, its worker dies with
# SIGILL (exit code -4) and the engine is dead; after any first pass of 5 or more tokens, prompts of one
# token run. Fewer tokens than a KV block (32 on CPU), so nothing lands in the prefix cache, and a salt no
# tenant has.
WARMUP_PROMPT_TOKENS = 16
WARMUP_SALT = "tessera-engine-warmup"


class EngineStartError(RuntimeError):
    """An engine replica could not start; the message names the root cause and, where known, the fix."""


@dataclass(slots=True)
class InFlight:
    request_id: str
    tenant: str
    priority: int
    started_ts: float
    abort_reason: str | None = None
    # W3C traceparent of this request's engine.generate span: the KV-eviction controller links its
    # eviction and action spans to the requests they affect (and parents an abort under it).
    traceparent: str = ""


async def _read_body(receive: Receive, limit: int = 8 * 1024 * 1024) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client went away")
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise ValueError("request body too large")
        chunks.append(body)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, payload: Any) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": orjson.dumps(payload)})


class EngineHost:
    """Owns the engine, the HTTP server and the registry heartbeat of one replica."""

    def __init__(self, config: EngineConfig, redis_url: str | None, engine_id: str | None = None,
                 advertise_host: str = "127.0.0.1",
                 ask_platform: Callable[[EngineConfig], PlatformAnswers] = ask_vllm) -> None:
        self.config = config  # as requested; ``resolution.config`` is what runs
        self._ask_platform = ask_platform
        self.resolution = Resolution(config)
        self.redis_url = redis_url
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.advertise_host = advertise_host
        # Held from here until the server listens on it (see reserve_port).
        self._http_socket = (reserve_port(config.http_host, f"{config.http_port}-{config.http_port}")
                             if config.http_port else
                             reserve_port(config.http_host, os.environ.get("TESSERA_ENGINE_PORT_RANGE")))
        self.port = int(self._http_socket.getsockname()[1])
        self.kv_events_port = (free_port(port_range=os.environ.get("TESSERA_KV_EVENTS_PORT_RANGE")
                                         or below_ephemeral_range())
                               if config.kv_events.enabled else 0)
        self.tracker = LoadTracker()
        self.in_flight: dict[str, InFlight] = {}
        self.engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._error_log: EngineErrorLog | None = None
        self._server: Any = None
        self._stopping = False

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.advertise_host}:{self.kv_events_port}" if self.kv_events_port else ""

    def start(self, timeout_s: float = 600.0) -> EngineHost:
        """Starts the engine thread and waits until the engine is up and the endpoint listens."""
        from tessera.settings import load_settings
        from tessera.telemetry.tracing import configure_tracing

        settings = load_settings()
        configure_tracing("tessera-engine", settings.trace_exporter, settings.trace_dir, settings.otlp_endpoint,
                          settings.trace_sample_ratio)
        self._thread = threading.Thread(target=self._thread_main, name=f"tessera-{self.engine_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"engine {self.engine_id} did not start within {timeout_s} s")
        if self._startup_error is not None:
            cause = self._startup_error
            child_cause = self._error_log.cause() if self._error_log is not None else None
            raise EngineStartError(f"engine {self.engine_id} could not start: "
                                   f"{start_failure_line(cause, child_cause)}") from cause
        return self

    def stop(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def is_healthy(self) -> bool:
        engine = self.engine
        alive = self._thread is not None and self._thread.is_alive()
        return bool(alive and engine is not None and not engine.errored)

    def _thread_main(self) -> None:
        try:
            import uvloop

            uvloop.install()
        except ImportError:  # pragma: no cover - uvloop is a dependency
            pass
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._startup_error = self._startup_error or exc
            logger.exception("engine host %s stopped with an error", self.engine_id)
        finally:
            self._ready.set()
            self._http_socket.close()  # no-op once the server owns and closed it
            if self.engine is not None:
                # Inside the loop: vLLM closes its asyncio ZMQ sockets only from a running loop (from outside
                # it schedules the close on this loop, which never runs again), and a ZMQ context with open
                # sockets hangs the process when it is garbage-collected.
                loop.run_until_complete(_shutdown_engine(self.engine))
            loop.close()

    async def _serve(self) -> None:
        import uvicorn
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_space_gib))
        # Before the model loads: what this platform can run of the config (a strict config stops here).
        self.resolution = resolve(self.config, self._ask_platform(self.config))
        self._error_log = EngineErrorLog()  # where vLLM's engine process logs why it failed, if it does
        kv_bind = f"tcp://*:{self.kv_events_port}" if self.kv_events_port else None
        args = AsyncEngineArgs(**self.resolution.config.to_vllm_kwargs(kv_events_endpoint=kv_bind))
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[make_stat_logger_factory(self.tracker)])
        cache = self.engine.vllm_config.cache_config
        self.tracker.load.num_gpu_blocks = int(cache.num_gpu_blocks or 0)
        self.tracker.load.block_size = int(cache.block_size)
        self.tracker.load.kv_cache_dtype = str(cache.cache_dtype)
        self._log_fallbacks()
        await self._warm_up()

        config = uvicorn.Config(
            self.asgi, host=self.config.http_host, port=self.port, loop="none", http="httptools",
            log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=300,
            interface="asgi3", proxy_headers=False,
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        indexer = asyncio.create_task(self._index_loop())
        watchdog = asyncio.create_task(self._ready_when_listening())
        try:
            await self._server.serve(sockets=[self._http_socket])
        finally:
            heartbeat.cancel()
            indexer.cancel()
            watchdog.cancel()
            await self._deregister()

    def _log_fallbacks(self) -> None:
        """One line per setting that runs differently from the config; the KV line says what it costs."""
        load = self.tracker.snapshot()
        for fallback in self.resolution.fallbacks:
            if fallback.setting == "kvCacheDtype":
                element = self.engine.vllm_config.model_config.dtype
                logger.warning("engine %s: %s", self.engine_id, kv_fallback_note(
                    fallback, str(element).removeprefix("torch."), element.itemsize, load.num_gpu_blocks,
                    load.block_size, blocks_fixed=self.config.num_gpu_blocks_override is not None))
            else:
                logger.warning("engine %s: %s", self.engine_id, fallback.describe())

    def facts(self, load: EngineLoad | None = None) -> dict[str, Any]:
        """What this replica runs, for /stats, /metrics and the registry: the effective KV dtype and
        capacity, the speculative method, and why any of them differ from the config."""
        load = load or self.tracker.snapshot()
        return {
            "kv_cache_dtype": self.resolution.config.kv_cache_dtype,
            "kv_cache_dtype_requested": self.config.kv_cache_dtype,
            "kv_capacity_tokens": load.num_gpu_blocks * load.block_size,
            "speculative_method": self.resolution.speculative_method,
            "fallbacks": [f.describe() for f in self.resolution.fallbacks],
        }

    async def _warm_up(self) -> None:
        """See WARMUP_PROMPT_TOKENS; also takes the first pass's one-time costs off the first request."""
        from vllm import SamplingParams

        prompt = {"prompt_token_ids": list(range(1, WARMUP_PROMPT_TOKENS + 1)), "cache_salt": WARMUP_SALT}
        async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                            request_id=f"{self.engine_id}-warmup"):
            pass

    async def _ready_when_listening(self) -> None:
        while not self._server.started:
            await asyncio.sleep(0.02)
        self._ready.set()

    # ---- registry --------------------------------------------------------------------------------

    def record(self) -> EngineRecord:
        load = self.tracker.snapshot()
        facts = self.facts(load)
        return EngineRecord(
            engine_id=self.engine_id,
            url=self.url,
            model=self.config.served_model_name,
            block_size=load.block_size,
            num_gpu_blocks=load.num_gpu_blocks,
            max_model_len=self.config.max_model_len,
            kv_events_endpoint=self.kv_events_endpoint,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_cache_usage,
            kv_cache_dtype=facts["kv_cache_dtype"],
            kv_capacity_tokens=facts["kv_capacity_tokens"],
            speculative_method=facts["speculative_method"],
            fallbacks="\n".join(facts["fallbacks"]),
        )

    async def _heartbeat_loop(self) -> None:
        if not self.redis_url:
            return
        from tessera.redis_conn import connect

        redis = connect(self.redis_url)
        registry = EngineRegistry(redis, self.config.heartbeat_interval_s)
        model = ModelInfo(name=self.config.served_model_name, tokenizer=self.config.tokenizer_path,
                          max_model_len=self.config.max_model_len, block_size=self.tracker.snapshot().block_size)
        model_registered = False
        try:
            while True:
                # A dead engine stops heartbeating, so the gateway stops routing to it within the TTL. A Redis
                # error is retried on the next beat: one slow answer at start-up must not leave the replica
                # serving but unregistered for good.
                if self.is_healthy():
                    try:
                        if not model_registered:
                            await register_model(redis, model)
                            model_registered = True
                        await registry.heartbeat(self.record())
                    except Exception as exc:
                        logger.warning("heartbeat to Redis failed: %s", exc)
                await asyncio.sleep(self.config.heartbeat_interval_s)
        finally:
            await redis.aclose()

    async def _index_loop(self) -> None:
        """Feeds the shared prefix index from this engine's own KV events (see routing/prefix_index.py)."""
        if not self.redis_url or not self.kv_events_port:
            return
        from tessera.redis_conn import connect
        from tessera.routing.indexer import FeedStats, feed_index
        from tessera.routing.kv_events import KVEventSubscriber
        from tessera.routing.prefix_index import PrefixIndex

        # Subscribe before clearing: events published from here on queue in the socket, none is lost.
        events = KVEventSubscriber(f"tcp://127.0.0.1:{self.kv_events_port}", self.config.kv_events.topic)
        redis = connect(self.redis_url, timeout_s=5.0)
        index = PrefixIndex(redis)
        try:
            while True:  # as the heartbeat: a Redis error at start-up is retried, never fatal to the feed
                try:
                    await index.clear_engine(self.engine_id)
                    live = [e.engine_id for e in await EngineRegistry(redis).live_engines()]
                    await index.sweep([*live, self.engine_id])
                    break
                except Exception as exc:
                    logger.warning("preparing the prefix index failed, retrying: %s", exc)
                    await asyncio.sleep(1.0)
            self.index_stats = FeedStats()  # read by tests and /stats consumers while the feed runs
            await feed_index(index, self.engine_id, events, self.index_stats)
        finally:
            events.close()
            await redis.aclose()

    async def _deregister(self) -> None:
        if not self.redis_url:
            return
        from tessera.redis_conn import connect

        # Not on a request path: a busy Redis gets time, so the index does not keep a stopped engine's blocks.
        redis = connect(self.redis_url, timeout_s=5.0)
        try:
            from tessera.routing.prefix_index import PrefixIndex

            await EngineRegistry(redis).deregister(self.engine_id)
            await PrefixIndex(redis).clear_engine(self.engine_id)
        except Exception as exc:
            logger.warning("deregister failed: %s", exc)
        finally:
            await redis.aclose()

    # ---- HTTP ------------------------------------------------------------------------------------

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/generate" and method == "POST":
            await self._generate(scope, receive, send)
        elif path == "/health":
            healthy = self.is_healthy()
            await _respond(send, 200 if healthy else 503, {"healthy": healthy, "engine_id": self.engine_id})
        elif path == "/stats":
            load = self.tracker.snapshot()
            await _respond(send, 200, {"engine_id": self.engine_id, **asdict(load), **self.facts(load)})
        elif path == "/metrics":
            load = self.tracker.snapshot()
            body, content_type = render_engine_metrics(self.engine_id, self.config.served_model_name, load,
                                                       self.facts(load))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", content_type.encode())]})
            await send({"type": "http.response.body", "body": body})
        elif path == "/requests":
            await _respond(send, 200, [asdict(r) for r in self.in_flight.values()])
        elif path == "/abort" and method == "POST":
            await self._abort(receive, send)
        else:
            await _respond(send, 404, {"error": f"no route {method} {path}"})

    async def _abort(self, receive: Receive, send: Send) -> None:
        body = orjson.loads(await _read_body(receive))
        request_id = str(body.get("request_id", ""))
        entry = self.in_flight.get(request_id)
        if entry is None:
            await _respond(send, 404, {"error": f"request {request_id!r} is not running here"})
            return
        entry.abort_reason = str(body.get("reason", "aborted"))
        await self.engine.abort(request_id)
        await _respond(send, 200, {"aborted": request_id})

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            request = GenerateRequest.model_validate_json(await _read_body(receive))
        except ConnectionError:
            return
        except ValueError as exc:
            await _respond(send, 400, {"error": str(exc)})
            return
        if not self.is_healthy():
            await _respond(send, 503, {"error": "engine is not healthy"})
            return
        headers = dict(scope.get("headers") or [])
        tenant = headers.get(b"x-tessera-tenant", b"").decode()
        entry = InFlight(request.request_id, tenant, request.priority, time.time())
        self.in_flight[request.request_id] = entry
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON_HEADERS})
        stream = asyncio.create_task(self._traced_stream(request, entry, send, headers))
        disconnect = asyncio.create_task(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if stream not in done:
                # The caller left: cancelling the generator makes vLLM abort; abort explicitly as well.
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
                await self.engine.abort(request.request_id)
            else:
                stream.result()
        finally:
            disconnect.cancel()
            self.in_flight.pop(request.request_id, None)

    async def _traced_stream(self, request: GenerateRequest, entry: InFlight, send: Send,
                             headers: dict[bytes, bytes]) -> None:
        """Runs the generation inside an ``engine.generate`` span joined to the gateway's trace."""
        from opentelemetry import trace
        from opentelemetry.propagate import extract

        carrier = {k.decode(): v.decode("latin-1") for k, v in headers.items()}
        tracer = trace.get_tracer("tessera.engine")
        with tracer.start_as_current_span("engine.generate", context=extract(carrier), kind=trace.SpanKind.SERVER,
                                          attributes={"tessera.engine": self.engine_id,
                                                      "tessera.request_id": request.request_id,
                                                      "tessera.tenant": entry.tenant,
                                                      "tessera.priority": request.priority,
                                                      "gen_ai.request.max_tokens": request.max_tokens}) as span:
            ctx = span.get_span_context()
            if ctx.is_valid:
                entry.traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
            stats = await self._stream(request, entry, send)
            record_engine_span(span, stats, entry.abort_reason)

    async def _stream(self, request: GenerateRequest, entry: InFlight, send: Send) -> RequestStats:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=request.n, max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, seed=request.seed, stop=request.stop or None, ignore_eos=request.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_token_ids}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        stats = RequestStats(engine_id=self.engine_id, num_prompt_tokens=len(request.prompt_token_ids))
        finish: dict[str, str | None] = {}
        final: Any = None
        async for output in self.engine.generate(prompt, params, request_id=request.request_id,
                                                 priority=request.priority):
            final = output
            stats.num_steps += 1
            lines = []
            for completion in output.outputs:
                num_new = len(completion.token_ids)
                stats.num_output_tokens += num_new
                if num_new or completion.text:
                    lines.append(orjson.dumps({"i": completion.index, "t": completion.text, "d": completion.token_ids}))
                if completion.finish_reason is not None:
                    finish[str(completion.index)] = completion.finish_reason
            if lines:
                await send({"type": "http.response.body", "body": b"\n".join(lines) + b"\n", "more_body": True})
            # NOTE: neither vLLM's output queue nor a non-full socket buffer suspends this coroutine, so a
            # stream would hold the event loop for its whole length and starve /stats, /requests and /abort
            # (the KV-eviction controller's view of the engine): give the loop a turn after every step.
            await asyncio.sleep(0)
        if entry.abort_reason is not None and (final is None or not final.finished or
                                               all(v in (None, "abort") for v in finish.values())):
            tail = {"error": f"request aborted by the engine: {entry.abort_reason}", "status": 503,
                    "retryable": True, "stats": stats.to_dict()}
            await send({"type": "http.response.body", "body": orjson.dumps(tail) + b"\n", "more_body": False})
            return stats
        _fill_timeline(stats, final, request.n)
        done = {"done": True, "finish": finish, "stats": stats.to_dict()}
        await send({"type": "http.response.body", "body": orjson.dumps(done) + b"\n", "more_body": False})
        return stats


def record_engine_span(span: Any, stats: RequestStats, abort_reason: str | None) -> None:
    """The engine timeline as span events at their real times, plus GenAI and tessera.* attributes."""
    span.set_attributes({
        "gen_ai.usage.input_tokens": stats.num_prompt_tokens,
        "gen_ai.usage.output_tokens": stats.num_output_tokens,
        "tessera.cached_tokens": stats.num_cached_tokens,
        "tessera.preemptions": stats.num_preemptions,
        "tessera.spec.accepted_tokens": stats.num_spec_accepted_tokens,
        "tessera.spec.draft_tokens": stats.num_spec_draft_tokens,
        "tessera.engine.steps": stats.num_steps,
        "tessera.queue_s": stats.queued_s,
        "tessera.prefill_s": stats.prefill_s,
        "tessera.decode_s": stats.decode_s,
        "tessera.ttft_s": stats.ttft_s,
    })
    for name, ts in (("queued", stats.arrival_ts), ("scheduled", stats.scheduled_ts),
                     ("first_token", stats.first_token_ts), ("finished", stats.finished_ts)):
        if ts:
            span.add_event(name, timestamp=int(ts * 1e9))
    if stats.num_preemptions:
        # vLLM reports how often, not when: one event carries the count.
        span.add_event("preempted", attributes={"tessera.preemptions": stats.num_preemptions},
                       timestamp=int((stats.finished_ts or time.time()) * 1e9))
    if abort_reason:
        span.set_attribute("tessera.aborted", abort_reason)
        span.add_event("aborted", attributes={"tessera.cause": abort_reason})


async def _shutdown_engine(engine: Any) -> None:
    engine.shutdown()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _fill_timeline(stats: RequestStats, final: Any, n: int) -> None:
    if final is None:
        return
    stats.num_cached_tokens = int(final.num_cached_tokens or 0)
    # Every step yields one token per sequence without speculation; the rest are accepted drafts. vLLM's
    # per-request metrics (single-sequence requests) give the exact counts, drafted ones included.
    stats.num_spec_accepted_tokens = max(0, stats.num_output_tokens - stats.num_steps * n)
    spec = getattr(final.outputs[0], "spec_decode_metrics", None) if n == 1 and final.outputs else None
    if spec is not None:
        stats.num_spec_draft_tokens = int(spec.num_draft_tokens)
        stats.num_spec_accepted_tokens = sum(j * count for j, count in enumerate(spec.histogram))
    metrics = final.metrics
    if metrics is None:
        return
    stats.num_preemptions = int(getattr(metrics, "num_preemptions", 0))
    queued, scheduled = metrics.queued_ts, metrics.scheduled_ts
    first, last = metrics.first_token_ts, metrics.last_token_ts
    arrival = metrics.arrival_time

    def wall(ts: float) -> float:
        return arrival + (ts - queued) if ts and queued else 0.0

    stats.queued_s = max(0.0, scheduled - queued) if scheduled else 0.0
    stats.prefill_s = max(0.0, first - scheduled) if first and scheduled else 0.0
    stats.ttft_s = float(metrics.first_token_latency)
    stats.decode_s = max(0.0, last - first) if last and first else 0.0
    stats.arrival_ts = arrival
    stats.scheduled_ts = wall(scheduled)
    stats.first_token_ts = wall(first)
    stats.finished_ts = wall(last)
    stats.e2e_s = max(0.0, stats.finished_ts - arrival) if stats.finished_ts else 0.0
