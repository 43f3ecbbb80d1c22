"""The raw-ASGI toolkit shared by every Tessera HTTP server (gateway, admin API, engine host).

Raw ASGI rather than a framework because these are the hot paths of every token; this module is the one
place that knows the message shapes, so the servers read as request handling, not protocol plumbing.
It imports nothing from Tessera: any package may use it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_CONTENT = (b"content-type", b"application/json")


class BodyTooLarge(Exception):
    """The request body exceeds the server's limit; ``declared`` is the Content-Length when it said so."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        self.limit = limit
        self.declared = declared
        size = f"of {declared} bytes " if declared is not None else ""
        super().__init__(f"Request body {size}exceeds the limit of {limit} bytes.")


class ClientDisconnected(Exception):
    """The client went away before its request body was complete."""

    def __init__(self) -> None:
        super().__init__("Client disconnected while sending the body.")


def header_map(scope: Scope) -> dict[str, str]:
    """Request headers as a dict of lower-case names (uvicorn already lower-cases them)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}


async def read_body(receive: Receive, limit: int, content_length: str | None = None) -> bytes:
    """The whole request body, refused as soon as it is known to exceed ``limit`` (from Content-Length
    before reading, else while reading): a hostile client cannot make the server buffer more."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise BodyTooLarge(limit, int(content_length))
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client closes its connection (call it once the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def encode_headers(extra: dict[str, str] | None) -> Headers:
    return [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]


async def send_response(send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, status: int, payload: Any, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A complete JSON response (orjson-encoded)."""
    await send_response(send, status, orjson.dumps(payload), [JSON_CONTENT, *headers])


async def respond_raw_json(send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A complete response whose JSON body is already encoded (cached documents, error bodies)."""
    await send_response(send, status, body, [JSON_CONTENT, *headers])
