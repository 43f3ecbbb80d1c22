"""Phase ``prompt``: the served model (404, or 403 for a model the tenant may not use), the prompt's token
ids (tokenized once, by the endpoint's kind) and the tenant's and model's limits on them (400).

A request that no window of the tenant's tokens-per-minute limit or budget period could ever hold is a 400
here, naming the limit: admission would answer it 429 with ``Retry-After`` forever. A request that leaves
``max_tokens`` out gets the most output that can fit instead."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from tessera.gateway.errors import APIError, bad_request

if TYPE_CHECKING:
    from tessera.gateway.failopen import FailOpen
    from tessera.gateway.models import ModelCatalog, ServedModel
    from tessera.gateway.request.context import RequestContext
    from tessera.gateway.request.endpoint import Endpoint, OpenAIRequest
    from tessera.tenancy.policy import TenantPolicy
    from tessera.tenancy.store import Tenant


async def prepare_prompt(ctx: RequestContext, catalog: ModelCatalog, fail_open: FailOpen) -> None:
    body, tenant = ctx.body, ctx.tenant
    model = await fail_open.read("model", body.model, catalog.get(body.model))
    if model is None:
        if (why := catalog.unavailable(body.model)) is not None:  # the why (a path) for the logs, not the tenant
            raise APIError(503, f"The model {body.model!r} is registered but this gateway cannot load its "
                           "tokenizer; the operator is told in the gateway's log. Try again later.",
                           "model_unavailable", "model", headers={"Retry-After": "5"}, detail=why)
        raise APIError(404, f"The model {body.model!r} does not exist; GET /v1/models lists yours.",
                       "model_not_found", "model")
    if not tenant.policy.allows_model(body.model):
        raise APIError(403, f"Your tenant may not use the model {body.model!r}.", "model_not_allowed", "model")
    ctx.model = model
    ids = ctx.endpoint.tokenize(body, model)
    if not ids:
        raise bad_request("The prompt is empty after tokenization.", "empty_prompt", "prompt")
    ctx.prompt_ids = ids
    ctx.max_tokens = check_limits(ctx.endpoint, body, tenant, model, len(ids))
    ctx.cache_salt = tenant.cache_salt if tenant.policy.prefix_cache_isolation else None
    ctx.notes.attributes["gen_ai.usage.input_tokens"] = len(ids)
    ctx.notes.attributes["gen_ai.request.max_tokens"] = ctx.max_tokens


def check_limits(endpoint: Endpoint, body: OpenAIRequest, tenant: Tenant, model: ServedModel,
                 num_prompt: int) -> int:
    """The request's max_tokens after the tenant's and the model's limits (400 naming the one crossed)."""
    policy = tenant.policy
    if body.n > policy.max_n:
        raise bad_request(f"n={body.n} exceeds your limit of {policy.max_n}.", "n_too_large", "n")
    if body.n > 1 and body.temperature == 0.0:
        raise bad_request("n > 1 needs temperature > 0: greedy decoding gives n identical choices.",
                          "invalid_value", "n")
    if policy.max_prompt_tokens is not None and num_prompt > policy.max_prompt_tokens:
        raise bad_request(f"The prompt has {num_prompt} tokens; your limit is {policy.max_prompt_tokens}.",
                          "prompt_too_long", "prompt")
    ceiling = token_ceiling(policy)
    if ceiling is not None and num_prompt + body.n > ceiling.tokens:
        raise bad_request(f"The prompt has {num_prompt} tokens; your {ceiling.name} is {ceiling.tokens} tokens, "
                          "prompt and output together: this request can never be admitted. Shorten the prompt.",
                          "exceeds_token_limit", endpoint.prompt_param)
    context = model.info.max_model_len
    if num_prompt >= context:
        raise bad_request(f"The prompt has {num_prompt} tokens; the model's context is {context} tokens.",
                          "context_length_exceeded", endpoint.prompt_param)
    requested = endpoint.requested_max_tokens(body)
    param = "max_tokens"
    if requested is None:
        fitting = (ceiling.tokens - num_prompt) // body.n if ceiling is not None else policy.max_tokens_cap
        return min(policy.max_tokens_cap, context - num_prompt, fitting)
    if requested > policy.max_tokens_cap:
        raise bad_request(f"max_tokens={requested} exceeds your limit of {policy.max_tokens_cap}.",
                          "max_tokens_too_large", param)
    if num_prompt + requested > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens; the prompt has {num_prompt} and "
            f"max_tokens is {requested} ({num_prompt + requested} in all). Lower max_tokens or the prompt.",
            "context_length_exceeded", param)
    if ceiling is not None and num_prompt + requested * body.n > ceiling.tokens:
        raise bad_request(
            f"The prompt ({num_prompt} tokens) and max_tokens={requested} × n={body.n} need "
            f"{num_prompt + requested * body.n} tokens; your {ceiling.name} is {ceiling.tokens}: this request can "
            "never be admitted. Lower max_tokens.", "exceeds_token_limit", param)
    return requested


class TokenCeiling(NamedTuple):
    tokens: int
    name: str  # the limit, as the error names it


def token_ceiling(policy: TenantPolicy) -> TokenCeiling | None:
    """The most tokens one request can reserve and ever be admitted: the smaller of the tenant's
    tokens-per-minute limit and its budget (admission reserves prompt + max_tokens × n against both)."""
    limits = []
    if policy.tokens_per_minute is not None:
        limits.append(TokenCeiling(policy.tokens_per_minute, "tokens-per-minute limit"))
    if policy.token_budget is not None:
        limits.append(TokenCeiling(policy.token_budget, f"token budget per {policy.budget_period}"))
    return min(limits) if limits else None
