"""A worker's view of its pod's table (pod_in_flight.py): every row's entries mirrored, and their sums per engine
kept as the rows change, so a routing decision reads sums instead of making them.

Why: every decision of a worker in a pod with several workers needs every row's counts, and the other workers'
counts change without telling it. Summing the rows at each decision cost O(entries in flight): at 1,000 engines
with a quarter of them in flight from two workers, ~500 entries, p99 201-248 µs with numpy against the 200 µs goal
(docs/routing.md, "The chart's default, two workers a pod"). Each row now also carries a log of its changes
(pod_in_flight.py), a decision applies the few records written since the last one (~3 a request another worker
sent or ended), and its cost no longer grows with the fleet.

A record is an entry's whole state after the change, not a difference: applying one twice, or over a copy of the
row that already holds it, changes nothing. That is what lets a reader copy a row while its writer changes it
(``replace_row``) and replay the log from before the copy to set right whatever the copy caught half-done.

Only engines whose count exceeds their heartbeat's load are in ``requests_above`` (requests sent since the
engine's last heartbeat counted them): below it no policy's view changes (every policy reads max(heartbeat, in
flight), policies.py), so the policy walks a handful, not every engine with a request in flight (~35 µs a decision
at 1,000 engines with 250 of them, docs/routing.md "Latest run"). The set is kept per change and found again when
a registry read brings new heartbeats (``use``). The sums are by the entries' 32-bit keys (``engine_key``); the
registry's engines (``PodEngines``, from the last read) map them to ids.

A one-worker gateway keeps the same view over a table of its own (``PodInFlight.private``, one row, no file), so
both count and decide by one code path.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from tessera.routing import pod_replay

INTS_PER_ENTRY = 4
WRAP = 1 << 32
HALF = 1 << 31


def engine_key(engine_id: str) -> int:
    """The 32-bit key an engine's entries carry (signed, as the row's ints are)."""
    return signed32(zlib.crc32(engine_id.encode()))


def signed32(value: int) -> int:
    """``value`` modulo 2**32, as a signed 32-bit int (what a row's ints hold)."""
    return (value + HALF) % WRAP - HALF


class PodTotals(NamedTuple):
    """The pod's view of its engines: requests in flight where they exceed the engine's heartbeat load, prompt
    tokens awaiting their first token, and seconds until those should be prefilled (engines with none left out
    of each). Read-only: the first two are the view's own dicts, current until the next change it applies."""

    requests: Mapping[str, int]
    tokens: Mapping[str, int]
    waits: Mapping[str, float]


class PodEngines:
    """A registry read's engines as the view needs them, built at the read (off the request path): entry key ->
    engine id, and each engine's heartbeat load. Two ids with one key (a CRC-32 collision) count as the
    later one, both ways."""

    __slots__ = ("by_key", "heartbeat")

    def __init__(self, engine_ids: Iterable[str], heartbeat_loads: Mapping[str, int] | None = None) -> None:
        loads = heartbeat_loads or {}
        self.by_key: dict[int, str] = {engine_key(engine_id): engine_id for engine_id in engine_ids}
        self.heartbeat: dict[str, int] = {engine_id: loads.get(engine_id, 0) for engine_id in self.by_key.values()}


# An entry's state as a row's record gives it: (requests, prompt tokens, prefilled-at stamp).
Entry = tuple[int, int, int]


class PodView:
    """Every row's entries (key -> ``Entry``) and the pod's sums over them, kept per change (``set``)."""

    __slots__ = ("_by_key", "_heartbeat", "_native_replay", "_replay_state", "_requests", "_rows", "_stamps",
                 "_tokens", "_totals", "_waiting", "_waits", "engines", "requests_above", "tokens")

    def __init__(self, num_rows: int) -> None:
        self._rows: list[dict[int, Entry]] = [{} for _ in range(num_rows)]
        # key -> the rows' requests (where > 0) and prompt tokens (where > 0); negatives count as 0, as a
        # transient of the writer's updates would leave them.
        self._requests: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        # key -> {row: prefilled-at stamp} for the rows with tokens to prefill there and a stamp (the waits' terms)
        self._stamps: dict[int, dict[int, int]] = {}
        self.engines = PodEngines(())
        self._by_key = self.engines.by_key
        self._heartbeat = self.engines.heartbeat
        # By engine id, for the registry's engines: requests above the heartbeat's load, prompt tokens, and the
        # stamps (the same dicts as ``_stamps``').
        self.requests_above: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self._waiting: dict[str, dict[int, int]] = {}
        self._waits = PodWaits(self._waiting, 0)
        self._totals = PodTotals(self.requests_above, self.tokens, self._waits)
        self._native_replay = pod_replay.NATIVE_REPLAY
        self._replay_state = self._state()

    def _state(self) -> tuple[dict[Any, Any], ...]:
        """The dicts ``set`` changes, in the order the C replay takes them (``_pod_replay.c``): rebuilt whenever
        ``use`` swaps the by-id ones."""
        return (self._requests, self._tokens, self._stamps, self._by_key, self._heartbeat, self.requests_above,
                self.tokens, self._waiting)

    def use(self, engines: PodEngines) -> None:
        """Sums by id for these engines from now on (a registry read's): O(engines in flight), once a read."""
        self.engines, self._by_key, self._heartbeat = engines, engines.by_key, engines.heartbeat
        by_key, heartbeat = engines.by_key, engines.heartbeat
        above: dict[str, int] = {}
        for key, num in self._requests.items():
            engine_id = by_key.get(key)
            if engine_id is not None and num > heartbeat[engine_id]:
                above[engine_id] = num
        self.requests_above = above
        self.tokens = {by_key[key]: num for key, num in self._tokens.items() if key in by_key}
        self._waiting = {by_key[key]: stamps for key, stamps in self._stamps.items() if key in by_key}
        self._waits = PodWaits(self._waiting, 0)
        self._totals = PodTotals(self.requests_above, self.tokens, self._waits)
        self._replay_state = self._state()

    def replay(self, row: int, ints: memoryview, log_at: int, log_records: int, written_at: int, cursor: int,
               behind: int) -> bool:
        """Row ``row``'s ``behind`` records after ``cursor`` in its ring (``ints``: the writer's row; the ring of
        ``log_records`` records at ``log_at``, the written count at ``written_at``), applied in order; False,
        none applied, where the writer came round to the first of them while they were copied (pod_replay.py)."""
        if self._native_replay is not None:
            return self._native_replay(ints, log_at, log_records, written_at, cursor, behind, row, self._rows[row],
                                       self._replay_state)
        return self._replay_py(row, ints, log_at, log_records, written_at, cursor, behind)

    def _replay_py(self, row: int, ints: memoryview, log_at: int, log_records: int, written_at: int, cursor: int,
                   behind: int) -> bool:
        """``replay`` in Python: the C one's twin (``_pod_replay.c``)."""
        start = cursor % log_records
        end = start + behind
        records = ints[log_at + start * INTS_PER_ENTRY:log_at + min(end, log_records) * INTS_PER_ENTRY].tolist()
        if end > log_records:
            records += ints[log_at:log_at + (end - log_records) * INTS_PER_ENTRY].tolist()
        # Whole if the writer has not come round to the first of them since the caller read the count.
        if (ints[written_at] % WRAP - cursor) % WRAP >= log_records:
            return False
        set_entry = self.set
        it = iter(records)
        for key, requests, tokens, at in zip(it, it, it, it, strict=True):
            set_entry(row, key, requests, tokens, at)
        return True

    def set(self, row: int, key: int, requests: int, tokens: int, prefilled_at: int) -> None:
        """Row ``row``'s entry for ``key`` is now this (all zero: it has none). On every change another worker
        makes, so written for speed: no builtins' calls, each dict read once."""
        entries = self._rows[row]
        old = entries.get(key)
        if old is None:
            if not (requests or tokens or prefilled_at):
                return
            old_requests = old_tokens = old_at = 0
            entries[key] = (requests, tokens, prefilled_at)
        else:
            old_requests, old_tokens, old_at = old
            if requests or tokens or prefilled_at:
                entries[key] = (requests, tokens, prefilled_at)
            else:
                del entries[key]
        engine_id = self._by_key.get(key)
        if tokens > 0 and prefilled_at:
            stamps = self._stamps.get(key)
            if stamps is None:
                self._stamps[key] = stamps = {}
                if engine_id is not None:
                    self._waiting[engine_id] = stamps
            stamps[row] = prefilled_at
        elif old_tokens > 0 and old_at:
            stamps = self._stamps.get(key)
            if stamps is not None:
                stamps.pop(row, None)
                if not stamps:
                    del self._stamps[key]
                    if engine_id is not None:
                        self._waiting.pop(engine_id, None)
        delta = (requests if requests > 0 else 0) - (old_requests if old_requests > 0 else 0)
        if delta:
            total = self._requests.get(key, 0) + delta
            if total > 0:
                self._requests[key] = total
                if engine_id is not None:
                    if total > self._heartbeat[engine_id]:
                        self.requests_above[engine_id] = total
                    else:
                        self.requests_above.pop(engine_id, None)
            else:
                self._requests.pop(key, None)
                if engine_id is not None:
                    self.requests_above.pop(engine_id, None)
        delta = (tokens if tokens > 0 else 0) - (old_tokens if old_tokens > 0 else 0)
        if delta:
            total = self._tokens.get(key, 0) + delta
            if total > 0:
                self._tokens[key] = total
                if engine_id is not None:
                    self.tokens[engine_id] = total
            else:
                self._tokens.pop(key, None)
                if engine_id is not None:
                    self.tokens.pop(engine_id, None)

    def replace_row(self, row: int, entries: Iterable[tuple[int, int, int, int]]) -> None:
        """Row ``row`` as a copy of it reads: (key, requests, tokens, prefilled at) each; keys it lacks are gone."""
        copied = {key: (requests, tokens, at) for key, requests, tokens, at in entries}
        for key in [key for key in self._rows[row] if key not in copied]:
            self.set(row, key, 0, 0, 0)
        for key, (requests, tokens, at) in copied.items():
            self.set(row, key, requests, tokens, at)

    def totals(self, now: int) -> PodTotals:
        """The sums as they stand; ``now``: the reader's stamp (pod_in_flight ``_stamp``) the waits count from. The
        view's own objects, not copies (a decision's reads cost what a dict's do): read before the view's next
        change or ``totals``."""
        self._waits.now = now
        return self._totals


class PodWaits(Mapping[str, float]):
    """Seconds from ``now`` until the pod's prompts at an engine should be prefilled, each row's remainder summed,
    worked out for the engines a decision asks about (a handful) rather than for all: engines with none are
    absent."""

    # routing/_affinity_rank.c reads both by these names (the stamps whole, as ``get`` sums them).
    __slots__ = ("_waiting", "now")

    def __init__(self, waiting: Mapping[str, Mapping[int, int]], now: int) -> None:
        self._waiting = waiting  # engine id -> {row: prefilled-at stamp}
        self.now = now

    def get(self, engine_id: str, default: float | None = None) -> float | None:  # type: ignore[override]
        # On the policy's path, several times a decision: one dict read where nothing is waiting there.
        stamps = self._waiting.get(engine_id)
        if stamps is None:
            return default
        now, wait_us = self.now, 0
        for at in stamps.values():
            # A stamp a stamp-width away is read modulo 2**32 (a prefill queue is seconds long, the stamp wraps
            # every ~71 minutes); one already past counts nothing.
            left = (at - now + HALF) % WRAP - HALF
            if left > 0:
                wait_us += left
        return wait_us / 1e6 if wait_us > 0 else default

    def __getitem__(self, engine_id: str) -> float:
        wait = self.get(engine_id)
        if wait is None:
            raise KeyError(engine_id)
        return wait

    def __contains__(self, engine_id: object) -> bool:
        return isinstance(engine_id, str) and self.get(engine_id) is not None

    def __iter__(self) -> Iterator[str]:
        return iter([engine_id for engine_id in self._waiting if self.get(engine_id) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)
