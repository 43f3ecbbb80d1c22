"""How often a flat run would fail a soak's p99 rule by sampling alone (pure; seeded).

The soak's rule compares each window's p99 TTFT with the first window's. A p99 over n requests is about the
n/100-th slowest of them, so two windows of the same platform differ by which few requests the machine
slowed. ``chance_of_failing_flat`` draws every window from the run's own TTFTs pooled (a run flat by
construction: each window the same distribution) and counts how often the rule still fails. In run R
(docs/performance.md section 10) that was 4 % for the overall p99 (~1,240 requests a window) and 26-31 %
for each tenant's (~410): with three tenants, a perfectly flat run fails the per-tenant rule more often
than it passes. The bench prints the figure beside each verdict so a FAIL can be read against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def chance_of_failing_flat(values: Sequence[float], *, window_sizes: Sequence[int], limit: float, q: float = 99,
                           trials: int = 2000, seed: int = 0) -> float:
    """The share of ``trials`` in which windows of ``window_sizes`` requests, each drawn with replacement from
    ``values``, give a later window a ``q``-th percentile (numpy's, as the soak computes it) above ``limit``
    times the first's."""
    if len(window_sizes) < 2 or len(values) == 0 or min(window_sizes) < 1:
        raise ValueError("need two or more windows of at least one request, and values to draw from")
    rng = np.random.default_rng(seed)
    pool = np.asarray(values, dtype=float)
    first, *later = (np.percentile(rng.choice(pool, size=(trials, size)), q, axis=1) for size in window_sizes)
    worst_ratio = np.max(np.stack(later), axis=0) / first
    return float(np.mean(worst_ratio > limit))
