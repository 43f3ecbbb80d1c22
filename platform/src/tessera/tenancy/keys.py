"""API keys: random, shown once, stored only as SHA-256 hashes.

Format: ``tsk-<key_id>-<secret>``. The key id (public, 12 hex chars) finds the stored record; the hash of
the whole key is then compared in constant time, so lookup timing reveals nothing about the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "tsk"
KEY_ID_HEX_CHARS = 12


@dataclass(frozen=True, slots=True)
class IssuedKey:
    key_id: str
    plaintext: str
    sha256: str

    @property
    def display_prefix(self) -> str:
        return f"{KEY_PREFIX}-{self.key_id}-…"


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def new_key() -> IssuedKey:
    key_id = secrets.token_hex(KEY_ID_HEX_CHARS // 2)
    plaintext = f"{KEY_PREFIX}-{key_id}-{secrets.token_urlsafe(32)}"
    return IssuedKey(key_id=key_id, plaintext=plaintext, sha256=hash_key(plaintext))


def is_key_id(text: str) -> bool:
    return len(text) == KEY_ID_HEX_CHARS and all(c in "0123456789abcdef" for c in text)


def parse_key_id(plaintext: str) -> str | None:
    """The key id of a well-formed key, or None (the caller answers 401 without touching Redis)."""
    parts = plaintext.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not is_key_id(parts[1]) or not parts[2]:
        return None
    return parts[1]


def key_matches(plaintext: str, stored_sha256: str) -> bool:
    return hmac.compare_digest(hash_key(plaintext), stored_sha256)
