"""The soak's sampling-noise figure (bench/longrun/sampling_noise.py): pure, seeded, no process started."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from longrun.sampling_noise import chance_of_failing_flat

# A TTFT-like distribution: ~20 ms with a long tail (log-normal), as the soak's requests have.
TTFTS = list(np.random.default_rng(3).lognormal(mean=np.log(0.02), sigma=0.5, size=7000))


def test_a_percentile_over_fewer_requests_fails_the_rule_more_often_on_a_flat_run() -> None:
    overall = chance_of_failing_flat(TTFTS, window_sizes=[1240] * 6, limit=1.2)
    per_tenant = chance_of_failing_flat(TTFTS, window_sizes=[410] * 6, limit=1.2)
    p95_per_tenant = chance_of_failing_flat(TTFTS, window_sizes=[410] * 6, limit=1.2, q=95)
    assert overall < per_tenant
    assert p95_per_tenant < per_tenant
    assert 0.0 <= overall <= 1.0 and 0.05 < per_tenant < 0.95


def test_identical_values_never_fail_and_a_zero_limit_always_does() -> None:
    assert chance_of_failing_flat([0.05] * 100, window_sizes=[50, 50], limit=1.2) == 0.0
    assert chance_of_failing_flat(TTFTS, window_sizes=[100, 100], limit=0.0) == pytest.approx(1.0, abs=0.01)


def test_it_is_seeded_and_refuses_fewer_than_two_windows() -> None:
    args = {"window_sizes": [300, 300, 300], "limit": 1.2, "trials": 300}
    assert chance_of_failing_flat(TTFTS, **args, seed=5) == chance_of_failing_flat(TTFTS, **args, seed=5)
    with pytest.raises(ValueError, match="two or more windows"):
        chance_of_failing_flat(TTFTS, window_sizes=[300], limit=1.2)
