"""The request path's one answer to "Redis did not answer" (``errors.STORE_ERRORS``).

Fail closed (the default): the request gets 503 ``store_unavailable``. Fail open (``TESSERA_REDIS_FAIL_OPEN``,
the operator's explicit choice to keep serving through a Redis outage): a read serves what this process last
read for the same key (a model, a route), and admission admits without Redis (``admit_without_store``);
what this process never read still gets the 503. Reads a request can do without (the registry's plan before
admission, the pressure check) use ``optional`` and go on with a default in both modes.

Every phase that touches Redis goes through one ``FailOpen``; the key cache keeps its own last-known tenant
(``auth.Authenticator``) under the same setting.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from tessera.gateway.errors import STORE_ERRORS, store_unavailable

T = TypeVar("T")

# Last-known answers kept per kind; a deployment serves a handful of models, so this bound is never reached
# in practice (it only caps a client that asks for many model names).
MAX_KNOWN_PER_KIND = 10_000


class FailOpen:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._known: dict[str, dict[str, Any]] = {}

    async def read(self, kind: str, key: str, read: Awaitable[T]) -> T:
        """``read``'s answer (remembered when failing open, unless None), or the last known one of
        ``kind``/``key``."""
        try:
            value = await read
        except STORE_ERRORS as exc:
            return self.recall(kind, key, exc)  # type: ignore[no-any-return]
        if value is not None:
            self.remember(kind, key, value)
        return value

    def remember(self, kind: str, key: str, value: T) -> T:
        if self.enabled:
            known = self._known.setdefault(kind, {})
            if len(known) >= MAX_KNOWN_PER_KIND and key not in known:
                known.clear()
            known[key] = value
        return value

    def recall(self, kind: str, key: str, cause: BaseException) -> Any:
        """The last known answer when failing open; 503 ``store_unavailable`` otherwise."""
        known = self._known.get(kind) if self.enabled else None
        if known is not None and key in known:
            return known[key]
        raise store_unavailable() from cause

    def admit_without_store(self, cause: BaseException) -> None:
        """Returns when a request may be admitted without Redis (fail open); raises the 503 otherwise."""
        if not self.enabled:
            raise store_unavailable() from cause

    @staticmethod
    async def optional(read: Awaitable[T], default: T) -> T:
        """``read``'s answer, or ``default`` when Redis does not answer (in both modes)."""
        try:
            return await read
        except STORE_ERRORS:
            return default
