"""The requests a gateway pod has in flight to each engine, and their prompt tokens still to prefill there,
shared by the pod's worker processes.

Why: a worker's router counts what it sent to each engine until it ends (``router.InFlight``), which is fresher
than the engines' heartbeats (up to a second old). With W workers each sees 1/W of the pod's traffic, so two
workers meeting the same new prefix pick homes from different views, and a long cold prompt queued by one
worker is invisible to the other. At 64 simulated engines overloaded (docs/routing.md, "The pod's in-flight
table"), two workers that each counted alone reached TTFT p99 214-226 ms; sharing the counts, 160-169 ms.

Layout: one file, mapped by every worker, made by ``launch.run_gateway`` before the workers start (``create``),
with one row per worker. A worker owns a row for its life: an ``fcntl`` lock on the row's bytes, which the
kernel drops when the process dies, however it dies. It writes only its own row (no two processes ever write
the same bytes, so no atomics are needed) and reads every row. A row is a count ``n`` and ``n`` entries of
(engine key, requests, prefill tokens, prefilled at), 32-bit each; the key is the engine id's CRC-32, mapped back
to the id by the reader's engine list. *Prefilled at* is when the worker's prompts there should all be prefilled
(routing/prefill_clock.py), in microseconds of CLOCK_MONOTONIC (one clock for the host's processes) modulo
2**32: a reader takes the difference to its own now modulo 2**32 too, which is right while the two are within
~35 minutes of each other (a prefill queue is seconds long), and sums the rows' remainders into the engine's
wait. 0 means none. A replacement worker takes the row its dead predecessor left (the only unlocked one)
and zeroes it, so a killed worker's counts last until uvicorn replaces it.

Readers do not lock: a read that races a write can see an entry half-updated or one entry twice for a moment.
That costs a routing decision a wrong load, never a request its answer, and the next read is right.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tessera.routing.pod_sums import (
    INTS_PER_ENTRY,
    VECTOR_FROM_ENTRIES,
    PodEngines,
    PodTotals,
    engine_key,
    signed32,
    sum_vectorized,
    sum_walked,
)

ENV_VAR = "TESSERA_POD_IN_FLIGHT"
# Engines a worker can count at once (a row's entries). Beyond it, an engine counts in the worker's own view
# only (router.InFlight keeps its dicts whatever this table takes).
ROW_ENTRIES = 4096
_ROW_INTS = 1 + ROW_ENTRIES * INTS_PER_ENTRY
ROW_BYTES = 4 * _ROW_INTS

# Rows claimed by this process: fcntl locks are per process, so a second attach in the same process (a bench's
# two routers) would otherwise take a row the first holds.
_claimed_here: set[tuple[str, int]] = set()


def create(path: Path, num_rows: int) -> None:
    """A zeroed table of ``num_rows`` rows at ``path`` (replacing any earlier one): call before any worker
    attaches."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.truncate(num_rows * ROW_BYTES)
    os.replace(tmp, path)


