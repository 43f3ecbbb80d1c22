from __future__ import annotations

from tessera.tenancy.keys import hash_key, key_matches, new_key, parse_key_id


def test_new_key_shape_and_hash() -> None:
    issued = new_key()
    assert issued.plaintext.startswith(f"tsk-{issued.key_id}-")
    assert issued.sha256 == hash_key(issued.plaintext)
    assert len(issued.sha256) == 64 and issued.plaintext not in issued.sha256


def test_keys_are_unique() -> None:
    assert len({new_key().plaintext for _ in range(200)}) == 200


def test_parse_key_id_rejects_malformed_keys() -> None:
    issued = new_key()
    assert parse_key_id(issued.plaintext) == issued.key_id
    for bad in ["", "tsk", "tsk--x", "sk-abcdefabcdef-x", "tsk-ABCDEFABCDEF-x", "tsk-abc-x", "tsk-abcdefabcdef-"]:
        assert parse_key_id(bad) is None, bad


def test_key_matches_only_the_exact_key() -> None:
    issued = new_key()
    assert key_matches(issued.plaintext, issued.sha256)
    assert not key_matches(issued.plaintext + "x", issued.sha256)
    assert not key_matches(issued.plaintext[:-1], issued.sha256)
