"""A client that speaks HTTP/1.1 badly on purpose, over a plain socket: what httpx refuses to send (a header
of megabytes, CRLF or raw bytes in a value, thousands of headers, a head that never ends) and what it hides
(when the server answered, whether it closed). For the adversarial tests and the flood benchmark."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson


@dataclass
class RawAnswer:
    """What came back: ``status`` None when the server closed without a response."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    closed: bool = False

    @property
    def error_code(self) -> str | None:
        try:
            return str(orjson.loads(self.body)["error"]["code"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None


def head(method: str = "GET", target: str = "/v1/models", headers: Iterable[tuple[bytes, bytes]] = (),
         host: bytes = b"gateway") -> bytes:
    """A request head from raw bytes: nothing is checked or escaped."""
    lines = [method.encode() + b" " + target.encode() + b" HTTP/1.1", b"host: " + host]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def connect(port: int, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_all(sock: socket.socket, pieces: Iterable[bytes]) -> int:
    """Sends the pieces until the server stops reading (it answered and closed); returns the bytes sent."""
    sent = 0
    for piece in pieces:
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(piece)
    return sent


def read_answer(sock: socket.socket, deadline_s: float = 10.0, head_request: bool = False) -> RawAnswer:
    """One response (by Content-Length or chunked; none for a HEAD request; interim 1xx skipped), or the close;
    ``TimeoutError`` past ``deadline_s``: the server neither answered nor closed (a hang)."""
    buf = b""
    end = time.monotonic() + deadline_s
    closed = False

    def more() -> bool:
        nonlocal buf, closed
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise TimeoutError("the server neither answered nor closed the connection") from None
        if not chunk:
            closed = True
            return False
        buf += chunk
        return True

    while True:
        while b"\r\n\r\n" not in buf:
            if not more():
                return RawAnswer(None, closed=True)
        raw_head, _, buf = buf.partition(b"\r\n\r\n")
        status_line, *lines = raw_head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ")[1])
        if not 100 <= status < 200:
            break
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    body = b""
    if head_request:
        pass
    elif "content-length" in headers:
        while len(buf) < int(headers["content-length"]) and more():
            pass
        body = buf[:int(headers["content-length"])]
    elif headers.get("transfer-encoding") == "chunked":
        while not buf.endswith(b"0\r\n\r\n") and more():
            pass
        body = _dechunk(buf)
    return RawAnswer(status, headers, body, closed)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2:]
    return out


def exchange(port: int, pieces: Iterable[bytes], deadline_s: float = 10.0, head_request: bool = False) -> RawAnswer:
    """A new connection, the pieces sent (as far as the server reads them), the answer read."""
    with connect(port, deadline_s) as sock:
        send_all(sock, pieces)
        return read_answer(sock, deadline_s, head_request)


def wait_closed(sock: socket.socket, deadline_s: float) -> bytes:
    """Everything the server sends until it closes the connection; ``TimeoutError`` if it has not by then."""
    end = time.monotonic() + deadline_s
    got = b""
    while True:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        except TimeoutError:
            raise TimeoutError(f"still open after {deadline_s} s; got {got[:200]!r}") from None
        if not chunk:
            return got
        got += chunk
