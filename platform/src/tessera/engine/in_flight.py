"""The requests an engine replica is running, as the KV-eviction controller sees them (``GET /requests``)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


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


class InFlightRequests:
    """Request id -> ``InFlight``, for the requests between their first byte out and their last.

    Only the host's event loop touches it (the stream that adds and removes an entry, and the routes that
    read it), so it needs no lock.
    """

    def __init__(self) -> None:
        self._entries: dict[str, InFlight] = {}

    def start(self, request_id: str, tenant: str, priority: int) -> InFlight:
        entry = InFlight(request_id, tenant, priority, time.time())
        self._entries[request_id] = entry
        return entry

    def finish(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def get(self, request_id: str) -> InFlight | None:
        return self._entries.get(request_id)

    def listing(self) -> list[dict[str, Any]]:
        """The ``GET /requests`` body."""
        return [asdict(entry) for entry in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)
