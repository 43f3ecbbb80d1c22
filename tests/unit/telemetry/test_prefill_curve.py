"""An engine's typical prefill time for a length (prefill_curve.py)."""

from __future__ import annotations

import pytest

from tessera.telemetry.prefill_curve import ALL_ENGINES, PrefillCurves


def samples(engine: str, tokens: int, seconds: float, n: int = 5) -> list[tuple[str, int, float]]:
    return [(engine, tokens, seconds)] * n


def test_interpolates_between_length_groups_and_is_flat_below_the_shortest() -> None:
    curves = PrefillCurves(samples("e1", 32, 0.010) + samples("e1", 1024, 0.110))
    mid = curves.typical("e1", 528)
    assert mid is not None and mid.seconds == pytest.approx(0.060) and mid.num_requests == 10 and mid.scope == "e1"
    low = curves.typical("e1", 4)
    assert low is not None and low.seconds == pytest.approx(0.010)
    high = curves.typical("e1", 2016)  # the last segment's slope continues
    assert high is not None and high.seconds == pytest.approx(0.210)


def test_medians_resist_the_slow_requests_among_the_reference() -> None:
    curves = PrefillCurves(samples("e1", 256, 0.030, 7) + samples("e1", 256, 5.0, 3))
    typical = curves.typical("e1", 256)
    assert typical is not None and typical.seconds == pytest.approx(0.030)


def test_falls_back_to_all_engines_and_says_so() -> None:
    curves = PrefillCurves(samples("e1", 32, 0.010) + samples("e1", 1024, 0.110) + samples("e2", 64, 0.02))
    other = curves.typical("e2", 1024)  # e2 has one group only: nothing beyond it
    assert other is not None and other.scope == ALL_ENGINES
    assert curves.typical("e3", 32) is not None
    assert PrefillCurves([]).typical("e1", 32) is None


def test_small_groups_count_only_without_a_full_one() -> None:
    curves = PrefillCurves(samples("e1", 32, 0.010) + samples("e1", 2048, 9.0, 1))
    assert curves.typical("e1", 2048) is None  # the lone 2,048-token request is not a reference…
    lone = PrefillCurves(samples("e1", 2048, 0.2, 1)).typical("e1", 2048)  # …unless it is all there is
    assert lone is not None and lone.seconds == pytest.approx(0.2)
