"""The engine host against a real vLLM engine: FP8 KV, speculative decoding, abort on disconnect, vLLM's own
metrics on /metrics."""

from __future__ import annotations

import time

import httpx
import orjson
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.engine.host import EngineHost
from tests.support.dashboard import dashboard_metric_names
from tests.support.data_plane import ENGINE_AUTH

pytestmark = pytest.mark.engine

REPETITIVE = list(range(40, 56)) * 6  # 96 tokens that repeat: n-gram drafts have something to match


def generate(host: EngineHost, **body: object) -> list[dict]:
    payload = {"request_id": f"t-{time.monotonic_ns()}", "prompt_token_ids": REPETITIVE, "max_tokens": 32,
               "temperature": 0.0, **body}
    with httpx.stream("POST", f"{host.url}/generate", json=payload, timeout=60, auth=ENGINE_AUTH) as response:
        assert response.status_code == 200
        return [orjson.loads(line) for line in response.iter_lines() if line]


def test_a_two_token_prompt_runs_as_the_engines_first_request(fp8_engine: EngineHost) -> None:
    # First in this module, so it is the engine's first request (the fixture serves this module only).
    # Without the host's warm-up pass, a first forward pass of fewer than 5 tokens kills vLLM's CPU worker
    # on the CI machine kind (SIGILL; see WARMUP_PROMPT_TOKENS) and the engine is dead.
    lines = generate(fp8_engine, prompt_token_ids=[100, 200], max_tokens=2)
    assert lines[-1]["done"] is True and lines[-1]["stats"]["num_output_tokens"] == 2
    assert fp8_engine.is_healthy()


def test_stream_ends_with_stats(fp8_engine: EngineHost) -> None:
    lines = generate(fp8_engine)
    deltas, done = lines[:-1], lines[-1]
    assert done["done"] is True and done["finish"] == {"0": "length"}
    assert sum(len(d["d"]) for d in deltas) == done["stats"]["num_output_tokens"] == 32
    assert done["stats"]["num_prompt_tokens"] == len(REPETITIVE)
    assert done["stats"]["ttft_s"] > 0 and done["stats"]["first_token_ts"] >= done["stats"]["arrival_ts"]


def test_same_salt_hits_the_prefix_cache_other_salt_does_not(fp8_engine: EngineHost) -> None:
    prompt = list(range(100, 300))
    generate(fp8_engine, prompt_token_ids=prompt, cache_salt="tenant-a", max_tokens=2)
    again = generate(fp8_engine, prompt_token_ids=prompt, cache_salt="tenant-a", max_tokens=2)[-1]["stats"]
    other = generate(fp8_engine, prompt_token_ids=prompt, cache_salt="tenant-b", max_tokens=2)[-1]["stats"]
    assert again["num_cached_tokens"] >= 192
    assert other["num_cached_tokens"] == 0


def test_speculative_decoding_drafts_and_accepts(fp8_engine: EngineHost) -> None:
    before = httpx.get(f"{fp8_engine.url}/stats", auth=ENGINE_AUTH).json()
    stats = generate(fp8_engine, max_tokens=64)[-1]["stats"]
    after = httpx.get(f"{fp8_engine.url}/stats", auth=ENGINE_AUTH).json()
    # Per request too (the engine span's tessera.spec.* attributes): vLLM's own drafted/accepted counts.
    assert 0 < stats["num_spec_accepted_tokens"] <= stats["num_spec_draft_tokens"], stats
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0, "the engine drafted no tokens: speculative decoding is off"
    assert accepted > 0, "no draft token was accepted on a repetitive prompt"
    # The adaptive controller runs in the host (speculative.adaptive is on by default) and shows its state.
    control = after["speculation"]
    assert control["method"] == "ngram" and control["runtime_toggle"] is True, control
    metrics = httpx.get(f"{fp8_engine.url}/metrics", auth=ENGINE_AUTH).text
    assert "tessera_engine_speculation_on" in metrics


