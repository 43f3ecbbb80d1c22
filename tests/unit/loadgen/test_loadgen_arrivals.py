"""Arrival processes: registry, exact constant spacing, statistical shape of Poisson and gamma."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from tessera_loadgen.arrivals import (
    ArrivalProcess,
    arrival_process_names,
    get_arrival_process,
    make_arrival_process,
    register,
)


def gaps(name: str, rate: float, n: int, burstiness: float | None = None) -> list[float]:
    offsets = list(itertools.islice(make_arrival_process(name, rate, seed=5, burstiness=burstiness).offsets_s(), n))
    return [b - a for a, b in itertools.pairwise(offsets)]


def test_registry_lists_builtins_and_rejects_unknown_names() -> None:
    assert {"poisson", "gamma", "constant"} <= set(arrival_process_names())
    with pytest.raises(ValueError, match=r"valid: .*constant.*gamma.*poisson"):
        get_arrival_process("uniform")


def test_register_adds_a_process_and_refuses_duplicates() -> None:
    @register("test-every-2s")
    class EveryTwo(ArrivalProcess):
        def next_gap_s(self) -> float:
            return 2.0

    assert list(itertools.islice(make_arrival_process("test-every-2s", 1.0).offsets_s(), 3)) == [
        0.0,
        2.0,
        4.0,
    ]
    with pytest.raises(ValueError, match="already registered"):
        register("test-every-2s")(EveryTwo)
    del ArrivalProcess._registry["test-every-2s"]


def test_constant_is_exact_without_accumulated_error() -> None:
    offsets = list(itertools.islice(make_arrival_process("constant", 3000.0).offsets_s(), 300_001))
    assert offsets[0] == 0.0
    assert offsets[3] == pytest.approx(0.001)
    assert offsets[300_000] == 100.0


def test_first_arrival_is_at_zero_and_rate_must_be_positive() -> None:
    assert next(make_arrival_process("poisson", 5.0).offsets_s()) == 0.0
    with pytest.raises(ValueError, match="> 0"):
        make_arrival_process("poisson", 0.0)


def test_poisson_gaps_have_mean_and_std_one_over_rate() -> None:
    g = gaps("poisson", 50.0, 40_001)
    # 40k exponential samples: the standard error of the mean is 0.5 %; 3 % is far outside noise.
    assert statistics.fmean(g) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(g) == pytest.approx(1 / 50, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_keeps_the_rate_and_sets_the_variability(burstiness: float) -> None:
    g = gaps("gamma", 20.0, 40_001, burstiness)
    assert statistics.fmean(g) == pytest.approx(1 / 20, rel=0.05)
    # Gamma(shape k): coefficient of variation squared is 1 / k.
    cv2 = statistics.variance(g) / statistics.fmean(g) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.15)


def test_same_seed_same_schedule() -> None:
    a = list(itertools.islice(make_arrival_process("poisson", 9.0, seed="s").offsets_s(), 50))
    b = list(itertools.islice(make_arrival_process("poisson", 9.0, seed="s").offsets_s(), 50))
    c = list(itertools.islice(make_arrival_process("poisson", 9.0, seed="t").offsets_s(), 50))
    assert a == b != c


def test_gamma_rejects_non_positive_burstiness() -> None:
    with pytest.raises(ValueError, match="burstiness"):
        get_arrival_process("gamma")(1.0, random.Random(0), burstiness=0.0)


def test_repeat_every_replays_the_first_periods_arrivals() -> None:
    from tessera_loadgen.arrivals import repeat_every

    offsets = list(itertools.islice(repeat_every(make_arrival_process("poisson", 2.0, seed=3).offsets_s(), 10.0), 60))
    first = [t for t in offsets if t < 10.0]
    assert 5 < len(first) < 40 and all(b > a for a, b in itertools.pairwise(offsets))
    second = [t - 10.0 for t in offsets if 10.0 <= t < 20.0]
    assert second == pytest.approx(first)
    with pytest.raises(ValueError, match="period must be > 0"):
        next(repeat_every(iter([0.0]), 0.0))
