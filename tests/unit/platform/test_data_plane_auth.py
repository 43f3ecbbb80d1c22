"""The data-plane signature as pure functions: a call verifies only with its own method, target, body, time
and key; the header and its time are judged before the body; a state-changing call verifies once."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

import pytest

from tessera.data_plane_auth import (
    DataPlaneKeyError,
    ReplayCache,
    ReplicaGuard,
    SignedHead,
    Signer,
    check_head,
    ensure_key_file,
    guard_from_settings,
    read_secret_file,
    request_target,
    signature_matches,
    signer_from_settings,
)
from tessera.settings import TesseraSettings

KEY = b"0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000.0
BODY = b'{"request_id":"t/1","prompt_token_ids":[1,2,3],"max_tokens":4,"priority":0}'


def verifies(header: str, method: str = "POST", target: str = "/generate", body: bytes = BODY,
             key: bytes = KEY, now_s: float = NOW, max_skew_s: float = 30.0) -> bool:
    head = check_head(header, now_s, max_skew_s)
    return isinstance(head, SignedHead) and signature_matches(hmac.new(key, digestmod=hashlib.sha256), head,
                                                              method, target, body)


def test_a_signed_call_verifies_and_two_identical_calls_differ() -> None:
    first, second = (Signer(KEY).sign("POST", "/generate", BODY, now_s=NOW) for _ in range(2))
    assert verifies(first) and verifies(second) and first != second


def test_the_nonce_is_covered() -> None:
    header = Signer(KEY).sign("POST", "/generate", BODY, now_s=NOW)
    fields = dict(part.split("=") for part in header.split(","))
    assert not verifies(f"t={fields['t']},n={'0' * 16},v1={fields['v1']}")


@pytest.mark.parametrize(("method", "target", "body", "key"), [
    ("POST", "/generate", BODY.replace(b'"priority":0', b'"priority":-1000'), KEY),  # tampered body
    ("POST", "/abort", BODY, KEY),  # another path
    ("GET", "/generate", BODY, KEY),  # another method
    ("POST", "/generate?x=1", BODY, KEY),  # another query
    ("POST", "/generate", BODY, b"another key of thirty-two chars!"),  # wrong key
])
def test_a_signature_covers_method_target_body_and_key(method: str, target: str, body: bytes, key: bytes) -> None:
    header = Signer(KEY).sign("POST", "/generate", BODY, now_s=NOW)
    assert not verifies(header, method, target, body, key)


@pytest.mark.parametrize("skew_s", [-31.0, 31.0, 3600.0])
def test_a_signature_too_far_from_the_clock_is_refused_before_the_body(skew_s: float) -> None:
    header = Signer(KEY).sign("POST", "/generate", BODY, now_s=NOW + skew_s)
    reason = check_head(header, NOW, 30.0)
    assert reason == "signature time is more than 30 s from the replica's clock"
    assert isinstance(check_head(Signer(KEY).sign("POST", "/generate", BODY, now_s=NOW + 29), NOW, 30.0),
                      SignedHead)


@pytest.mark.parametrize(("header", "says"), [
    (None, "missing x-tessera-signature header"),
    ("", "missing x-tessera-signature header"),
    ("t=1800000000", "malformed x-tessera-signature header"),
    ("t=now,n=0123456789abcdef,v1=" + "0" * 64, "malformed x-tessera-signature header"),
    ("t=1800000000,n=0123456789abcdef,v1=abc", "malformed x-tessera-signature header"),
    ("t=1800000000,v1=" + "0" * 64, "malformed x-tessera-signature header"),  # no nonce
    ("Bearer " + KEY.decode(), "malformed x-tessera-signature header"),
])
def test_a_missing_or_malformed_header_says_so_and_nothing_of_the_key(header: str | None, says: str) -> None:
    reason = check_head(header, NOW, 30.0)
    assert isinstance(reason, str) and reason.startswith(says) and KEY.decode() not in reason


def test_a_state_changing_call_verifies_once_and_the_cache_forgets_what_the_clock_refuses() -> None:
    cache = ReplayCache(window_s=30.0)
    first = SignedHead(int(NOW), "n1", "a" * 64)
    assert cache.first_use(first, NOW)
    assert not cache.first_use(first, NOW + 1)
    assert cache.first_use(SignedHead(int(NOW), "n2", "b" * 64), NOW + 1)
    # Once out of the window the entry goes (a replay of it is refused by check_head's clock test instead).
    assert cache.first_use(SignedHead(int(NOW) + 40, "n3", "c" * 64), NOW + 40)
    assert list(cache._seen) == ["c" * 64]


def test_the_guard_refuses_a_replayed_post_but_not_a_repeated_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("time.time", lambda: NOW)
    guard = ReplicaGuard(KEY)
    post = guard.check_head({"x-tessera-signature": Signer(KEY).sign("POST", "/abort", b"{}", now_s=NOW)})
    assert isinstance(post, SignedHead)
    assert guard.check_body(post, "POST", "/abort", b"{}") is None
    assert guard.check_body(post, "POST", "/abort", b"{}") == "signature was used already: every call is signed afresh"
    get = guard.check_head({"x-tessera-signature": Signer(KEY).sign("GET", "/requests", now_s=NOW)})
    assert isinstance(get, SignedHead)
    assert guard.check_body(get, "GET", "/requests", b"") is None
    assert guard.check_body(get, "GET", "/requests", b"") is None
    assert guard.check_body(get, "GET", "/stats", b"") == (
        "signature does not match this call (method, path, body or key differ)")


def test_the_metrics_token_opens_metrics_only_as_a_bearer() -> None:
    guard = ReplicaGuard(KEY, b"m" * 32)
    assert guard.is_metrics_scraper({"authorization": "Bearer " + "m" * 32})
    assert not guard.is_metrics_scraper({"authorization": "Bearer " + "m" * 31})
    assert not guard.is_metrics_scraper({})
    assert not ReplicaGuard(KEY).is_metrics_scraper({"authorization": "Bearer "})


def test_the_signed_target_is_the_raw_path_and_query() -> None:
    assert request_target({"path": "/generate", "raw_path": b"/generate", "query_string": b""}) == "/generate"
    assert request_target({"path": "/a b", "raw_path": b"/a%20b", "query_string": b"x=1"}) == "/a%20b?x=1"
    assert request_target({"path": "/stats"}) == "/stats"


def test_the_key_file_is_made_once_private_and_reused(tmp_path: Path) -> None:
    path = ensure_key_file(tmp_path / "state" / "data-plane.key")
    first = path.read_bytes()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(first.strip()) == 64
    assert ensure_key_file(path).read_bytes() == first


def test_no_key_or_a_short_one_stops_every_side(tmp_path: Path) -> None:
    unset = TesseraSettings(data_plane_key_file=None)
    with pytest.raises(DataPlaneKeyError, match="TESSERA_DATA_PLANE_KEY_FILE is not set: an engine replica"):
        guard_from_settings(unset)
    with pytest.raises(DataPlaneKeyError, match="a gateway needs"):
        signer_from_settings(unset, "a gateway")
    short = tmp_path / "short.key"
    short.write_text("too short\n")
    with pytest.raises(DataPlaneKeyError, match="shorter than 32 characters"):
        read_secret_file(short, "data-plane key", "TESSERA_DATA_PLANE_KEY_FILE")
    with pytest.raises(DataPlaneKeyError, match="cannot read the data-plane key"):
        guard_from_settings(TesseraSettings(data_plane_key_file=tmp_path / "absent.key"))
