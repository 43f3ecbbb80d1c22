"""The requests an engine replica is running, as the KV-eviction controller sees them (``GET /requests``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from tessera.engine.protocol import RequestStats


@dataclass(slots=True)
class InFlight:
    """One running request: who sent it and at what priority, and why it was aborted if it was."""

    request_id: str
    tenant: str
    priority: int
    started_ts: float
    abort_reason: str | None = None
    # W3C traceparent of this request's engine.generate span: the KV-eviction controller links its
    # eviction and action spans to the requests they affect (and parents an abort under it).
    traceparent: str = ""
    # The request's counters while it runs (generation.py), for its usage record when it ends.
    stats: RequestStats | None = None
    # Prompt tokens the gateway expects it to prefill, until its first token is out (generation.py sets 0).
    prefill_tokens: int = 0


# What ``GET /requests`` lists of an entry (not its counters).
_LISTED = tuple(f.name for f in fields(InFlight) if f.name not in ("stats", "prefill_tokens"))


class InFlightRequests:
    """Request id -> ``InFlight``, for the requests between their first byte out and their last.

    Only the host's event loop touches it (the stream that adds and removes an entry, and the routes that
    read it), so it needs no lock. ``on_end`` gets every entry that ends (the replica's usage record).
    """

    def __init__(self, on_end: Callable[[InFlight], None] | None = None) -> None:
        self._entries: dict[str, InFlight] = {}
        self.on_end = on_end

    def start(self, request_id: str, tenant: str, priority: int, prefill_tokens: int = 0) -> InFlight:
        entry = InFlight(request_id, tenant, priority, time.time(), prefill_tokens=prefill_tokens)
        self._entries[request_id] = entry
        return entry

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill before the requests' first tokens, as the gateway declared them
        (read once a heartbeat: a sum over the requests running here)."""
        return sum(entry.prefill_tokens for entry in self._entries.values())

    def finish(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None and self.on_end is not None:
            self.on_end(entry)

    def get(self, request_id: str) -> InFlight | None:
        return self._entries.get(request_id)

    def listing(self) -> list[dict[str, Any]]:
        """The ``GET /requests`` body."""
        return [{name: getattr(entry, name) for name in _LISTED} for entry in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)