def test_disconnect_leaves_no_running_request(fp8_engine: EngineHost) -> None:
    payload = {"request_id": "leaver", "prompt_token_ids": REPETITIVE, "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", f"{fp8_engine.url}/generate", json=payload, timeout=60, auth=ENGINE_AUTH) as response:
        lines = response.iter_lines()
        next(lines)
        next(lines)
        listing = httpx.get(f"{fp8_engine.url}/requests", auth=ENGINE_AUTH).json()
        assert any(r["request_id"] == "leaver" for r in listing)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        in_flight = httpx.get(f"{fp8_engine.url}/requests", auth=ENGINE_AUTH).json()
        running = httpx.get(f"{fp8_engine.url}/stats", auth=ENGINE_AUTH).json()["num_running"]
        if not in_flight and running == 0:
            break
        time.sleep(0.05)
    assert httpx.get(f"{fp8_engine.url}/requests", auth=ENGINE_AUTH).json() == []
    time.sleep(0.3)  # one more stats step after the abort
    assert httpx.get(f"{fp8_engine.url}/stats", auth=ENGINE_AUTH).json()["num_running"] == 0


def test_vllms_processes_sleep_between_requests(fp8_engine: EngineHost) -> None:
    # Right after a request vLLM's processes wait on a socket instead of spinning for a second: the engine core
    # that runs the model (cpuModelInEngineCore) has no shared-memory queue to spin on, and where a worker
    # process runs the model, shmBusyLoopS=0 (the CPU default) stops both from spinning (engine/shm_wait.py).
    generate(fp8_engine, max_tokens=4)
    children = psutil.Process().children(recursive=True)
    vllm = [p for p in children if p.name().startswith("VLLM::")]
    assert vllm, [p.name() for p in children]
    before = sum(sum(p.cpu_times()[:2]) for p in vllm)
    time.sleep(0.5)
    spent = sum(sum(p.cpu_times()[:2]) for p in vllm) - before
    assert spent < 0.15, f"vLLM's processes used {spent:.2f} CPU-s in 0.5 s idle: they busy-wait"


def test_the_model_runs_in_vllms_engine_core_process_on_the_cpu_build(fp8_engine: EngineHost) -> None:
    # cpuModelInEngineCore (the default): vLLM's CPU platform would start a worker process and hand every
    # step across two shared-memory queues; here the engine core computes itself, as vLLM does with one GPU.
    generate(fp8_engine, max_tokens=4)
    names = [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    assert "VLLM::EngineCore" in names, names
    assert not [name for name in names if "Worker" in name], names
    assert fp8_engine.engine.vllm_config.parallel_config.distributed_executor_backend == "uni"


def test_health_and_unknown_route(fp8_engine: EngineHost) -> None:
    assert httpx.get(f"{fp8_engine.url}/health").json()["healthy"] is True
    assert httpx.get(f"{fp8_engine.url}/nope", auth=ENGINE_AUTH).status_code == 404
    bad = httpx.post(f"{fp8_engine.url}/generate", json={"request_id": "x"}, auth=ENGINE_AUTH)
    assert bad.status_code == 400 and "prompt_token_ids" in bad.json()["error"]


def _vllm_samples(host: EngineHost) -> dict[str, float]:
    """The replica's vllm:* samples on /metrics, summed over their labels."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{host.url}/metrics", auth=ENGINE_AUTH).text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_metrics_carry_vllms_own_series_after_a_request(fp8_engine: EngineHost) -> None:
    """vLLM's own Prometheus metrics of this replica on its /metrics, beside Tessera's (vllm_metrics.py),
    including every vllm: metric the Grafana dashboard queries."""
    before = _vllm_samples(fp8_engine)
    generate(fp8_engine, max_tokens=8)
    time.sleep(0.3)  # vLLM records a step's stats after the step's outputs
    after = _vllm_samples(fp8_engine)
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0.0) >= 8
    assert after["vllm:time_to_first_token_seconds_count"] > before.get("vllm:time_to_first_token_seconds_count", 0)
    assert "tessera_engine_kv_cache_usage_ratio" in httpx.get(f"{fp8_engine.url}/metrics", auth=ENGINE_AUTH).text
    queried = {name for name in dashboard_metric_names() if name.startswith("vllm:")}
    assert queried and queried <= set(after), sorted(queried - set(after))
