"""prefix_affinity's usual decision in C (``_affinity_rank.c``), where ``make install`` built it: the same ranking,
reason and placement as the policy's Python (routing/policies.py, its twin), for every decision it takes.

Why: on the 2-vCPU VM of issue #17 the policy's bytecode was ~15 µs of a ~30 µs routing decision at 64 engines,
and a p99 there is a p50 plus the VM's pauses (docs/routing.md, "The decision in C"). The C step takes the usual
case, a walk of the prefix's homes that finds ``MAX_RANKED_ENGINES`` engines open, and hands the rest back (None):
fleets of fewer engines, many engines over the load bound, a request whose holders all rank after an engine
without its prefix. ``TESSERA_NATIVE_AFFINITY=0`` keeps the Python policy for every decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tessera.native_steps import AFFINITY_STEP
from tessera.routing.pod_view import PodWaits
from tessera.routing.snapshot import EngineView, RouteDecision, RouteSnapshot

NATIVE_FLEET: Any | None = AFFINITY_STEP.load("fleet")
NATIVE_RING: Any | None = AFFINITY_STEP.load("ring")
if NATIVE_FLEET is not None:
    configure = AFFINITY_STEP.load("configure")
    assert configure is not None
    configure(RouteDecision, PodWaits)


class Constants(NamedTuple):
    """The policy's numbers the C step needs, passed from policies.py (their one home)."""

    max_ranked: int
    bound_factor: float
    tokens_per_running: int
    tokens_per_waiting: int
    wait_step_tokens: int
    move_margin_tokens: int
    pending_prefill_step: int


def native_ring(points: list[int], walks: list[tuple[int, ...]], positions: list[list[int]]) -> object | None:
    """A consistent-hash ring as the C step's arrays (once per set of engine ids, as the ring itself: ~1.5 ms at
    4,096 points), or None where it is not built."""
    if NATIVE_RING is None or not points:
        return None
    return NATIVE_RING(points, walks, positions)


def native_fleet(engines: tuple[EngineView, ...], index: dict[str, int], loads: list[int], ring: object | None,
                 constants: Constants) -> object | None:
    """A registry read's engines as the C step's arrays (once a read: O(engines)), over their ring's
    (``native_ring``), or None where it is not built."""
    if NATIVE_FLEET is None or ring is None or not engines:
        return None
    return NATIVE_FLEET(tuple(e.engine_id for e in engines), index, loads, [e.num_waiting for e in engines],
                        [e.block_size for e in engines], [e.under_pressure for e in engines],
                        [e.pending_prefill_tokens for e in engines], ring, tuple(constants))


def _not_built(fleet: object, snapshot: RouteSnapshot, num_prompt_tokens: int, key: int,
               state: str | None) -> tuple[RouteDecision, str | None] | None:
    raise RuntimeError("the C step is not built: no fleet has its arrays")


# rank_natively(fleet arrays, snapshot, the prompt's tokens, the prefix's key, its placement) -> None (the Python
# policy decides) or (the decision, the placement to record: None for none). The C function itself, called with
# no Python frame between: one cost ~0.5 µs of a ~3 µs step on the 2-vCPU VM. ``state``: the prefix's placement
# as the policy recorded it (None, ``SETTLED`` or an engine id).
NativeRank = Callable[[object, RouteSnapshot, int, int, str | None], tuple[RouteDecision, str | None] | None]
rank_natively: NativeRank = AFFINITY_STEP.load() or _not_built
