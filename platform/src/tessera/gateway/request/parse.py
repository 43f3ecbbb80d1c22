"""Phase ``parse``: the request body, read within ``max_body_bytes`` (413), decoded and validated against
the endpoint's schema (400 naming the first invalid field, or an OpenAI field Tessera does not serve)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from pydantic import ValidationError

from tessera.gateway.errors import bad_request, invalid_field
from tessera.gateway.responses import request_body
from tessera.gateway.schemas import unsupported_field

if TYPE_CHECKING:
    from tessera.gateway.request.context import RequestContext
    from tessera.gateway.request.endpoint import Endpoint, OpenAIRequest


async def read(ctx: RequestContext, max_body_bytes: int) -> None:
    """Reads the raw body first: an oversized body is refused before any other work (and before auth)."""
    ctx.raw = await request_body(ctx.receive, ctx.headers, max_body_bytes)


def parse(ctx: RequestContext) -> None:
    ctx.body = parse_body(ctx.endpoint, ctx.raw)
    ctx.notes.attributes["gen_ai.request.model"] = ctx.body.model


def parse_body(endpoint: Endpoint, raw: bytes) -> OpenAIRequest:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object.", "invalid_json")
    unsupported = unsupported_field(data)
    if unsupported is not None:
        raise bad_request(f"'{unsupported}' is not supported by this gateway; remove it from the request (the "
                          "answer would not contain what it asks for).", "unsupported_field", unsupported)
    try:
        return endpoint.parse(data)
    except ValidationError as exc:
        raise invalid_field(exc.errors()) from None  # type: ignore[arg-type]
