"""The ledger matches the engine's own KV usage, per tenant, after every step of a mixed workload on a real
engine with a tiny KV cache (48 blocks of 32 tokens): evictions, shared prefixes, prefix hits, three salted
tenants. The engine's count is read from its own block pool (see tests/support/ledger_probe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[3]


def test_ledger_matches_the_engine_block_pool_per_tenant(small_model_dir: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.support.ledger_probe", str(small_model_dir), "20", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    *steps, done = lines
    assert done["done"] and done["missed_batches"] == 0
    assert len(steps) > 50
    for s in steps:
        assert s["unattributed"] == 0, s
        assert s["ledger_total"] == s["engine_total"], s
        for tenant in ("alice", "bob", "carol"):
            # The issue allows one block per tenant; on a drained event stream the match is exact.
            assert abs(s["truth"].get(tenant, 0) - s["ledger"].get(tenant, 0)) <= 1, s
    exact = sum(1 for s in steps if s["truth"] == s["ledger"])
    assert exact == len(steps), f"{len(steps) - exact} of {len(steps)} steps within one block but not exact"
    # The workload really exercised the cache: evictions happened and the cache filled up.
    assert steps[-1]["evicted"] > 100 and min(s["free"] for s in steps) <= 2
