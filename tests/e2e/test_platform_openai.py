"""The platform through its public API with the official ``openai`` client, unchanged."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tessera.local.platform import LocalPlatform
from tests.support.data_plane import ENGINE_AUTH


@pytest.fixture(scope="module")
def tenant_key(platform_stack: LocalPlatform) -> str:
    return asyncio.run(platform_stack.create_tenant("e2e-openai"))


@pytest.fixture(scope="module")
def client(platform_stack: LocalPlatform, tenant_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform_stack.base_url}/v1", api_key=tenant_key, max_retries=0)


def test_streamed_chat_completion_with_usage(client: openai.OpenAI, platform_stack: LocalPlatform) -> None:
    stream = client.chat.completions.create(
        model=platform_stack.model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 16 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish == ["length"]
    assert isinstance(text, str)


def test_non_streamed_completion_with_usage(client: openai.OpenAI, platform_stack: LocalPlatform) -> None:
    completion = client.completions.create(model=platform_stack.model, prompt="one two three four", max_tokens=8,
                                           temperature=0)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens > 0
    assert completion.choices[0].finish_reason == "length"


def test_non_streamed_chat_completion(client: openai.OpenAI, platform_stack: LocalPlatform) -> None:
    chat = client.chat.completions.create(model=platform_stack.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 4


def test_models_lists_the_served_model(client: openai.OpenAI, platform_stack: LocalPlatform) -> None:
    assert [m.id for m in client.models.list()] == [platform_stack.model]


def test_models_say_what_each_replica_runs(platform_stack: LocalPlatform, tenant_key: str) -> None:
    """The `tessera` extension of /v1/models: effective KV dtype, KV capacity and speculative method."""
    body = httpx.get(f"{platform_stack.base_url}/v1/models",
                     headers={"authorization": f"Bearer {tenant_key}"}).json()
    (model,) = body["data"]
    (replica,) = model["tessera"]["replicas"]
    (record,) = platform_stack.engines()
    assert replica == {"kv_cache_dtype": record.kv_cache_dtype, "kv_blocks": record.num_gpu_blocks,
                       "block_size": record.block_size, "kv_capacity_tokens": record.kv_capacity_tokens,
                       "speculative_method": record.speculative_method}
    assert replica["kv_cache_dtype"] in ("fp8", "auto") and replica["speculative_method"] == "ngram"
    assert replica["kv_capacity_tokens"] == replica["kv_blocks"] * replica["block_size"] > 0
    assert "url" not in replica and "engine_id" not in replica  # tenants learn what, not where


def test_wrong_key_is_401_with_openai_error_body(platform_stack: LocalPlatform) -> None:
    bad = openai.OpenAI(base_url=f"{platform_stack.base_url}/v1", api_key="tsk-000000000000-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=platform_stack.model, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 401
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_api_key" and "message" in body
    assert info.value.response.headers.get("x-request-id")


def test_over_long_request_is_400(client: openai.OpenAI, platform_stack: LocalPlatform) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=platform_stack.model, prompt="hello", max_tokens=1024)
    assert info.value.status_code == 400
    assert "maximum context length is 1024" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=platform_stack.model, prompt="one two three " * 400, max_tokens=4)
    assert "context is 1024 tokens" in str(info.value)


def test_every_response_has_a_request_id(platform_stack: LocalPlatform, tenant_key: str) -> None:
    response = httpx.get(f"{platform_stack.base_url}/v1/models", headers={"Authorization": f"Bearer {tenant_key}",
                                                                          "x-request-id": "mine-123"})
    assert response.headers["x-request-id"] == "mine-123"
    assert httpx.get(f"{platform_stack.base_url}/nope").headers["x-request-id"].startswith("req-")


def test_a_client_leaving_mid_stream_leaves_no_request_in_the_engine(platform_stack: LocalPlatform,
                                                                     tenant_key: str, engine_url: str) -> None:
    engine = engine_url
    url, headers = f"{platform_stack.base_url}/v1/chat/completions", {"Authorization": f"Bearer {tenant_key}"}
    body = {"model": platform_stack.model, "messages": [{"role": "user", "content": "count with me"}],
            "max_tokens": 990, "ignore_eos": True}
    started = time.monotonic()
    assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
    whole_stream_s = time.monotonic() - started  # what the engine would keep working if nobody aborted
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60, headers=headers) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        next(lines)
        next(lines)
        # The replica knows the request by the gateway's id for it, which names the tenant.
        listing = httpx.get(f"{engine}/requests", auth=ENGINE_AUTH).json()
        assert any(r["request_id"].startswith("e2e-openai/") for r in listing)
    left = time.monotonic()
    while time.monotonic() - left < 2.0 and httpx.get(f"{engine}/requests", auth=ENGINE_AUTH).json():
        time.sleep(0.02)
    gone_after_s = time.monotonic() - left
    assert httpx.get(f"{engine}/requests", auth=ENGINE_AUTH).json() == []
    assert gone_after_s < whole_stream_s / 2, (gone_after_s, whole_stream_s)  # aborted, not finished
