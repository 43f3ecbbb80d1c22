"""OpenAI-style errors: ``{"error": {"message", "type", "code", "param"}}`` with the right status."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    code: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code, "param": param}})


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, code, param)


def unauthorized(message: str = "Invalid API key: pass 'Authorization: Bearer <key>' with a key issued "
                 "by 'tessera keys issue'.") -> APIError:
    return APIError(401, message, "invalid_api_key")
