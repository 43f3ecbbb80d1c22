"""PNG plots of a run: latency CDF per tenant, TTFT over time, throughput over time.

matplotlib is imported inside ``write_plots`` (it takes a second to import) with the Agg backend, so no
display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tessera_loadgen.metrics import e2el_user_s, ttft_user_s
from tessera_loadgen.records import RequestRecord


def _by_tenant(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        if not record.warmup:
            groups.setdefault(record.tenant, []).append(record)
    return dict(sorted(groups.items()))


def write_plots(plot_dir: Path, records: Sequence[RequestRecord], t0: float) -> list[Path]:
    """Write the three PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    groups = _by_tenant(records)
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (label, metric) in zip(
        axes, (("TTFT, user view (s)", ttft_user_s), ("E2E latency, user view (s)", e2el_user_s)), strict=True
    ):
        for tenant, rows in groups.items():
            values = np.sort([v for r in rows if r.ok and (v := metric(r)) is not None])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=f"{tenant} (n={len(values)})")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.suptitle("Latency CDF per tenant")
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(12, 4.5))
    for tenant, rows in groups.items():
        points = [(r.t_sched - t0, v) for r in rows if r.ok and (v := ttft_user_s(r)) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, s=4, alpha=0.6, label=tenant)
        failed = [r.t_sched - t0 for r in rows if not r.ok]
        if failed:
            ax.scatter(failed, [0] * len(failed), marker="x", s=12, label=f"{tenant} failed")
    ax.set_xlabel("intended send time (s from start)")
    ax.set_ylabel("TTFT, user view (s)")
    ax.set_title("TTFT over time")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "ttft_over_time.png"))

    fig, (ax_req, ax_tok) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    for tenant, rows in groups.items():
        done = [(r.t_done - t0, r.n_out or 0) for r in rows if r.ok and r.t_done is not None]
        if not done:
            continue
        times = np.array([d[0] for d in done])
        tokens = np.array([d[1] for d in done], dtype=float)
        edges = np.arange(0.0, float(times.max()) + 1.0, 1.0)
        if len(edges) < 2:
            edges = np.array([0.0, 1.0])
        requests_per_s, _ = np.histogram(times, bins=edges)
        tokens_per_s, _ = np.histogram(times, bins=edges, weights=tokens)
        ax_req.stairs(requests_per_s, edges, label=tenant)
        ax_tok.stairs(tokens_per_s, edges, label=tenant)
    ax_req.set_ylabel("completed requests/s")
    ax_tok.set_ylabel("output tokens/s")
    ax_tok.set_xlabel("time (s from start), 1 s bins")
    for ax in (ax_req, ax_tok):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle("Throughput over time")
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "throughput_over_time.png"))
    return paths


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
