"""PNG plots of a run: latency CDF per tenant, TTFT over time, throughput over time.

Latencies are drawn in milliseconds with plain tick labels (``plot_ticks``). matplotlib is imported inside
the functions (it takes a second to import) with the Agg backend, so no display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera_loadgen.metrics import e2el_user_s, ttft_user_s
from tessera_loadgen.plot_ticks import MS_PER_S, use_plain_ticks
from tessera_loadgen.records import RequestRecord

LATENCY_CDF_FILE = "latency_cdf.png"
TTFT_OVER_TIME_FILE = "ttft_over_time.png"
THROUGHPUT_FILE = "throughput_over_time.png"


def _by_tenant(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        if not record.warmup:
            groups.setdefault(record.tenant, []).append(record)
    return dict(sorted(groups.items()))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdf_figure(records: Sequence[RequestRecord]) -> Any:
    """TTFT and E2EL (user view) CDFs per tenant, log-scaled milliseconds."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    metrics = (("TTFT, user view (ms)", ttft_user_s), ("E2E latency, user view (ms)", e2el_user_s))
    for ax, (label, metric) in zip(axes, metrics, strict=True):
        for tenant, rows in _by_tenant(records).items():
            values_ms = np.sort([v * MS_PER_S for r in rows if r.ok and (v := metric(r)) is not None])
            if len(values_ms):
                fractions = np.arange(1, len(values_ms) + 1) / len(values_ms)
                ax.plot(values_ms, fractions, label=f"{tenant} (n={len(values_ms)})")
        ax.set_xscale("log")
        use_plain_ticks(ax.xaxis, log_scale=True)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.suptitle("Latency CDF per tenant")
    fig.tight_layout()
    return fig


def ttft_over_time_figure(records: Sequence[RequestRecord], t0: float) -> Any:
    """User-view TTFT of every request against its intended send time; failures marked at 0."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for tenant, rows in _by_tenant(records).items():
        points = [(r.t_sched - t0, v * MS_PER_S) for r in rows if r.ok and (v := ttft_user_s(r)) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, s=4, alpha=0.6, label=tenant)
        failed = [r.t_sched - t0 for r in rows if not r.ok]
        if failed:
            ax.scatter(failed, [0] * len(failed), marker="x", s=12, label=f"{tenant} failed")
    use_plain_ticks(ax.yaxis, log_scale=False)
    ax.set_xlabel("intended send time (s from start)")
    ax.set_ylabel("TTFT, user view (ms)")
    ax.set_title("TTFT over time")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    return fig


def throughput_figure(records: Sequence[RequestRecord], t0: float) -> Any:
    """Completed requests/s and output tokens/s per tenant, 1 s bins."""
    plt = _pyplot()
    fig, (ax_req, ax_tok) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    for tenant, rows in _by_tenant(records).items():
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
        use_plain_ticks(ax.yaxis, log_scale=False)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle("Throughput over time")
    fig.tight_layout()
    return fig


def write_plots(plot_dir: Path, records: Sequence[RequestRecord], t0: float) -> list[Path]:
    """Write the three PNGs; returns their paths."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    return [
        _save(latency_cdf_figure(records), plot_dir / LATENCY_CDF_FILE),
        _save(ttft_over_time_figure(records, t0), plot_dir / TTFT_OVER_TIME_FILE),
        _save(throughput_figure(records, t0), plot_dir / THROUGHPUT_FILE),
    ]


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path
