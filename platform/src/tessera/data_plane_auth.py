"""The credential on every call to an engine replica (issue #15; docs/security.md, "The data plane").

A release has one data-plane key: random bytes in a file that the gateway, the KV-eviction controller and the
engine replicas read (``TESSERA_DATA_PLANE_KEY_FILE``; the chart mounts it from a Secret, ``tessera up``
generates ``.tessera/data-plane.key``). A tenant never sees it: it is not in any response, span or log line.

A caller signs each call::

    X-Tessera-Signature: t=<unix seconds>,n=<nonce>,v1=<hex MAC>
    MAC = HMAC-SHA256(key, "<t>\\n<n>\\n<METHOD>\\n<target>\\n<hex sha256(body)>")

``target`` is the path as sent (with ``?query`` when there is one); the nonce is 16 random hex digits, so
two identical calls (the controller aborting the same request twice) still differ. The replica checks the
header and its time before it reads the body (``check_head``), then the MAC over the body it read, in
constant time, before it parses anything (``ReplicaGuard.check_body``). A signed call can be replayed only by
someone who saw it, only within ``max_skew_s``, and only once for a call that changes state (``ReplayCache``).

NOTE: why a MAC and not the key itself as a bearer token: the pod network carries these calls in clear
HTTP, so a bearer seen once is the key forever; a signature seen once is one request, for seconds. Why not
mTLS: a certificate authority, rotation and a TLS handshake per pooled connection for what a 32-byte secret
and a microsecond MAC give (the gateway's cost is measured by bench/bench_data_plane_auth.py).
Prometheus cannot sign, so ``/metrics`` also takes a separate read-only bearer token (``metrics_token``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.asgi import BodyTooLarge, ClientDisconnected, Receive, Scope, Send, read_body, respond_json

if TYPE_CHECKING:
    from tessera.settings import TesseraSettings

SIGNATURE_HEADER = "x-tessera-signature"
MIN_KEY_CHARS = 32  # the chart generates 64 alphanumerics, `tessera up` 64 hex digits
DEFAULT_MAX_SKEW_S = 30.0
_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


class DataPlaneKeyError(ValueError):
    """The data-plane key is not configured, or its file cannot be used; the message says which and how."""


def read_secret_file(path: Path, what: str, setting: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace dropped), at least MIN_KEY_CHARS long."""
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise DataPlaneKeyError(f"{setting}={path}: cannot read the {what}: {exc.strerror}") from None
    if len(secret) < MIN_KEY_CHARS:
        raise DataPlaneKeyError(f"{setting}={path}: the {what} is shorter than {MIN_KEY_CHARS} characters")
    return secret


def ensure_key_file(path: Path) -> Path:
    """``path`` holding a key: made once (64 hex digits, mode 0600), reused as it is afterwards. The key is
    written to a file of its own first and linked into place, so a process racing this one (two test workers,
    two `tessera up`) finds either no file or the whole key, never a part of one."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        os.link(draft, path)
    except FileExistsError:
        pass  # another process made it first: theirs is the key
    finally:
        draft.unlink()
    return path


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest() if body else _EMPTY_DIGEST


def _mac(key_mac: hmac.HMAC, timestamp: int, nonce: str, method: str, target: str, digest: str) -> str:
    mac = key_mac.copy()
    mac.update(f"{timestamp}\n{nonce}\n{method}\n{target}\n{digest}".encode())
    return mac.hexdigest()


class Signer:
    """Signs calls to replicas (the gateway, the controller, tests). The keyed HMAC state is made once and
    copied per call: the per-call cost is the body's SHA-256 and two short hash blocks."""

    __slots__ = ("_key_mac",)

    def __init__(self, key: bytes) -> None:
        self._key_mac = hmac.new(key, digestmod=hashlib.sha256)

    def sign(self, method: str, target: str, body: bytes = b"", now_s: float | None = None) -> str:
        """The ``X-Tessera-Signature`` value for one call."""
        timestamp = int(time.time() if now_s is None else now_s)
        nonce = os.urandom(8).hex()
        return f"t={timestamp},n={nonce},v1={_mac(self._key_mac, timestamp, nonce, method, target, body_digest(body))}"

    def headers(self, method: str, target: str, body: bytes = b"") -> dict[str, str]:
        return {SIGNATURE_HEADER: self.sign(method, target, body)}


@dataclass(frozen=True, slots=True)
class SignedHead:
    """A signature header that parsed and is recent: what is left to check needs the body."""

    timestamp: int
    nonce: str
    mac: str


def check_head(value: str | None, now_s: float, max_skew_s: float) -> SignedHead | str:
    """The header's parts, or why the call is refused (no header, malformed, too old or too new)."""
    if not value:
        return f"missing {SIGNATURE_HEADER} header: calls to an engine replica are signed with the data-plane key"
    fields = dict(part.partition("=")[::2] for part in value.split(","))
    timestamp, nonce, mac = fields.get("t", ""), fields.get("n", ""), fields.get("v1", "")
    if not timestamp.isdigit() or not 8 <= len(nonce) <= 64 or len(mac) != 64:
        return (f"malformed {SIGNATURE_HEADER} header: expected t=<unix seconds>,n=<nonce, 8-64 characters>,"
                "v1=<64 hex digits>")
    if abs(now_s - int(timestamp)) > max_skew_s:
        return f"signature time is more than {max_skew_s:g} s from the replica's clock"
    return SignedHead(int(timestamp), nonce, mac)


