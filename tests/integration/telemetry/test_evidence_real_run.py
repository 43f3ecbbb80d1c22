"""``tessera traces analyze`` on a real run: every request in the tail has evidence for its primary cause, and
the evidence names the noisy tenant as the cause of the quiet tenant's tail.

One engine with a tiny KV cache (64 blocks x 32 tokens), the gateway and the controller (observe-only: its
eviction spans, nothing that changes the workload), all exporting spans to the run directory. A quiet tenant
sends one request at a time that shares a 512-token prefix; before every third one, a noisy tenant starts a
burst of three 1,024-token prompts (96 blocks: more than the cache) and does not wait for it. So a quiet
request either runs alone with its prefix cached, or lands in the burst: queued behind it, prefilled beside
it, or recomputing a prefix the burst evicted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from tessera.cli import app
from tessera.redis_conn import EmbeddedRedis
from tessera.telemetry.analyze import AnalysisOptions, analyze, render
from tests.support.evidence_checks import check_culprit, check_evidence
from tests.support.kvstack import KVStack, StackOptions, complete, new_client

pytestmark = pytest.mark.engine

PREFIX_TOKENS = 512
QUIET_REQUESTS = 21
BURST_EVERY = 3
QUIET, NOISY = "ev-quiet", "ev-noisy"


@pytest.fixture(scope="module")
def stack(small_model_dir: Path, redis_server: EmbeddedRedis,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVStack]:
    options = StackOptions(model_dir=small_model_dir, redis_url=redis_server.url,
                           run_dir=tmp_path_factory.mktemp("evidence"), served_model_name="kvc-evidence")
    options.env["TESSERA_KVCONTROL_MODEL"] = options.served_model_name  # the session's Redis is shared
    started = KVStack(options)
    try:
        started.start()
        started.start_controller(observe_only=True)
        yield started
    finally:
        started.stop()


def _spans_since(traces: Path, start_ns: int, out: Path) -> Path:
    """The run to analyze: every exported span that started after the warm-up."""
    lines = [line for f in sorted(traces.glob("*.jsonl")) for line in f.read_bytes().splitlines()
             if line.strip() and orjson.loads(line)["start_ns"] >= start_ns]
    out.write_bytes(b"\n".join(lines) + b"\n")
    return out


async def _workload(stack: KVStack) -> int:
    """Runs the quiet and noisy tenants; returns when the analyzed part started (ns)."""
    quiet_key = await stack.create_tenant(QUIET)
    noisy_key = await stack.create_tenant(NOISY)
    rng = random.Random(5)
    prefix = [rng.randrange(10, 700) for _ in range(PREFIX_TOKENS)]
    url, model = stack.gateway_url, stack.model
    async with new_client() as client:
        # The engine's slow first passes and the quiet prefix's first (cold) prefill, outside the analysis.
        await complete(client, url, noisy_key, model, [rng.randrange(10, 700) for _ in range(1024)], 2)
        await complete(client, url, quiet_key, model, [*prefix, 1, 2], 2)
        start_ns = time.time_ns()
        bursts = []
        for i in range(QUIET_REQUESTS):
            if i % BURST_EVERY == 1:
                prompts = [[rng.randrange(10, 700) for _ in range(1024)] for _ in range(3)]
                bursts.append(asyncio.gather(*(complete(client, url, noisy_key, model, p, 8) for p in prompts)))
                await asyncio.sleep(0.02)  # the burst reaches the engine first
            quiet = await complete(client, url, quiet_key, model, prefix + [rng.randrange(10, 700) for _ in range(8)],
                                   4)
            assert quiet.status == 200 and not quiet.error, quiet.error
            if i % BURST_EVERY == 2:
                done = await bursts[-1]
                assert all(r.status == 200 for r in done), [r.error for r in done]
        for burst in bursts:
            await burst
    await asyncio.sleep(2.0)  # every process's batch span processor exports within 0.5 s
    return start_ns


async def test_every_selected_request_has_evidence_and_the_noisy_tenant_is_named(stack: KVStack,
                                                                                 tmp_path: Path) -> None:
    start_ns = await _workload(stack)
    run = _spans_since(stack.options.run_dir / "traces", start_ns, tmp_path / "run.jsonl")
    report = analyze([run], AnalysisOptions(percentile=90))
    text = render(report)
    check_evidence(report, stack.engine_urls)
    for a in report.attributions:
        if "computed_tokens" in a.evidence[a.primary].facts:
            assert a.phases.prompt_tokens == (PREFIX_TOKENS + 8 if a.timeline.tenant == QUIET else 1024), text
    check_culprit(report, QUIET, NOISY)

    # The CLI's JSON carries the same evidence, structured.
    result = CliRunner().invoke(app, ["traces", "analyze", str(run), "-p", "90", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["requests"]) == len(report.attributions)
    for request in data["requests"]:
        evidence = request["evidence"][request["primary_cause"]]
        assert evidence["summary"] and evidence["facts"] and evidence["kind"]
    assert next(r for r in data["by_tenant"] if r["tenant"] == QUIET)["culprit"] == NOISY
