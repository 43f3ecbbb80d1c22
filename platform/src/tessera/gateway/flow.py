"""One generation request through the gateway, from raw body to the last SSE event."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, NamedTuple

import jinja2
import orjson
from pydantic import ValidationError
from redis.exceptions import NoScriptError

from tessera.gateway.engine_client import Delta, StreamResult
from tessera.gateway.errors import STORE_ERRORS, APIError, bad_request, invalid_field, unauthorized
from tessera.gateway.openai_format import ChunkWriter, finish_reason, full_response, usage
from tessera.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tessera.gateway.sse_out import SSEOut
from tessera.redis_wire import Command
from tessera.routing.hashing import block_hash_chain
from tessera.routing.router import RoutePlan
from tessera.routing.snapshot import RouteDecision, RouteRequest
from tessera.telemetry.late_spans import LateTrace
from tessera.tenancy.admission import Lease, Rejection
from tessera.tenancy.billing import FinishQueue
from tessera.tenancy.demotion import demoted_key
from tessera.tenancy.policy import DEMOTION_STEP, PRIORITY_VALUES

if TYPE_CHECKING:
    from tessera.registry import EngineRecord
    from tessera.gateway.app import Gateway, Receive, Scope, Send
    from tessera.gateway.models import ServedModel
    from tessera.tenancy.store import Tenant

logger = logging.getLogger(__name__)

# How soon a lease renewal that Redis did not answer is tried again.
LEASE_RETRY_S = 0.25
APPROX_PREFIX_CHARS = 4096
# Admission under KV pressure: while every engine of the model carries the controller's pressure flag,
# requests of the low and batch classes get 503 + Retry-After (they are the deferrable ones); the others
# are admitted and queue in the engine by priority.
SHED_UNDER_PRESSURE_FROM = PRIORITY_VALUES["low"]
# A tenant rejected within this long gets its next admission without the prefix lookup riding along.
REJECTED_HINT_S = 1.0
MAX_REJECTION_HINTS = 10_000

class Admitted(NamedTuple):
    """What admission's round trip brings back: the verdict, the prefix lookup's answer (None: it did not
    ride along) and whether the KV-eviction controller has demoted the tenant."""

    decision: Lease | Rejection
    cached: dict[str, int] | None
    demoted: bool


# A request's routing inputs as admission leaves them: the request, its plan (None: the registry could not
# be read), and the prefix lookup's answer (None: it did not ride along with admission).
Routing = tuple[RouteRequest, RoutePlan | None, dict[str, int] | None]


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.", "body_too_large")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "Client disconnected while sending the body.", "client_disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", "body_too_large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


class GenerationFlow:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.finishes = FinishQueue(gateway.admission, lambda exc: isinstance(exc, STORE_ERRORS))
        # Fail-open mode only: what this process last read from Redis, served while Redis is unreachable.
        self._known_models: dict[str, ServedModel] = {}
        self._known_routes: dict[str, tuple[RouteDecision, dict[str, EngineRecord]]] = {}
        # tenant -> when this process last rejected it (see _admit).
        self._rejected_at: dict[str, float] = {}

    async def handle(self, chat: bool, scope: Scope, receive: Receive, send: Send, headers: dict[str, str],
                     request_id: str, notes: LateTrace) -> None:
        gw = self.gw
        t_start = time.monotonic()
        raw = await read_body(receive, headers, gw.settings.max_body_bytes)
        tenant = await gw.auth.tenant_for(headers.get("authorization"))
        if tenant is None:
            raise unauthorized()
        notes.attributes["tessera.tenant"] = tenant.name
        req = parse_request(chat, raw)
        notes.attributes["gen_ai.request.model"] = req.model
        model = await self._model(req.model)
        if model is None:
            raise APIError(404, f"The model {req.model!r} does not exist; GET /v1/models lists yours.",
                           "model_not_found", "model")
        if not tenant.policy.allows_model(req.model):
            raise APIError(403, f"Your tenant may not use the model {req.model!r}.", "model_not_allowed", "model")
        prompt_ids = tokenize(chat, req, model)
        max_tokens = check_limits(chat, req, tenant, model, len(prompt_ids))
        notes.attributes.update({"gen_ai.usage.input_tokens": len(prompt_ids), "gen_ai.request.max_tokens": max_tokens})

        if tenant.policy.priority >= SHED_UNDER_PRESSURE_FROM and await self._all_engines_pressured(req.model):
            gw.metrics.rejected(tenant.name, "engine_under_pressure")
            notes.attributes["tessera.rejected"] = "engine_under_pressure"
            raise APIError(503, f"Every engine serving {req.model!r} is short of KV cache; low and batch "
                           "priority requests wait until it frees.", "engine_under_pressure",
                           headers={"Retry-After": "1"})
        reserve = len(prompt_ids) + max_tokens * req.n
        salt = tenant.cache_salt if tenant.policy.prefix_cache_isolation else None
        route_request = self._route_request(req, tenant, model, prompt_ids, salt)
        plan = await self._plan(route_request)
        t_admit, t_admit_ns = time.monotonic(), time.time_ns()
        # Routing waits for admission's verdict, but its prefix lookup rides in admission's round trip (see
        # _admit): a rejected request costs no routing work beyond that, an admitted one saves a round trip.
        decision, cached, demoted = await self._admit(tenant, reserve, plan)
        notes.child("admission", t_admit_ns, {"tessera.admitted": isinstance(decision, Lease)})
        if isinstance(decision, Rejection):
            if len(self._rejected_at) >= MAX_REJECTION_HINTS:
                self._rejected_at.clear()
            self._rejected_at[tenant.name] = time.monotonic()
            gw.metrics.rejected(tenant.name, decision.limit)
            notes.attributes["tessera.rejected"] = decision.limit
            raise APIError(429, decision.message, decision.limit,
                           headers={"Retry-After": str(decision.retry_after_s or 1)})
        lease = decision
        admission_s = time.monotonic() - t_admit
        notes.attributes["tessera.admission_wait_s"] = admission_s
        result = StreamResult()
        keeper = None if lease.detached else _LaterTask(lambda: self._keep_lease(lease), gw.admission.lease_ttl_s / 3)
        try:
            await self._serve(chat, req, tenant, prompt_ids, max_tokens, salt, (route_request, plan, cached),
                               demoted, request_id, notes, send, receive, result, t_start)
        finally:
            if keeper is not None:
                keeper.cancel()
            # Bill at least what was generated, also when the client went away mid-stream; when Redis
            # does not answer, the finish waits in the queue (usage is never lost).
            await self.finishes.finish(lease, len(prompt_ids), result.completion_tokens)

    async def _keep_lease(self, lease: Lease) -> None:
        """Renews the concurrency lease every third of its TTL while the request runs (long streams keep
        their slot; a dead gateway stops renewing and the lease expires). Started a third of a TTL after
        admission. A failed renewal is retried soon rather than a third of a TTL later: by then the lease
        may be gone."""
        admission = self.gw.admission
        while True:
            try:
                renewed = await admission.renew(lease)
            except STORE_ERRORS as exc:
                logger.warning("lease %s not renewed: %s", lease.lease_id, exc)
                await asyncio.sleep(min(admission.lease_ttl_s / 3, LEASE_RETRY_S))
                continue
            if not renewed:
                logger.warning("lease %s of tenant %s expired before renewal", lease.lease_id, lease.tenant)
                return
            await asyncio.sleep(admission.lease_ttl_s / 3)

    async def _model(self, name: str) -> ServedModel | None:
        try:
            model = await self.gw.catalog.get(name)
        except STORE_ERRORS:
            if self.gw.settings.redis_fail_open and name in self._known_models:
                return self._known_models[name]
            raise
        if model is not None and self.gw.settings.redis_fail_open:
            self._known_models[name] = model
        return model

    async def _route(self, routing: Routing) -> tuple[RouteDecision, dict[str, EngineRecord]]:
        request, plan, cached = routing
        try:
            if plan is not None and cached is not None:
                routed = self.gw.router.decide(plan, cached)  # the lookup came with admission
            else:
                routed = await self.gw.router.route(request)  # its own round trip(s)
        except STORE_ERRORS:
            if self.gw.settings.redis_fail_open and request.model in self._known_routes:
                return self._known_routes[request.model]
            raise
        if self.gw.settings.redis_fail_open:
            self._known_routes[request.model] = routed
        return routed

    async def _plan(self, request: RouteRequest) -> RoutePlan | None:
        """The route's plan from the cached registry; None when the registry cannot be read (the route then
        tries again after admission, and answers by the fail mode)."""
        try:
            return await self.gw.router.plan(request)
        except STORE_ERRORS:
            return None

    async def _admit(self, tenant: Tenant, reserve: int, plan: RoutePlan | None) -> Admitted:
        """Admission in one Redis round trip with what the request needs next: the tenant's demotion flag,
        and the plan's prefix lookup unless the tenant was rejected moments ago (a flood of over-limit
        requests then costs Redis no lookups) or the plan needs none."""
        gw = self.gw
        recently_rejected = time.monotonic() - self._rejected_at.get(tenant.name, -1e9) < REJECTED_HINT_S
        lookup_args = None if plan is None or recently_rejected else plan.lookup_args
        try:
            admitted = await self._admit_in_one_trip(tenant, reserve, lookup_args)
        except STORE_ERRORS:
            if not gw.settings.redis_fail_open:
                raise
            gw.metrics.fail_open(tenant.name)
            return Admitted(gw.admission.detached_lease(tenant.name, tenant.policy), None, False)
        if plan is not None and plan.lookup_args is None:
            return admitted._replace(cached={})  # nothing to look up: the route needs no lookup either
        return admitted

    async def _admit_in_one_trip(self, tenant: Tenant, reserve: int,
                                 lookup_args: list[str | int] | None) -> Admitted:
        gw = self.gw
        call = gw.admission.prepare(tenant.name, tenant.policy, reserve)
        commands: list[Command] = [("EVALSHA", gw.admission.admit_sha, len(call.keys), *call.keys, *call.args),
                                   ("EXISTS", demoted_key(tenant.name))]
        if lookup_args is not None:
            commands.append(("EVALSHA", gw.router.lookup_sha, 0, *lookup_args))
        replies = await gw.wire.execute(commands)
        verdict, demoted = replies[0], replies[1]
        # NOSCRIPT (a restarted or flushed Redis): that script did not run, and the standalone call loads it.
        if isinstance(verdict, NoScriptError):
            decision = await gw.admission.admit(tenant.name, tenant.policy, reserve)
        elif isinstance(verdict, Exception):
            raise verdict
        else:
            decision = call.outcome(verdict)
        cached = None
        if lookup_args is not None and not isinstance(replies[2], Exception):
            cached = gw.router.parse_lookup(replies[2])
        return Admitted(decision, cached, not isinstance(demoted, Exception) and bool(demoted))

    def _route_request(self, req: CompletionRequest | ChatCompletionRequest, tenant: Tenant, model: ServedModel,
                       prompt_ids: list[int], salt: str | None) -> RouteRequest:
        prompt_text = ""
        if self.gw.router.policy_name == "approx_prefix":
            prompt_text = model.tokenizer.decode(prompt_ids[:APPROX_PREFIX_CHARS // 2])
        return RouteRequest(tenant=tenant.name, model=req.model, num_prompt_tokens=len(prompt_ids),
                            block_hashes=block_hash_chain(prompt_ids, model.info.block_size, salt),
                            prompt_prefix=prompt_text, session_id=req.user)

    async def _route_traced(self, routing: Routing,
                            notes: LateTrace) -> tuple[RouteDecision, dict[str, EngineRecord]]:
        started_ns = time.time_ns()
        decision, records = await self._route(routing)
        hashes = routing[0].block_hashes
        notes.child("route", started_ns, {
            "tessera.route.reason": decision.reason,
            "tessera.route.expected_cached_tokens": decision.expected_cached_tokens,
            # The chain's first block names the prefix in the controller's eviction spans (``tessera traces
            # analyze`` joins on it).
            "tessera.prefix_root": f"{hashes[0]:016x}" if hashes else "",
            "tessera.prompt_blocks": len(hashes)})
        return decision, records

    async def _serve(self, chat: bool, req: CompletionRequest | ChatCompletionRequest, tenant: Tenant,
                     prompt_ids: list[int], max_tokens: int, salt: str | None, routing: Routing, demoted: bool,
                     request_id: str, notes: LateTrace, send: Send, receive: Receive, result: StreamResult,
                     t_start: float) -> None:
        gw = self.gw
        decision, records = await self._route_traced(routing, notes)
        if not decision.ranked:
            raise APIError(503, f"No engine is serving {req.model!r} right now; retry shortly.",
                           "engine_unavailable", headers={"Retry-After": "2"})
        priority = tenant.policy.priority + (DEMOTION_STEP if demoted else 0)
        body = {"request_id": request_id, "prompt_token_ids": prompt_ids, "max_tokens": max_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stop": req.stop_list,
                "n": req.n, "cache_salt": salt, "priority": priority,
                "ignore_eos": req.ignore_eos}
        targets = [(eid, records[eid].url) for eid in decision.ranked]
        engine_headers = {"x-tessera-tenant": tenant.name, "x-request-id": request_id}
        notes.engine_headers(engine_headers)
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        first = decision.ranked[0]
        out_headers = [(b"x-request-id", request_id.encode()), (b"x-tessera-engine", first.encode()),
                       (b"x-tessera-route-reason", decision.reason.encode())]
        notes.attributes.update({"tessera.engine": first, "tessera.route.reason": decision.reason,
                                 "tessera.priority": priority})
        gw.router.started(first)
        try:
            notes.call_started()
            call_error: Exception | None = None
            try:
                call = EngineCall(targets, body, engine_headers, result)
                if req.stream:
                    await self._stream_out(chat, req, call, send, receive, out_headers, response_id, created,
                                           len(prompt_ids))
                else:
                    await self._collect(chat, req, call, send, out_headers, response_id, created, len(prompt_ids))
            except Exception as exc:
                call_error = exc
                raise
            finally:
                if result.first_delta_ns is not None:
                    # The analyzer's TTFT as the gateway saw it.
                    notes.event("first_token", result.first_delta_ns)
                notes.call_ended({"tessera.engines_tried": ",".join(result.engines_tried)}, call_error)
        finally:
            gw.router.finished(first)
            stats = result.stats
            notes.attributes.update({
                "gen_ai.usage.output_tokens": result.completion_tokens,
                "tessera.cached_tokens": int(stats.get("num_cached_tokens", 0)),
                "tessera.preemptions": int(stats.get("num_preemptions", 0)),
                "tessera.retries": result.retries,
                "tessera.engine.final": result.engines_tried[-1] if result.engines_tried else "",
            })
            elapsed_s = time.monotonic() - t_start
            # The first delta is stamped on the wall clock (it is a span event): TTFT is the elapsed time
            # less the time since that stamp.
            ttft_s = (None if result.first_delta_ns is None
                      else elapsed_s - (time.time_ns() - result.first_delta_ns) / 1e9)
            gw.metrics.completed(tenant.name, result.completion_tokens, elapsed_s, ttft_s)

    async def _all_engines_pressured(self, model: str) -> bool:
        """True while the KV-eviction controller flags every live engine of the model (registry view, cached
        for REGISTRY_CACHE_S); a registry that cannot be read sheds nothing."""
        try:
            records = await self.gw.router.engines(model)
        except STORE_ERRORS:
            return False
        return bool(records) and all(r.under_pressure for r in records)

    async def _collect(self, chat: bool, req: Any, call: EngineCall, send: Send,
                       out_headers: list[tuple[bytes, bytes]], response_id: str, created: int,
                       num_prompt: int) -> None:
        texts: dict[int, list[str]] = {i: [] for i in range(req.n)}

        def take(deltas: list[Delta]) -> None:
            for delta in deltas:
                texts.setdefault(delta.index, []).append(delta.text)

        await self.gw.engines.relay(*call, take)
        result = call.result
        cached = int(result.stats.get("num_cached_tokens", 0))
        body = full_response(chat, response_id, req.model, created, {i: "".join(t) for i, t in texts.items()},
                             result.finish, usage(num_prompt, result.completion_tokens, cached))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), *out_headers]})
        await send({"type": "http.response.body", "body": body})

    async def _stream_out(self, chat: bool, req: Any, call: EngineCall, send: Send, receive: Receive,
                          out_headers: list[tuple[bytes, bytes]], response_id: str, created: int,
                          num_prompt: int) -> None:
        """Deltas go out from the engine connection's callbacks as they arrive (SSEOut). This task runs the
        relay itself, so the request is on the engine's socket in this very step (a relay task would wait
        for the next event-loop iteration), and a watcher cancels it when the client leaves: the engine
        connection then closes on the way out, and the replica aborts the vLLM request."""
        writer = ChunkWriter(chat, response_id, req.model, created)
        out = SSEOut(send, writer, req.n if chat else 0, out_headers)
        result = call.result
        handler = asyncio.current_task()
        assert handler is not None
        watch = {"streaming": True, "client_left": False}

        def client_left(gone: asyncio.Task[None]) -> None:
            # Runs an iteration after the watcher ended: only cancel what is still this stream.
            if watch["streaming"] and not gone.cancelled() and gone.exception() is None:
                watch["client_left"] = True
                handler.cancel()

        gone = asyncio.ensure_future(_wait_disconnect(receive))
        gone.add_done_callback(client_left)
        try:
            await self.gw.engines.relay(*call, out.deltas)
            tail = [writer.finish(i, finish_reason(result.finish.get(i))) for i in range(req.n)]
            if req.include_usage:
                cached = int(result.stats.get("num_cached_tokens", 0))
                tail.append(writer.usage(usage(num_prompt, result.completion_tokens, cached)))
            tail.append(writer.done())
            await out.end(b"".join(tail))
        except asyncio.CancelledError:
            if not watch["client_left"]:
                raise
            handler.uncancel()  # the client left: nothing more to send, the request ends normally
        except APIError as err:
            if not out.started:
                raise
            await out.end(b"data: " + orjson.dumps({"error": {"message": err.message, "code": err.code}}) + b"\n\n")
        finally:
            watch["streaming"] = False
            gone.cancel()
            out.close()


class EngineCall(NamedTuple):
    """What ``EngineClient.relay`` needs besides the sink: the ranked targets, the body, the headers and
    the result it fills in."""

    targets: list[tuple[str, str]]
    body: dict[str, Any]
    headers: dict[str, str]
    result: StreamResult


class _LaterTask:
    """A coroutine run as a task from ``delay_s`` on, cancellable before and after it starts. Until then it
    is a timer: on the request path that is cheaper than a task whose first step only goes to sleep."""

    def __init__(self, start: Callable[[], Coroutine[Any, Any, None]], delay_s: float) -> None:
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._start, start)

    def _start(self, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._task = asyncio.ensure_future(start())

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass




def parse_request(chat: bool, raw: bytes) -> CompletionRequest | ChatCompletionRequest:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object.", "invalid_json")
    try:
        return ChatCompletionRequest.model_validate(data) if chat else CompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid_field(exc.errors()) from None  # type: ignore[arg-type]


def tokenize(chat: bool, req: CompletionRequest | ChatCompletionRequest, model: ServedModel) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        messages = []
        for i, message in enumerate(req.messages):
            try:
                messages.append({"role": message.role, "content": message.text()})
            except ValueError as exc:
                param = f"messages[{i}].content"
                raise bad_request(f"Invalid request: {param}: {exc}", "unsupported_content", param) from None
        try:
            ids = model.encode_chat(messages)
        except jinja2.TemplateError as exc:
            raise bad_request(f"The model's chat template rejects these messages: {exc}", "invalid_messages",
                              "messages") from None
    elif isinstance(req.prompt, str):
        ids = model.encode(req.prompt)
    elif req.prompt and isinstance(req.prompt[0], str):
        ids = model.encode(str(req.prompt[0]))
    else:
        ids = [int(t) for t in req.prompt]  # type: ignore[arg-type]
        vocab = model.tokenizer.get_vocab_size()
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"Prompt token ids must be in [0, {vocab}).", "invalid_token_id", "prompt")
    if not ids:
        raise bad_request("The prompt is empty after tokenization.", "empty_prompt", "prompt")
    return ids


def check_limits(chat: bool, req: CompletionRequest | ChatCompletionRequest, tenant: Tenant,
                 model: ServedModel, num_prompt: int) -> int:
    policy = tenant.policy
    if req.n > policy.max_n:
        raise bad_request(f"n={req.n} exceeds your limit of {policy.max_n}.", "n_too_large", "n")
    if req.n > 1 and req.temperature == 0.0:
        raise bad_request("n > 1 needs temperature > 0: greedy decoding gives n identical choices.",
                          "invalid_value", "n")
    if policy.max_prompt_tokens is not None and num_prompt > policy.max_prompt_tokens:
        raise bad_request(f"The prompt has {num_prompt} tokens; your limit is {policy.max_prompt_tokens}.",
                          "prompt_too_long", "prompt")
    context = model.info.max_model_len
    if num_prompt >= context:
        raise bad_request(f"The prompt has {num_prompt} tokens; the model's context is {context} tokens.",
                          "context_length_exceeded", "messages" if chat else "prompt")
    requested = req.requested_max_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
    param = "max_tokens"
    if requested is None:
        return min(policy.max_tokens_cap, context - num_prompt)
    if requested > policy.max_tokens_cap:
        raise bad_request(f"max_tokens={requested} exceeds your limit of {policy.max_tokens_cap}.",
                          "max_tokens_too_large", param)
    if num_prompt + requested > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens; the prompt has {num_prompt} and "
            f"max_tokens is {requested} ({num_prompt + requested} in all). Lower max_tokens or the prompt.",
            "context_length_exceeded", param)
    return requested
