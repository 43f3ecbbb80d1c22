"""What an engine runs where the platform cannot run its config: FP8 KV and speculative methods, against a
real vLLM engine on every machine.

On a CPU with AVX-512 or AMX, FP8 KV runs and doubles the KV capacity; on one without, the engine falls back
to ``auto`` by itself. The fallback tests run on both: where FP8 does run, they hide AVX-512 and AMX from
torch in this process, so vLLM's own ISA check (the one its CPU worker would raise) refuses FP8 exactly as it
does on an AVX2-only CPU. The worker process is spawned and sees the real CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tessera.engine.capabilities import ask_vllm
from tessera.engine.config import EngineConfig
from tessera.engine.host import EngineHost, EngineStartError
from tessera.redis_conn import EmbeddedRedis
from tessera.registry import engine_key
from tests.support.data_plane import ENGINE_AUTH
from tests.support.engines import start_host

pytestmark = pytest.mark.engine

VLLM_CPU_FP8_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."


def fp8_kv_refusal(model_dir: Path) -> str | None:
    return ask_vllm(EngineConfig(model=str(model_dir))).kv_cache_dtype_refusal


@pytest.fixture
def fallback_engine(cpu_without_fp8_kv: None, small_model_dir: Path, redis_server: EmbeddedRedis,
                    caplog: pytest.LogCaptureFixture) -> Iterator[EngineHost]:
    """The platform defaults (FP8 KV, n-gram) plus an eagle draft model that does not exist."""
    caplog.set_level(logging.WARNING, logger="tessera.engine.vllm_engine")
    host = start_host(small_model_dir, redis_server, kv_events={"enabled": False},
                      speculative={"method": "eagle", "draft_model": str(small_model_dir / "no-such-draft")})
    yield host
    host.stop()


def test_fp8_doubles_kv_token_capacity(fp8_engine: EngineHost, small_model_dir: Path) -> None:
    refusal = fp8_kv_refusal(small_model_dir)
    if refusal is not None:
        pytest.skip(f"this CPU has neither AVX-512 nor AMX, which vLLM's FP8 KV cache needs ({refusal}); "
                    "test_without_fp8_kv_the_engine_runs_auto_and_says_so covers it")
    fp8 = httpx.get(f"{fp8_engine.url}/stats", auth=ENGINE_AUTH).json()
    auto = start_host(small_model_dir, None, kv_cache_dtype="auto", speculative=None, kv_events={"enabled": False})
    try:
        bf16 = httpx.get(f"{auto.url}/stats", auth=ENGINE_AUTH).json()
    finally:
        auto.stop()
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["fallbacks"] == []
    assert bf16["kv_cache_dtype"] == "auto" and bf16["kv_cache_dtype_requested"] == "auto"
    assert fp8["kv_capacity_tokens"] == fp8["num_gpu_blocks"] * fp8["block_size"]
    ratio = fp8["kv_capacity_tokens"] / bf16["kv_capacity_tokens"]
    assert 1.9 <= ratio <= 2.1, f"fp8/auto KV token capacity ratio {ratio:.2f}"


def test_the_platform_default_engine_says_what_it_runs(fp8_engine: EngineHost, small_model_dir: Path,
                                                       redis_server: EmbeddedRedis) -> None:
    """On any machine: the default engine reports its effective dtype, capacity and method everywhere."""
    expected = "fp8" if fp8_kv_refusal(small_model_dir) is None else "auto"
    stats = httpx.get(f"{fp8_engine.url}/stats", auth=ENGINE_AUTH).json()
    assert stats["kv_cache_dtype"] == expected and stats["kv_cache_dtype_requested"] == "fp8"
    assert stats["speculative_method"] == "ngram" and stats["kv_capacity_tokens"] > 0
    metrics = httpx.get(f"{fp8_engine.url}/metrics", auth=ENGINE_AUTH).text
    assert f'kv_cache_dtype="{expected}"' in metrics and 'speculative_method="ngram"' in metrics
    assert "tessera_engine_kv_capacity_tokens{" in metrics
    record = redis.Redis.from_url(redis_server.url).hgetall(engine_key(fp8_engine.engine_id))
    assert record[b"kv_cache_dtype"] == expected.encode()
    assert int(record[b"kv_capacity_tokens"]) == stats["kv_capacity_tokens"]


def test_without_fp8_kv_the_engine_runs_auto_and_says_so(fallback_engine: EngineHost, fp8_engine: EngineHost,
                                                         small_model_dir: Path, redis_server: EmbeddedRedis,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    stats = httpx.get(f"{fallback_engine.url}/stats", auth=ENGINE_AUTH).json()
    assert stats["kv_cache_dtype"] == "auto" and stats["kv_cache_dtype_requested"] == "fp8"
    assert stats["kv_capacity_tokens"] == stats["num_gpu_blocks"] * stats["block_size"] > 0
    kv_note, spec_note = stats["fallbacks"]
    assert VLLM_CPU_FP8_REFUSAL in kv_note and "kvCacheDtypeStrict: true" in kv_note
    # The eagle draft model is missing: no speculation, and vLLM's reason names the path.
    assert stats["speculative_method"] == "none" and "no-such-draft" in spec_note
    # The capacity this costs: the same KV space holds half the tokens an FP8 engine holds.
    if fp8_kv_refusal(small_model_dir) is None:
        fp8_tokens = httpx.get(f"{fp8_engine.url}/stats", auth=ENGINE_AUTH).json()["kv_capacity_tokens"]
        assert 1.9 <= fp8_tokens / stats["kv_capacity_tokens"] <= 2.1
    kv_lines = [r.getMessage() for r in caplog.get_records("setup") if "kvCacheDtype=fp8" in r.getMessage()]
    assert len(kv_lines) == 1 and VLLM_CPU_FP8_REFUSAL in kv_lines[0]
    assert f"{stats['kv_capacity_tokens']:,} tokens" in kv_lines[0]
    assert f"fp8 would hold ~{2 * stats['kv_capacity_tokens']:,}" in kv_lines[0]
    record = redis.Redis.from_url(redis_server.url).hgetall(engine_key(fallback_engine.engine_id))
    assert record[b"kv_cache_dtype"] == b"auto" and record[b"speculative_method"] == b"none"
    assert VLLM_CPU_FP8_REFUSAL in record[b"fallbacks"].decode()
    # And it serves.
    body = {"request_id": "after-fallback", "prompt_token_ids": list(range(40, 72)), "max_tokens": 4}
    lines = httpx.post(f"{fallback_engine.url}/generate", json=body, timeout=60, auth=ENGINE_AUTH).text.splitlines()
    assert '"done":true' in lines[-1]


def test_strict_kv_dtype_refuses_to_start_before_the_model_loads(cpu_without_fp8_kv: None,
                                                                 small_model_dir: Path) -> None:
    config = EngineConfig(model=str(small_model_dir), kv_cache_dtype_strict=True, kv_events={"enabled": False})
    host = EngineHost(config, None)
    with pytest.raises(EngineStartError) as failure:
        host.start(timeout_s=120)
    message = str(failure.value)
    assert VLLM_CPU_FP8_REFUSAL in message and "kvCacheDtypeStrict" in message and "kvCacheDtype: auto" in message
    assert host.engine is None  # refused before vLLM built an engine (or loaded a weight)


def test_strict_speculation_refuses_to_start_without_its_draft_model(small_model_dir: Path) -> None:
    config = EngineConfig(model=str(small_model_dir), kv_cache_dtype="auto", kv_events={"enabled": False},
                          speculative={"method": "eagle", "draft_model": "/nonexistent/draft", "strict": True})
    host = EngineHost(config, None)
    with pytest.raises(EngineStartError, match=r"speculative\.strict") as failure:
        host.start(timeout_s=120)
    assert "/nonexistent/draft" in str(failure.value) and host.engine is None
