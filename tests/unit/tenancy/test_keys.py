"""API keys (tessera/tenancy/keys.py) and bearer headers: their shape, and the edge cases that must be refused
before Redis is asked."""

from __future__ import annotations

import pytest

from tessera.gateway.auth import bearer_key
from tessera.tenancy.keys import KEY_ID_HEX_CHARS, hash_key, key_matches, new_key, parse_key_id


def test_secret_may_contain_dashes() -> None:
    key_id = "0123456789ab"
    assert parse_key_id(f"tsk-{key_id}-abc-def--") == key_id


def test_keys_are_unique() -> None:
    assert len({new_key().plaintext for _ in range(200)}) == 200


@pytest.mark.parametrize("key", [
    "",
    "tsk",
    "tsk--x",                        # no id
    "tsk-0123456789ab",              # no secret part
    "tsk-0123456789ab-",             # empty secret
    "tsk-0123456789abc-secret",      # id too long
    "tsk-0123456789a-secret",        # id too short
    "TSK-0123456789ab-secret",       # prefix is case sensitive
    "tsk-0123456789aG-secret",       # not hex
    "tsk-０１２３４５６７８９ab-secret",  # full-width digits are not hex
    " tsk-0123456789ab-secret",      # leading space
    "sk-0123456789ab-secret",
])
def test_malformed_keys_have_no_id(key: str) -> None:
    assert parse_key_id(key) is None


def test_issued_key_ids_have_the_documented_length() -> None:
    for _ in range(50):
        issued = new_key()
        assert len(issued.key_id) == KEY_ID_HEX_CHARS
        assert parse_key_id(issued.plaintext) == issued.key_id
        assert issued.display_prefix == f"tsk-{issued.key_id}-…"
        assert issued.plaintext.split("-", 2)[2] not in issued.display_prefix


def test_hash_is_sha256_hex_and_never_the_key() -> None:
    issued = new_key()
    assert len(issued.sha256) == 64 and int(issued.sha256, 16) >= 0
    assert hash_key(issued.plaintext) == issued.sha256
    assert issued.plaintext not in issued.sha256 and issued.sha256 not in issued.plaintext


def test_same_id_other_secret_does_not_match() -> None:
    issued = new_key()
    forged = f"tsk-{issued.key_id}-{'A' * 43}"
    assert parse_key_id(forged) == issued.key_id
    assert not key_matches(forged, issued.sha256)


def test_key_matches_only_the_exact_key() -> None:
    issued = new_key()
    assert key_matches(issued.plaintext, issued.sha256)
    assert not key_matches(issued.plaintext + "x", issued.sha256)
    assert not key_matches(issued.plaintext[:-1], issued.sha256)


@pytest.mark.parametrize("header, key", [
    ("Bearer tsk-abc", "tsk-abc"),
    ("bearer tsk-abc", "tsk-abc"),
    ("Bearer   tsk-abc  ", "tsk-abc"),
    ("Bearer", None),
    ("Bearer ", None),
    ("Basic dXNlcjpwYXNz", None),
    ("tsk-abc", None),
    ("", None),
    (None, None),
])
def test_bearer_header_parsing(header: str | None, key: str | None) -> None:
    assert bearer_key(header) == key
