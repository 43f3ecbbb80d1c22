"""Ids unique across processes and pods without a system call per id: a random prefix drawn once, then a
counter. Admission's lease ids and the gateway's response and request ids are made this way; ``uuid4`` or
``secrets`` per id would cost a ``getrandom`` call on every request. Labels and keys, never secrets: the
counter is guessable, so no id made here may authorize anything."""

from __future__ import annotations

import itertools
import secrets

# 8 random bytes: two processes share a prefix with chance ~n^2 / 2^65 over n processes.
PREFIX_BYTES = 8


class UniqueIds:
    """One source of ids: ``next(prefix)`` is ``prefix``, this source's random part and its next count (hex)."""

    __slots__ = ("_count", "_random")

    def __init__(self) -> None:
        self._random = secrets.token_hex(PREFIX_BYTES)
        self._count = itertools.count()

    def next(self, prefix: str = "") -> str:
        return f"{prefix}{self._random}{next(self._count):x}"