class PodInFlight:
    """This worker's row of the pod's table, and the sum of every row."""

    def __init__(self, fd: int, view: mmap.mmap, row: int, num_rows: int, claim: tuple[str, int]) -> None:
        self._fd = fd
        self._map = view
        self._ints = memoryview(view).cast("i")
        self._rows = [self._ints[r * _ROW_INTS:(r + 1) * _ROW_INTS] for r in range(num_rows)]
        # The same memory as one array, for the sums over many entries (pod_sums.py).
        self._table: npt.NDArray[np.int32] | None = np.frombuffer(view, dtype=np.int32).reshape(num_rows, _ROW_INTS)
        self._own = self._rows[row]
        self.row = row
        self._claim = claim
        # engine id -> its entry's index in this worker's row
        self._positions: dict[str, int] = {}
        self._engine_ids: list[str] = []  # by entry index

    @classmethod
    def attach(cls, path: Path) -> PodInFlight | None:
        """Claims a free row of the table at ``path`` and zeroes it; None when every row is held."""
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        num_rows = size // ROW_BYTES
        for row in range(num_rows):
            claim = (str(path.resolve()), row)
            if claim in _claimed_here:
                continue
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, ROW_BYTES, row * ROW_BYTES)
            except OSError:
                continue  # a live worker's
            _claimed_here.add(claim)
            table = cls(fd, mmap.mmap(fd, num_rows * ROW_BYTES), row, num_rows, claim)
            table._own[:] = memoryview(bytes(ROW_BYTES)).cast("i")  # what a dead predecessor left
            return table
        os.close(fd)
        return None

    def add(self, engine_id: str, requests: int, tokens: int) -> None:
        """Adds to this worker's counts for ``engine_id`` (negative to take away)."""
        own = self._own
        position = self._positions.get(engine_id)
        if position is None:
            if requests <= 0 and tokens <= 0:
                return
            position = len(self._engine_ids)
            if position == ROW_ENTRIES:
                return  # the row is full: this engine counts in the worker's own view only
            base = 1 + position * INTS_PER_ENTRY
            own[base] = engine_key(engine_id)
            own[base + 1] = requests
            own[base + 2] = tokens
            own[base + 3] = 0
            self._positions[engine_id] = position
            self._engine_ids.append(engine_id)
            own[0] = position + 1  # published once the entry is whole
            return
        base = 1 + position * INTS_PER_ENTRY
        left_requests = own[base + 1] + requests
        left_tokens = own[base + 2] + tokens
        if left_requests > 0 or left_tokens > 0:
            own[base + 1] = left_requests
            own[base + 2] = left_tokens
            return
        # Nothing left there: the row's last entry takes this one's place, so a row holds only the engines
        # this worker has requests at, and readers walk no more than that. Key first, then its counts: a
        # reader in between sees the moved engine with this one's zeros (an undercount), never a wrong key's.
        last = len(self._engine_ids) - 1
        moved = self._engine_ids.pop()
        del self._positions[engine_id]
        if position != last:
            source = 1 + last * INTS_PER_ENTRY
            own[base] = own[source]
            own[base + 1] = own[source + 1]
            own[base + 2] = own[source + 2]
            own[base + 3] = own[source + 3]
            self._engine_ids[position] = moved
            self._positions[moved] = position
        own[0] = last

    def set_prefilled_at(self, engine_id: str, at_s: float) -> None:
        """When this worker's prompts at ``engine_id`` should all be prefilled (``time.monotonic()`` seconds;
        0.0: not known). A no-op for an engine without an entry (nothing in flight, or the row full)."""
        position = self._positions.get(engine_id)
        if position is not None:
            self._own[4 + position * INTS_PER_ENTRY] = _stamp(at_s) if at_s > 0 else 0

    def totals(self, engines: PodEngines, now_s: float) -> PodTotals:
        """The pod's requests (where above the engine's heartbeat load), prefill tokens and prefill wait (seconds
        from ``now_s``, a ``time.monotonic()`` reading) per engine, every row summed, for the engines of
        ``engines`` (the last registry read's); entries of engines it lacks (gone from the registry) are
        skipped."""
        counts = [min(row[0], ROW_ENTRIES) for row in self._rows]  # each row's count read once
        if sum(n for n in counts if n > 0) >= VECTOR_FROM_ENTRIES and self._table is not None:
            return sum_vectorized(self._table, counts, engines, _stamp(now_s))
        return sum_walked(self._rows, counts, engines, _stamp(now_s))

    def close(self) -> None:
        """Releases the row (its counts zeroed first) and the mapping."""
        self._own[:] = memoryview(bytes(ROW_BYTES)).cast("i")
        self._table = None  # its export of the mapping would keep close() from unmapping it
        for row in self._rows:
            row.release()
        self._own.release()
        self._ints.release()
        self._map.close()
        os.close(self._fd)  # drops this process's lock on the row
        _claimed_here.discard(self._claim)


def _stamp(at_s: float) -> int:
    """``at_s`` (monotonic seconds) in microseconds, as a row holds it (``signed32``)."""
    return signed32(int(at_s * 1e6))


def attach_from_env() -> PodInFlight | None:
    """The table ``launch.run_gateway`` made for this pod's workers (``TESSERA_POD_IN_FLIGHT``), or None (one
    worker, or a gateway built in a test)."""
    path = os.environ.get(ENV_VAR)
    if not path or not Path(path).exists():
        return None
    return PodInFlight.attach(Path(path))
