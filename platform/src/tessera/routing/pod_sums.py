"""The pod table's rows (pod_in_flight.py) summed per engine for one routing decision.

Every decision of a worker in a pod with several workers reads every row, since the other workers' counts change
without telling it. With a few dozen entries a Python loop over them is cheapest; at 1,000 engines with a quarter
of them in flight from two workers it walked ~500 entries, ~0.2 µs each, and the policy then walked the ~400 engines
it returned (docs/routing.md, "The pod's sums at fleet scale"). From ``VECTOR_FROM_ENTRIES`` entries on, the rows are
summed with numpy over the table's memory (a fixed ~20 µs, then a few ns an entry), and either way a decision gets
only the engines whose pod count exceeds their heartbeat's load: below it no policy's view changes (every policy
reads max(heartbeat, in flight), local_loads.py), so the policy walks a handful.

Both ways give the same sums, in the same float order (entries in row order), tested on random tables
(tests/unit/routing/test_pod_sums.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

INTS_PER_ENTRY = 4
WRAP = 1 << 32
HALF = 1 << 31
# Entries (all rows together) from which a decision sums the rows with numpy rather than a Python loop: the loop
# costs ~0.2-0.3 µs an entry, numpy ~20 µs whatever the count (measured on the 2-vCPU VM, 2026-12-06).
VECTOR_FROM_ENTRIES = 96


def engine_key(engine_id: str) -> int:
    """The 32-bit key an engine's entries carry (signed, as the row's ints are)."""
    return signed32(zlib.crc32(engine_id.encode()))


def signed32(value: int) -> int:
    """``value`` modulo 2**32, as a signed 32-bit int (what a row's ints hold)."""
    return (value + HALF) % WRAP - HALF


class PodTotals(NamedTuple):
    """The pod's view of its engines: requests in flight where they exceed the engine's heartbeat load, prompt
    tokens awaiting their first token, and seconds until those should be prefilled (engines with none left out
    of each)."""

    requests: dict[str, int]
    tokens: dict[str, int]
    waits: dict[str, float]


class PodEngines:
    """A registry read's engines as the sums need them, built at the read (off the request path): entry key ->
    engine id, and each engine's heartbeat load. Two ids with one key (a CRC-32 collision) count as the later one,
    both ways."""

    __slots__ = ("by_key", "heartbeat", "ids", "keys", "loads")

    def __init__(self, engine_ids: Iterable[str], heartbeat_loads: Mapping[str, int] | None = None) -> None:
        loads = heartbeat_loads or {}
        self.by_key: dict[int, str] = {engine_key(engine_id): engine_id for engine_id in engine_ids}
        self.heartbeat: dict[str, int] = {engine_id: loads.get(engine_id, 0) for engine_id in self.by_key.values()}
        keys = sorted(self.by_key)
        self.keys: npt.NDArray[np.int64] = np.array(keys, dtype=np.int64)
        self.ids: list[str] = [self.by_key[key] for key in keys]  # by position in ``keys``
        self.loads: npt.NDArray[np.int64] = np.array([self.heartbeat[i] for i in self.ids], dtype=np.int64)


def sum_walked(rows: Sequence[memoryview], counts: Sequence[int], engines: PodEngines, now: int) -> PodTotals:
    """The rows' ``counts[r]`` entries summed by a Python loop; ``now``: the reader's stamp (``_stamp``)."""
    by_key, heartbeat = engines.by_key, engines.heartbeat
    requests: dict[str, int] = {}
    tokens: dict[str, int] = {}
    waits: dict[str, float] = {}
    for row, n in zip(rows, counts, strict=True):
        if n <= 0:
            continue
        it = iter(row[1:1 + n * INTS_PER_ENTRY].tolist())
        for key, num_requests, num_tokens, prefilled_at in zip(it, it, it, it, strict=True):
            engine_id = by_key.get(key)
            if engine_id is None:
                continue
            if num_requests > 0:
                requests[engine_id] = requests.get(engine_id, 0) + num_requests
            if num_tokens > 0:
                tokens[engine_id] = tokens.get(engine_id, 0) + num_tokens
                if prefilled_at and (left := (prefilled_at - now + HALF) % WRAP - HALF) > 0:
                    waits[engine_id] = waits.get(engine_id, 0.0) + left / 1e6
    above = {engine_id: num for engine_id, num in requests.items() if num > heartbeat.get(engine_id, 0)}
    return PodTotals(above, tokens, waits)


def sum_vectorized(table: npt.NDArray[np.int32], counts: Sequence[int], engines: PodEngines,
                   now: int) -> PodTotals:
    """The same sums with numpy: ``table`` is the rows as one (rows, row ints) array over the table's memory."""
    parts = [table[r, 1:1 + n * INTS_PER_ENTRY] for r, n in enumerate(counts) if n > 0]
    if not parts or not engines.ids:
        return PodTotals({}, {}, {})
    entries = np.concatenate(parts).astype(np.int64).reshape(-1, INTS_PER_ENTRY)
    keys = engines.keys
    position = np.searchsorted(keys, entries[:, 0])
    position[position == len(keys)] = 0
    known = keys[position] == entries[:, 0]
    position, entries = position[known], entries[known]
    size = len(keys)
    num_requests, num_tokens, prefilled_at = entries[:, 1], entries[:, 2], entries[:, 3]
    requests = np.bincount(position, weights=np.where(num_requests > 0, num_requests, 0), minlength=size)
    tokens = np.bincount(position, weights=np.where(num_tokens > 0, num_tokens, 0), minlength=size)
    left = (prefilled_at - now + HALF) % WRAP - HALF
    waiting = (num_tokens > 0) & (prefilled_at != 0) & (left > 0)
    waits = np.bincount(position[waiting], weights=left[waiting] / 1e6, minlength=size)
    ids = engines.ids
    above = np.flatnonzero(requests > engines.loads)
    with_tokens = np.flatnonzero(tokens > 0)
    with_waits = np.flatnonzero(waits > 0)
    return PodTotals(dict(zip(map(ids.__getitem__, above.tolist()), requests[above].astype(np.int64).tolist(),
                              strict=True)),
                     dict(zip(map(ids.__getitem__, with_tokens.tolist()),
                              tokens[with_tokens].astype(np.int64).tolist(), strict=True)),
                     dict(zip(map(ids.__getitem__, with_waits.tolist()), waits[with_waits].tolist(), strict=True)))
