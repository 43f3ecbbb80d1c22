"""OpenAI-style errors: ``{"error": {"message", "type", "code", "param"}}`` with the right status."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tessera.asgi import BodyTooLarge, ClientDisconnected

# Redis did not answer (down, restarting, too slow): 503, or fail open where configured; never a 500.
STORE_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)

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
    # For the logs and the span only (engine ids, addresses, what an engine said), never for the client:
    # ``body()`` carries ``message``; ``str()``, which spans and logs record, carries both.
    detail: str = ""

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.message} [{self.detail}]" if self.detail else self.message

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code, "param": param}})


def store_unavailable() -> APIError:
    """Redis did not answer and the gateway fails closed (or has nothing last known to serve): 503."""
    return APIError(503, "The rate-limit store is unavailable; retry shortly.", "store_unavailable",
                    headers={"Retry-After": "1"})


def body_error(exc: BodyTooLarge | ClientDisconnected) -> APIError:
    """The HTTP answer to ``tessera.asgi.read_body``'s two failures."""
    if isinstance(exc, BodyTooLarge):
        return APIError(413, str(exc), "body_too_large")
    return APIError(400, str(exc), "client_disconnected")


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, code, param)


def unauthorized(message: str = "Invalid API key: pass 'Authorization: Bearer <key>' with a key issued "
                 "by 'tessera keys issue'.") -> APIError:
    return APIError(401, message, "invalid_api_key")


# Tags pydantic puts in an error location to say which member of a union failed; not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none", "dict", "list", "tuple", "set"})


def field_param(loc: tuple[int | str, ...]) -> str | None:
    """The OpenAI ``param`` of a pydantic error location: field names and list indexes
    (``messages[0].role``), without pydantic's union-member tags (``str``, ``list[int]``, ``function-after[…]``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def invalid_field(errors: list[dict[str, object]], code: str = "invalid_value") -> APIError:
    """A 400 naming the first invalid field of a pydantic ``ValidationError.errors()`` list."""
    first = errors[0]
    param = field_param(tuple(first.get("loc") or ()))  # type: ignore[arg-type]
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"Invalid request: {param}: {message}" if param else f"Invalid request: {message}", code,
                       param)
