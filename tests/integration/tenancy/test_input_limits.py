"""Every input limit, through a real gateway process, answered before any engine work with an OpenAI
error body: 413, 400 naming the field, 404 unknown model, 403 model not allowed, 401 without a key.
A tenant sees only its own models and its own usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tessera.engine.host import EngineHost
from tessera.redis_conn import connect
from tessera.registry import MODELS_HASH, ModelInfo, register_model
from tests.support.data_plane import ENGINE_AUTH
from tests.support.gateways import GatewayProcess
from tests.support.tenancy import MODEL, TenantHandle, completion_body, create_tenant, error_of
from tests.support.valkey import RestartableRedis

OTHER_MODEL = "tenancy-other"


@pytest.fixture(scope="module")
async def other_model(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost, client: httpx.Client,
                      tenant: TenantHandle) -> None:
    """A second catalog entry (what an engine of another model registers), so /v1/models can be filtered; ready once
    the client's gateway has read it: a name its copy lacks re-reads the catalog at most once a second
    (gateway/models.py ``MISS_REREAD_S``), and the tenant, allowed only MODEL, then gets 403 for it, not 404."""
    redis = connect(tenancy_redis.url, timeout_s=5.0)
    try:
        await register_model(redis, ModelInfo(OTHER_MODEL, tenancy_engine.config.tokenizer_path, 1024, 32))
    finally:
        await redis.aclose()
    deadline = time.monotonic() + 10
    while post(client, tenant, {**completion_body(), "model": OTHER_MODEL}).status_code == 404:
        assert time.monotonic() < deadline, "the gateway never read the second model's record"
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def tenant(gateways: list[GatewayProcess]) -> TenantHandle:
    return create_tenant(gateways[0], {"maxTokensCap": 16, "maxPromptTokens": 64, "maxN": 2,
                                       "allowedModels": [MODEL]}, prefix="limits")


@pytest.fixture(scope="module")
def client(gateways: list[GatewayProcess]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateways[1].url, timeout=30) as c:
        yield c


def post(client: httpx.Client, tenant: TenantHandle, body: Any, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={**tenant.headers, "content-type": "application/json"})


@pytest.mark.adversarial
def test_body_over_the_limit_is_413(client: httpx.Client, tenant: TenantHandle) -> None:
    huge = json.dumps(completion_body(prompt="x" * 1_100_000)).encode()
    response = post(client, tenant, huge)
    assert response.status_code == 413 and error_of(response)["code"] == "body_too_large"


@pytest.mark.adversarial
def test_body_over_the_limit_without_content_length_is_413(client: httpx.Client, tenant: TenantHandle) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(20):
            yield b" " * 65536  # 1.25 MiB of whitespace, streamed chunked
    response = client.post("/v1/completions", content=chunks(), headers=tenant.headers)
    assert response.status_code == 413


@pytest.mark.adversarial
def test_a_body_over_the_limit_is_refused_even_without_a_key(client: httpx.Client) -> None:
    response = client.post("/v1/completions", content=b"{" + b" " * 1_100_000 + b"}")
    assert response.status_code == 413


@pytest.mark.parametrize("fields, code, param", [
    ({"max_tokens": 17}, "max_tokens_too_large", "max_tokens"),
    ({"n": 3, "temperature": 1.0}, "n_too_large", "n"),
    ({"prompt": list(range(100, 165))}, "prompt_too_long", "prompt"),
])
def test_tenant_caps_are_400(client: httpx.Client, tenant: TenantHandle, fields: dict[str, Any], code: str,
                             param: str) -> None:
    response = post(client, tenant, completion_body(**fields))
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error")


def test_prompt_over_the_model_context_is_400(gateways: list[GatewayProcess], tenancy_engine: EngineHost) -> None:
    context = tenancy_engine.config.max_model_len
    roomy = create_tenant(gateways[0], {"maxTokensCap": context}, prefix="ctx")
    with httpx.Client(base_url=gateways[0].url, timeout=30) as c:
        too_long = post(c, roomy, completion_body(prompt=[7] * context))
        too_much = post(c, roomy, completion_body(prompt=[7] * (context - 50), max_tokens=100))
    assert too_long.status_code == 400 and error_of(too_long)["code"] == "context_length_exceeded"
    assert too_much.status_code == 400 and error_of(too_much)["param"] == "max_tokens"


@pytest.mark.adversarial
def test_a_request_the_tenants_rate_can_never_hold_is_400_not_429(gateways: list[GatewayProcess]) -> None:
    # Admission would answer it 429 + Retry-After forever: no tokens-per-minute window holds 100 + prompt.
    small = create_tenant(gateways[0], {"tokensPerMinute": 50}, prefix="tpm")
    with httpx.Client(base_url=gateways[0].url, timeout=30) as c:
        response = post(c, small, completion_body(max_tokens=100))
        fitting = post(c, small, completion_body(max_tokens=4))
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["code"], error["param"]) == ("exceeds_token_limit", "max_tokens")
    assert "tokens-per-minute limit is 50" in error["message"]
    assert fitting.status_code == 200, fitting.text


@pytest.mark.adversarial
@pytest.mark.parametrize("field, value", [("logprobs", 2), ("echo", True), ("suffix", "end")])
def test_openai_fields_tessera_does_not_serve_are_400_by_name(client: httpx.Client, tenant: TenantHandle,
                                                              field: str, value: object) -> None:
    response = post(client, tenant, completion_body(**{field: value}))
    assert response.status_code == 400, response.text
    assert (error_of(response)["code"], error_of(response)["param"]) == ("unsupported_field", field)


@pytest.mark.parametrize("raw", [b"{", b"not json", b"[1, 2]", b"", b'{"model": "m",}'])
def test_malformed_json_is_400(client: httpx.Client, tenant: TenantHandle, raw: bytes) -> None:
    response = post(client, tenant, raw)
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion_body(max_tokens="many"), "max_tokens"),
    ("/v1/completions", completion_body(prompt={"text": "hi"}), "prompt"),
    ("/v1/completions", completion_body(stream="yes"), "stream"),
    ("/v1/completions", completion_body(temperature=[1]), "temperature"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "nobody", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                             "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
])
def test_wrong_types_are_400_naming_the_field(client: httpx.Client, tenant: TenantHandle, path: str,
                                              body: dict[str, Any], param: str) -> None:
    response = post(client, tenant, body, path)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and param in error["message"]


@pytest.mark.adversarial
async def test_a_model_record_the_gateway_cannot_load_is_503_and_every_other_model_still_serves(
        client: httpx.Client, tenant: TenantHandle, tenancy_redis: RestartableRedis, tmp_path: Path) -> None:
    # What one engine with a wrong tokenizer path registers (or a test's fleet left in a shared Redis): until the
    # catalog skipped such a record, every refresh raised and every request to the gateway, any model, was a 500.
    redis = connect(tenancy_redis.url, timeout_s=5.0)
    broken, missing = "tenancy-broken-tokenizer", str(tmp_path / "no-such-tokenizer")
    await register_model(redis, ModelInfo(broken, missing, 1024, 32))
    try:
        deadline = time.monotonic() + 10
        while (response := post(client, tenant, {**completion_body(), "model": broken})).status_code == 404:
            assert time.monotonic() < deadline, "the catalog never read the new record"  # refreshed every second
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert (error["code"], error["param"]) == ("model_unavailable", "model")
        assert broken in error["message"] and missing not in response.text  # the path is for the operator's log
        served = post(client, tenant, completion_body())
        assert served.status_code == 200, served.text
        assert post(client, tenant, {**completion_body(), "model": "no-such-model"}).status_code == 404
    finally:
        await redis.hdel(MODELS_HASH, broken)
        await redis.aclose()


def test_unknown_model_is_404(client: httpx.Client, tenant: TenantHandle) -> None:
    response = post(client, tenant, {**completion_body(), "model": "no-such-model"})
    assert response.status_code == 404
    assert (error_of(response)["code"], error_of(response)["param"]) == ("model_not_found", "model")


def test_model_not_allowed_is_403(client: httpx.Client, tenant: TenantHandle, other_model: None) -> None:
    response = post(client, tenant, {**completion_body(), "model": OTHER_MODEL})
    assert response.status_code == 403
    assert error_of(response)["code"] == "model_not_allowed"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer tsk-0123456789ab-nope"},
                                     {"authorization": "Basic Zm9vOmJhcg=="}, {"authorization": "Bearer"}])
def test_no_valid_key_is_401_for_every_route(client: httpx.Client, headers: dict[str, str]) -> None:
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/v1/usage")]:
        response = client.request(method, path, json=completion_body(), headers=headers)
        assert response.status_code == 401, (method, path)
        assert error_of(response)["type"] == "authentication_error"


def test_a_tenant_sees_only_its_own_models(client: httpx.Client, tenant: TenantHandle, other_model: None,
                                           gateways: list[GatewayProcess]) -> None:
    unrestricted = create_tenant(gateways[0], prefix="all-models")
    mine = client.get("/v1/models", headers=tenant.headers).json()
    everything = client.get("/v1/models", headers=unrestricted.headers).json()
    assert [m["id"] for m in mine["data"]] == [MODEL]
    assert {MODEL, OTHER_MODEL} <= {m["id"] for m in everything["data"]}


def test_the_tokenizer_of_a_model_the_key_may_use(client: httpx.Client, tenant: TenantHandle, other_model: None,
                                                  tenancy_engine: EngineHost) -> None:
    """GET /v1/models/{model}/tokenizer: what the gateway counts prompts with, so a load generator can build
    prompts of exact token lengths; 404 for a model this key may not use, 401 without a key."""
    from tokenizers import Tokenizer

    response = client.get(f"/v1/models/{MODEL}/tokenizer", headers=tenant.headers)
    assert response.status_code == 200
    document = response.json()
    assert document["model"] == MODEL and document["max_model_len"] == tenancy_engine.config.max_model_len
    served = Tokenizer.from_file(f"{tenancy_engine.config.tokenizer_path}/tokenizer.json")
    fetched = Tokenizer.from_str(json.dumps(document["tokenizer"]))
    text = "The quick brown fox jumps over the lazy dog, 12345 times."
    assert fetched.encode(text).ids == served.encode(text).ids
    assert {"chat_template", "bos_token", "eos_token"} <= set(document)
    hidden = client.get(f"/v1/models/{OTHER_MODEL}/tokenizer", headers=tenant.headers)
    assert hidden.status_code == 404 and error_of(hidden)["code"] == "model_not_found"
    assert client.get("/v1/models/nope/tokenizer", headers=tenant.headers).status_code == 404
    assert client.get(f"/v1/models/{MODEL}/tokenizer").status_code == 401


def test_a_tenant_sees_only_its_own_usage(client: httpx.Client, gateways: list[GatewayProcess]) -> None:
    first, second = create_tenant(gateways[0], prefix="usage-a"), create_tenant(gateways[0], prefix="usage-b")
    for _ in range(2):
        assert post(client, first, completion_body(max_tokens=2)).status_code == 200
    assert post(client, second, completion_body(max_tokens=3)).status_code == 200
    # A query naming another tenant changes nothing: the key decides whose usage this is.
    mine = client.get("/v1/usage", params={"period": "hour", "tenant": second.name}, headers=first.headers)
    theirs = client.get("/v1/usage", params={"period": "hour"}, headers=second.headers)
    assert mine.status_code == 200 and theirs.status_code == 200
    assert (mine.json()["tenant"], mine.json()["requests"], mine.json()["completion_tokens"]) == (first.name, 2, 4)
    assert (theirs.json()["tenant"], theirs.json()["requests"], theirs.json()["completion_tokens"]) == (
        second.name, 1, 3)
    bad = client.get("/v1/usage", params={"period": "week"}, headers=first.headers)
    assert bad.status_code == 400 and error_of(bad)["param"] == "period"


def test_rejected_requests_never_reach_the_engine(client: httpx.Client, tenancy_engine: EngineHost,
                                                  gateways: list[GatewayProcess]) -> None:
    quiet = create_tenant(gateways[0], {"maxTokensCap": 1}, prefix="quiet")
    before = httpx.get(f"{tenancy_engine.url}/stats", auth=ENGINE_AUTH).json()
    for body in [completion_body(max_tokens=5), completion_body(prompt=5), {**completion_body(), "model": "x"}]:
        assert post(client, quiet, body).status_code in (400, 404)
    after = httpx.get(f"{tenancy_engine.url}/stats", auth=ENGINE_AUTH).json()
    # Every scheduled prompt is looked up in the prefix cache: no lookup, no engine work.
    assert after["prefix_queries"] == before["prefix_queries"]