def signature_matches(key_mac: hmac.HMAC, head: SignedHead, method: str, target: str, body: bytes) -> bool:
    expected = _mac(key_mac, head.timestamp, head.nonce, method, target, body_digest(body))
    return hmac.compare_digest(expected, head.mac)


class ReplayCache:
    """MACs of state-changing calls accepted within the skew window: the same signed call twice is refused.
    Entries leave once their timestamp is out of the window, so it holds at most a window's calls."""

    __slots__ = ("_seen", "_window_s")

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._seen: OrderedDict[str, int] = OrderedDict()

    def first_use(self, head: SignedHead, now_s: float) -> bool:
        seen = self._seen
        while seen:
            mac, timestamp = next(iter(seen.items()))
            if timestamp >= now_s - self._window_s:
                break
            del seen[mac]
        if head.mac in seen:
            return False
        # NOTE: trimming stops at the first recent entry; timestamps arrive nearly in order, so an old one
        # behind it stays at most a little longer.
        seen[head.mac] = head.timestamp
        return True


class ReplicaGuard:
    """The replica side: what ``engine/endpoints.py`` and the simulated replica check before any work."""

    def __init__(self, key: bytes, metrics_token: bytes | None = None,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
        self._key_mac = hmac.new(key, digestmod=hashlib.sha256)
        self._metrics_bearer = b"Bearer " + metrics_token if metrics_token else None
        self.max_skew_s = max_skew_s
        self._replays = ReplayCache(max_skew_s)

    def check_head(self, headers: dict[str, str]) -> SignedHead | str:
        return check_head(headers.get(SIGNATURE_HEADER), time.time(), self.max_skew_s)

    def check_body(self, head: SignedHead, method: str, target: str, body: bytes) -> str | None:
        """None when the MAC covers this call (a state-changing one for the first time), else why not."""
        if not signature_matches(self._key_mac, head, method, target, body):
            return "signature does not match this call (method, path, body or key differ)"
        if method != "GET" and not self._replays.first_use(head, time.time()):
            return "signature was used already: every call is signed afresh"
        return None

    def is_metrics_scraper(self, headers: dict[str, str]) -> bool:
        """The read-only scrape token (Prometheus cannot sign); /metrics only."""
        given = headers.get("authorization")
        return (self._metrics_bearer is not None and given is not None
                and hmac.compare_digest(given.encode(), self._metrics_bearer))


UNAUTHORIZED_HEADERS = [(b"www-authenticate", b'Tessera-Signature header="x-tessera-signature"')]


async def authenticated_body(guard: ReplicaGuard, scope: Scope, receive: Receive, send: Send,
                             headers: dict[str, str], max_body_bytes: int) -> bytes | None:
    """The body of a call signed with the data-plane key, or None once a 401 (or 413) is sent or the client
    left. The header and its time are checked before the body is read, the MAC over the body before anything
    parses it. A GET's body is not read: it is signed as empty."""
    head = guard.check_head(headers)
    if isinstance(head, str):
        await respond_json(send, 401, {"error": head}, UNAUTHORIZED_HEADERS)
        return None
    body = b""
    if scope["method"] != "GET":
        try:
            body = await read_body(receive, max_body_bytes, headers.get("content-length"))
        except ClientDisconnected:
            return None
        except BodyTooLarge as exc:
            await respond_json(send, 413, {"error": str(exc)})
            return None
    refused = guard.check_body(head, scope["method"], request_target(scope), body)
    if refused is not None:
        await respond_json(send, 401, {"error": refused}, UNAUTHORIZED_HEADERS)
        return None
    return body


def request_target(scope: Scope) -> str:
    """The target a caller signed: the raw path, and ``?query`` when there is one."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(scope["path"])
    query = scope.get("query_string") or b""
    assert isinstance(query, bytes)
    return f"{path}?{query.decode('latin-1')}" if query else path


def _key_file(settings: TesseraSettings, who: str) -> Path:
    if settings.data_plane_key_file is None:
        raise DataPlaneKeyError(
            f"TESSERA_DATA_PLANE_KEY_FILE is not set: {who} needs the release's data-plane key (engine replicas "
            "accept only calls signed with it). `tessera up` generates one; the chart mounts it from a Secret.")
    return settings.data_plane_key_file


def signer_from_settings(settings: TesseraSettings, who: str = "a caller of engine replicas") -> Signer:
    """The signer of the gateway, the controller and the CLI; DataPlaneKeyError when there is no key."""
    return Signer(read_secret_file(_key_file(settings, who), "data-plane key", "TESSERA_DATA_PLANE_KEY_FILE"))


def guard_from_settings(settings: TesseraSettings, who: str = "an engine replica") -> ReplicaGuard:
    """The replica's guard; DataPlaneKeyError when there is no key: a replica never serves unauthenticated."""
    key = read_secret_file(_key_file(settings, who), "data-plane key", "TESSERA_DATA_PLANE_KEY_FILE")
    token = (read_secret_file(settings.metrics_token_file, "metrics token", "TESSERA_METRICS_TOKEN_FILE")
             if settings.metrics_token_file is not None else None)
    return ReplicaGuard(key, token, settings.data_plane_max_skew_s)
