"""The fleet benchmark's figure: share of the ideal hit rate and p99 TTFT against fleet size, one line per
policy (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def plot(sizes: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Writes ``path`` (PNG); None when matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not sizes:
        return None
    policies = list(dict.fromkeys(p for s in sizes.values() for p in s["policies"]))
    ordered = sorted(sizes, key=int)
    fig, (ax_hit, ax_p99) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy in policies:
        xs, hits, p99s = [], [], []
        for size in ordered:
            row = sizes[size]["policies"].get(policy)
            if row is None:
                continue
            xs.append(int(size))
            hits.append(row["share_of_ideal"] * 100)
            p99s.append(row["ttft_p99_ms"])
        style = {"linewidth": 2.5} if policy == "prefix_affinity" else {"linestyle": "--" if ":" in policy else "-"}
        ax_hit.plot(xs, hits, marker="o", label=policy, **style)
        ax_p99.plot(xs, [v if not math.isnan(v) else None for v in p99s], marker="o", label=policy, **style)
    ax_hit.axhline(90, color="grey", linewidth=0.8, linestyle=":")
    for ax in (ax_hit, ax_p99):
        ax.set_xscale("log")
        ax.set_xticks([int(s) for s in ordered], [s for s in ordered])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # the sizes only, no log-scale minors
        ax.set_xlabel("simulated H100 engines (Llama-3-70B TP8)")
        ax.grid(alpha=0.3)
    ax_hit.set_ylabel("% of the ideal hit rate")
    ax_p99.set_ylabel("TTFT p99, simulated ms")
    ax_p99.set_yscale("log")
    ax_hit.legend(fontsize=8)
    fig.suptitle("make bench-fleet")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
