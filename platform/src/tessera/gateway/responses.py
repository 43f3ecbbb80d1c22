"""The gateway's complete (non-streamed) responses on ``tessera.asgi``: every one carries the request id,
and an ``APIError`` becomes the OpenAI-style error body with its status and headers."""

from __future__ import annotations

from typing import Any

from tessera.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Send,
    encode_headers,
    read_body,
    respond_json,
    respond_raw_json,
)
from tessera.gateway.errors import APIError, body_error


async def respond(send: Send, status: int, payload: Any, request_id: str,
                  extra_headers: dict[str, str] | None = None) -> None:
    await respond_json(send, status, payload, [(b"x-request-id", request_id.encode()), *encode_headers(extra_headers)])


async def respond_error(send: Send, err: APIError, request_id: str) -> None:
    try:
        await respond_raw_json(send, err.status, err.body(),
                               [(b"x-request-id", request_id.encode()), *encode_headers(err.headers)])
    except RuntimeError:
        # The response already started (mid-stream failure): the stream's own error event was sent.
        pass


async def request_body(receive: Receive, headers: dict[str, str], limit_bytes: int) -> bytes:
    """The request body, or the ``APIError`` (413, or 400 for a client that left) of ``asgi.read_body``."""
    try:
        return await read_body(receive, limit_bytes, headers.get("content-length"))
    except (BodyTooLarge, ClientDisconnected) as exc:
        raise body_error(exc) from None
