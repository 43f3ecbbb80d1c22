"""``tessera up``'s banner: what each engine runs, its fallbacks, and where the traces are."""

from __future__ import annotations

from pathlib import Path

from tessera.local.banner import up_banner
from tessera.registry import EngineRecord


def record(engine_id: str, **what_runs: object) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, url="http://127.0.0.1:1", model="m", block_size=32,
                        num_gpu_blocks=65536, max_model_len=2048, **what_runs)  # type: ignore[arg-type]


def test_banner_says_what_runs_and_where_traces_go() -> None:
    fallback = "kvCacheDtype=fp8 is not available on this platform (FP8 KV cache on CPU requires ...)"
    records = [record("b", kv_cache_dtype="auto", kv_capacity_tokens=2_097_152, speculative_method="ngram",
                      fallbacks=fallback),
               record("a", kv_cache_dtype="fp8", kv_capacity_tokens=2_097_152, speculative_method="none")]
    text = up_banner("http://127.0.0.1:8000", "m", "tsk-key", records, Path("/run/traces"),
                     "http://127.0.0.1:9400/metrics")
    lines = text.splitlines()
    a = lines.index("  a: KV cache fp8, 2,097,152 tokens (65,536 blocks of 32), speculative decoding none")
    b = lines.index("  b: KV cache auto, 2,097,152 tokens (65,536 blocks of 32), speculative decoding ngram")
    assert a < b and lines[b + 1] == f"    ! {fallback}"
    assert "2 engine replica(s) serving 'm'" in text and "tsk-key" in text
    assert "KV-eviction controller: metrics http://127.0.0.1:9400/metrics" in text
    assert "tessera traces analyze /run/traces -p 99" in text
    assert "off (--no-kvcontrol)" in up_banner("u", "m", "k", [], Path("/t"), "")


def test_banner_names_the_gateway_metrics_port_apart_from_the_api() -> None:
    text = up_banner("http://127.0.0.1:8000", "m", "k", [], Path("/t"), "", None, "http://127.0.0.1:9464/metrics")
    assert "Gateway metrics (every worker, not on the API port): http://127.0.0.1:9464/metrics" in text
    assert "Gateway metrics" not in up_banner("u", "m", "k", [], Path("/t"), "")


def test_banner_says_where_the_embedded_redis_keeps_its_data() -> None:
    text = up_banner("u", "m", "k", [], Path("/t"), "", Path(".tessera/redis"))
    assert ("Redis data (tenants, keys, budgets, usage; kept between runs, delete to start empty): "
            ".tessera/redis") in text
    assert "Redis data" not in up_banner("u", "m", "k", [], Path("/t"), ""), "an external Redis keeps its own"
