"""prefix_affinity's usual decision in C (``_affinity_rank.c``), where ``make install`` built it: the same ranking,
reason and placement as the policy's Python (routing/policies.py, its twin), for every decision it takes.

Why: on the 2-vCPU VM of issue #17 the policy's bytecode was ~15 µs of a ~30 µs routing decision at 64 engines,
and a p99 there is a p50 plus the VM's pauses (docs/routing.md, "The decision in C"). The C step takes the usual
case, a walk of the prefix's homes that finds ``MAX_RANKED_ENGINES`` engines open, and hands the rest back (None):
fleets of fewer engines, many engines over the load bound, a request whose holders all rank after an engine
without its prefix. ``TESSERA_NATIVE_AFFINITY=0`` keeps the Python policy for every decision.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tessera.native_steps import AFFINITY_STEP
from tessera.routing.pod_view import PodWaits
from tessera.routing.snapshot import EngineView, RouteSnapshot

NATIVE_RANK: Any | None = AFFINITY_STEP.load()
NATIVE_FLEET: Any | None = AFFINITY_STEP.load("fleet")


class Constants(NamedTuple):
    """The policy's numbers the C step needs, passed from policies.py (their one home)."""

    max_ranked: int
    bound_factor: float
    tokens_per_running: int
    tokens_per_waiting: int
    wait_step_tokens: int
    move_margin_tokens: int
    pending_prefill_step: int


# The C step's decision: the ranked engine ids, how it came about (policies' ``PLAIN``, ``MOVED``, ``PENDING``,
# ``PLACED_BY_LOAD``), the first engine's credited tokens and load, the holder's prefill wait when the request
# moved (seconds), and the prefix's placement to record (None: leave it). A plain tuple: a NamedTuple made per
# decision cost ~0.5 µs of a ~3 µs step on the 2-vCPU VM.
NativeRanking = tuple[tuple[str, ...], int, int, int, float, str | None]


def native_fleet(engines: tuple[EngineView, ...], index: dict[str, int], loads: list[int], points: list[int],
                 walks: list[tuple[int, ...]], positions: list[list[int]], constants: Constants) -> object | None:
    """A registry read's engines and ring as the C step's arrays (once a read), or None where it is not built."""
    if NATIVE_FLEET is None or not engines:
        return None
    return NATIVE_FLEET(tuple(e.engine_id for e in engines), index, loads, [e.num_waiting for e in engines],
                        [e.block_size for e in engines], [e.under_pressure for e in engines],
                        [e.pending_prefill_tokens for e in engines], points, walks, positions, tuple(constants))


def rank_natively(fleet: object, snapshot: RouteSnapshot, num_prompt_tokens: int, key: int,
                  state: str | None) -> NativeRanking | None:
    """The C step's decision for this snapshot, or None: the Python policy decides. ``state``: the prefix's
    placement as the policy recorded it (None, ``SETTLED`` or an engine id). The router's mappings are dicts and
    its waits a ``PodWaits``; anything else is copied into a dict first."""
    assert NATIVE_RANK is not None
    _, cached, in_flight, pending, waits, fit = snapshot
    if type(waits) is PodWaits and type(waits.stamps) is dict:
        stamps, now, plain = waits.stamps, waits.now, None
    else:
        stamps, now, plain = None, 0, dict(waits)
    ranking: NativeRanking | None = NATIVE_RANK(
        fleet, in_flight if type(in_flight) is dict else dict(in_flight),
        cached if type(cached) is dict else dict(cached), num_prompt_tokens, key, state,
        None if fit is None else fit.s_per_token, stamps, now, plain,
        pending if type(pending) is dict else dict(pending))
    return ranking
