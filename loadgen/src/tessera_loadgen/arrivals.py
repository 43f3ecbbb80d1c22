"""Open-loop arrival processes, chosen by name in the workload file.

An arrival process yields the intended send times (``t_sched``) of one stream of requests, as offsets in
seconds from the start of the run. Times depend only on the process, its rate and its seed, never on how
fast the server answers: that is what makes the load open-loop, and it is why a stalled server shows up
in user-view latency instead of silently lowering the offered load (coordinated omission).

Processes register themselves by name::

    @register("poisson")
    class Poisson(ArrivalProcess): ...

and ``make_arrival_process("poisson", rate_rps=10, seed=1)`` builds one; an unknown name raises
``ValueError`` listing the valid ones.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar, TypeVar


class ArrivalProcess(ABC):
    """A stationary point process given by its rate; the first arrival is at offset 0."""

    _registry: ClassVar[dict[str, type[ArrivalProcess]]] = {}
    name: ClassVar[str] = ""

    def __init__(self, rate_rps: float, rng: random.Random, burstiness: float | None = None) -> None:
        if not rate_rps > 0:
            raise ValueError(f"arrival rate must be > 0 requests/s, got {rate_rps}")
        self.rate_rps = rate_rps
        self.rng = rng
        self.burstiness = burstiness

    @abstractmethod
    def next_gap_s(self) -> float:
        """Seconds from the previous arrival to the next one."""

    def offsets_s(self) -> Iterator[float]:
        """Arrival offsets from the start of the run: 0, then the running sum of the gaps, forever."""
        t = 0.0
        while True:
            yield t
            t += self.next_gap_s()


_P = TypeVar("_P", bound=type[ArrivalProcess])


def register(name: str) -> Callable[[_P], _P]:
    """Class decorator adding an arrival process to the registry under ``name``."""

    def add(cls: _P) -> _P:
        if name in ArrivalProcess._registry:
            raise ValueError(f"arrival process {name!r} is already registered")
        cls.name = name
        ArrivalProcess._registry[name] = cls
        return cls

    return add


def arrival_process_names() -> list[str]:
    """The registered process names, sorted."""
    return sorted(ArrivalProcess._registry)


def get_arrival_process(name: str) -> type[ArrivalProcess]:
    """The class registered under ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return ArrivalProcess._registry[name]
    except KeyError:
        raise ValueError(f"unknown arrival process {name!r}; valid: {', '.join(arrival_process_names())}") from None


def make_arrival_process(
    name: str, rate_rps: float, seed: int | str = 0, burstiness: float | None = None
) -> ArrivalProcess:
    """Build the named process with its own seeded random stream."""
    return get_arrival_process(name)(rate_rps, random.Random(seed), burstiness)


def repeat_every(offsets: Iterator[float], period_s: float) -> Iterator[float]:
    """The arrivals of the first ``period_s`` seconds of ``offsets``, and the same again every ``period_s``.

    A long run then meets the same arrivals in every period (the same bursts, the same gaps), so a latency
    compared period by period differs by what changed in the system, not by the random draw: a soak's p99
    over a few hundred requests is set mostly by where the draw put its tightest bursts."""
    if not period_s > 0:
        raise ValueError(f"period must be > 0 s, got {period_s}")
    first = list(itertools.takewhile(lambda t: t < period_s, offsets))
    if not first:
        return
    for repeat in itertools.count():
        for t in first:
            yield t + repeat * period_s


@register("poisson")
class Poisson(ArrivalProcess):
    """Exponential gaps: independent arrivals, the usual model of many users."""

    def next_gap_s(self) -> float:
        return self.rng.expovariate(self.rate_rps)


@register("gamma")
class Gamma(ArrivalProcess):
    """Gamma gaps with shape ``burstiness`` and mean ``1/rate`` (vLLM's ``--burstiness``).

    ``burstiness < 1`` clusters arrivals into bursts, ``1`` is Poisson, ``> 1`` is more regular than Poisson.
    """

    def __init__(self, rate_rps: float, rng: random.Random, burstiness: float | None = None) -> None:
        super().__init__(rate_rps, rng, burstiness)
        shape = 1.0 if burstiness is None else burstiness
        if not shape > 0:
            raise ValueError(f"gamma burstiness must be > 0, got {burstiness}")
        self._shape = shape
        self._scale = 1.0 / (rate_rps * shape)

    def next_gap_s(self) -> float:
        return self.rng.gammavariate(self._shape, self._scale)


@register("constant")
class Constant(ArrivalProcess):
    """Evenly spaced arrivals, ``1/rate`` apart: the calibration workload."""

    def next_gap_s(self) -> float:
        return 1.0 / self.rate_rps

    def offsets_s(self) -> Iterator[float]:
        # NOTE: i / rate rather than a running sum, so float error does not accumulate over long runs.
        i = 0
        while True:
            yield i / self.rate_rps
            i += 1
