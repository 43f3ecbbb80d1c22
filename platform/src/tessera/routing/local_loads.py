"""This gateway process's requests in flight per engine, and the few of them a routing decision needs.

Every policy reads an engine's load as max(its heartbeat's load, this process's requests in flight there)
(policies.py). Where the count is at or under the heartbeat's load it changes nothing, so a decision needs only
the engines where it is above: requests sent since the engine's last heartbeat counted them
(``above_heartbeat``). prefix_affinity used to walk every engine with requests in flight on each decision, ~35 µs
at 1,000 engines with 250 of them (docs/routing.md, "Latest run"); the engines above their heartbeat are now kept
as requests start and end (O(1) each) and found again at each registry read (O(engines in flight), off the
request path). With several gateway workers the pod's table (pod_in_flight.py) holds the counts instead, and its
view (pod_view.py) applies the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping


class LocalLoads:
    """``counts``: requests in flight per engine (engines with none left out); ``above_heartbeat``: those counts
    that exceed the engine's load as the last registry read gave it (``heartbeats``)."""

    __slots__ = ("_heartbeat", "above_heartbeat", "counts")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.above_heartbeat: dict[str, int] = {}
        self._heartbeat: Mapping[str, int] = {}

    def add(self, engine_id: str, delta: int) -> None:
        """A request sent to ``engine_id`` (+1) or ended there (-1)."""
        count = self.counts.get(engine_id, 0) + delta
        if count > 0:
            self.counts[engine_id] = count
        else:
            self.counts.pop(engine_id, None)
        if count > self._heartbeat.get(engine_id, 0):
            self.above_heartbeat[engine_id] = count
        else:
            self.above_heartbeat.pop(engine_id, None)

    def heartbeats(self, loads: Mapping[str, int]) -> None:
        """The engines' loads as a registry read just gave them (an engine missing from it counts as 0)."""
        self._heartbeat = loads
        self.above_heartbeat = {engine_id: count for engine_id, count in self.counts.items()
                                if count > loads.get(engine_id, 0)}
