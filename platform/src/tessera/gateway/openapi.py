"""The gateway's OpenAPI document, built from the same pydantic models that validate requests."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tessera.gateway.schemas import ChatCompletionRequest, CompletionRequest

_ERROR = {"$ref": "#/components/schemas/Error"}


def _responses(success: str) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": success}}
    for code, text in [("400", "invalid request"), ("401", "missing or invalid key"), ("403", "not allowed"),
                       ("404", "unknown model"), ("413", "body too large"), ("429", "rate limited"),
                       ("503", "unavailable")]:
        out[code] = {"description": text, "content": {"application/json": {"schema": _ERROR}}}
    return out


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    def schema(model: type) -> dict[str, Any]:
        return model.model_json_schema(ref_template="#/components/schemas/{model}")  # type: ignore[attr-defined,no-any-return]

    components: dict[str, Any] = {}
    for model in (CompletionRequest, ChatCompletionRequest):
        body = schema(model)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    components["Error"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"},
            "param": {"type": ["string", "null"]}}}},
    }

    def post(model: str, summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "security": [{"bearer": []}],
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": {"$ref": f"#/components/schemas/{model}"}}}},
                         "responses": _responses("completion (JSON, or SSE when stream=true)")}}

    return {
        "openapi": "3.1.0",  # pydantic writes JSON Schema 2020-12 (numeric exclusiveMinimum, "null" types)
        "info": {"title": "Tessera gateway", "version": "1"},
        "paths": {
            "/v1/completions": post("CompletionRequest", "Text completion"),
            "/v1/chat/completions": post("ChatCompletionRequest", "Chat completion"),
            "/v1/models": {"get": {"summary": "Models this key may use", "security": [{"bearer": []}],
                                   "responses": _responses("model list")}},
            "/v1/models/{model}/tokenizer": {
                "get": {"summary": "The model's tokenizer (tokenizer.json), chat template and context length",
                        "security": [{"bearer": []}],
                        "parameters": [{"name": "model", "in": "path", "required": True,
                                        "schema": {"type": "string"}}],
                        "responses": _responses("tokenizer document")}},
            "/v1/usage": {"get": {"summary": "This key's tenant's usage in the current period",
                                  "security": [{"bearer": []}],
                                  "parameters": [{"name": "period", "in": "query", "required": False,
                                                  "schema": {"type": "string", "enum": ["hour", "day", "month"]}}],
                                  "responses": _responses("usage")}},
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
