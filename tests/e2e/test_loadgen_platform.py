"""The load generator against the real platform: two tenants with their own keys, per-tenant percentiles.

Uses the ``platform_stack`` session fixture (tests/e2e/conftest.py): the stack of ``make run`` with its
tiny CPU model, so the run stays small (20 requests, 8-token outputs).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tessera_loadgen import Target, Workload, execute, read_jsonl
from tessera_loadgen.tokenizer_source import resolve_tokenizers

pytestmark = pytest.mark.engine


async def test_two_tenants_get_per_tenant_percentiles(platform_stack: Any, tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:8]
    names = {"steady": f"loadgen-steady-{suffix}", "closed": f"loadgen-closed-{suffix}"}
    keys = {role: await platform_stack.create_tenant(name) for role, name in names.items()}
    workload = Workload.model_validate(
        {
            "name": "e2e-two-tenants",
            "model": platform_stack.model,
            "num_requests": 20,
            "warmup_requests": 2,
            "request_timeout_s": 120,
            "tenants": [
                {
                    "name": "steady",
                    "api_key": keys["steady"],
                    "arrival": {"process": "poisson", "rate_rps": 2},
                    "slo": {"ttft_s": 30, "e2el_s": 60},
                    "classes": [{"name": "chat", "output_tokens": 8, "prompt": {"tokens": 64}}],
                },
                {
                    "name": "closed",
                    "api_key": keys["closed"],
                    "concurrency": 1,
                    "classes": [
                        {
                            "name": "complete",
                            "endpoint": "completions",
                            "output_tokens": 8,
                            "prompt": {"tokens": 48},
                        }
                    ],
                },
            ],
        }
    )
    run_dir = tmp_path / "run"
    target = Target.parse(platform_stack.base_url)
    # The served model's tokenizer, from the gateway's own endpoint: prompt lengths in its tokens.
    tokenizers = await resolve_tokenizers("auto", target, workload, dict.fromkeys(names, platform_stack.model))
    assert not tokenizers.warnings and set(tokenizers.specs) == {platform_stack.model}
    output = await asyncio.to_thread(execute, workload, target, run_dir, progress=False,
                                     tokenizers=tokenizers.specs)

    result = json.loads((run_dir / "result.json").read_text())
    assert result["metrics_version"] == "1"
    tenants = result["summary"]["tenants"]
    assert set(tenants) == {"steady", "closed"}
    for name, summary in tenants.items():
        assert summary["num_completed"] + summary["num_failed"] == summary["num_requests"]
        assert summary["num_completed"] > 0, f"{name}: no request completed: {summary['errors']}"
        for metric in ("ttft_s", "ttft_user_s", "e2el_user_s"):
            distribution = summary["latency"][metric]
            assert distribution["count"] > 0, (name, metric)
            assert 0 < distribution["p50"] <= distribution["p99"] <= distribution["p99.9"], (name, metric)
        assert summary["classes"], name
    assert result["summary"]["overall"]["num_requests"] == 20

    records = read_jsonl(run_dir / "requests.jsonl")
    assert len(records) == len(output.records) == 22
    completed = [r for r in records if r.ok]
    assert all(len(r.trace_id) == 32 for r in records)
    assert all(r.server_request_id for r in completed), "the gateway answers with x-request-id"
    assert (run_dir / "plots" / "latency_cdf.png").exists()
    # What the gateway counted (usage.prompt_tokens) is what the workload asked, exactly.
    assert result["run"]["prompt_lengths"] == "tokens"
    assert completed and all(r.n_in == r.n_in_asked for r in completed), [(r.n_in, r.n_in_asked) for r in completed]
    assert {r.n_in_asked for r in completed} == {64, 48}
