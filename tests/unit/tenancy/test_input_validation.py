"""Request bodies and tenant limits, decided before any engine work (pure: no Redis, no engine)."""

from __future__ import annotations

import orjson
import pytest

from tessera.gateway.errors import APIError, field_param
from tessera.gateway.models import ServedModel
from tessera.gateway.request.endpoint import CHAT, COMPLETIONS, Endpoint, OpenAIRequest
from tessera.gateway.request.parse import parse_body
from tessera.gateway.request.prompt import check_limits
from tessera.registry import ModelInfo
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import Tenant

MODEL = ServedModel(ModelInfo("m", "/nowhere", max_model_len=256, block_size=32), None, None, "", "")


def tenant(**policy: object) -> Tenant:
    return Tenant("t", TenantPolicy.model_validate(policy), "salt", 0.0)


def parse_request(chat: bool, raw: bytes) -> OpenAIRequest:
    endpoint: Endpoint = CHAT if chat else COMPLETIONS
    return parse_body(endpoint, raw)


def parse_error(chat: bool, body: object) -> APIError:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(APIError) as info:
        parse_request(chat, raw)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b"\xff\xfe", b'{"model": "m",}'])
def test_malformed_json_is_400_invalid_json(raw: bytes) -> None:
    assert parse_error(False, raw).code == "invalid_json"


@pytest.mark.parametrize("body", [[], "text", 3, None])
def test_non_object_body_is_400(body: object) -> None:
    assert parse_error(True, body).code == "invalid_json"


@pytest.mark.parametrize("chat, body, param", [
    (False, {"model": "m", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    (False, {"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    (False, {"model": "m", "prompt": 5}, "prompt"),
    (False, {"model": "m", "prompt": ["a", "b"]}, "prompt"),
    (False, {"model": "m", "prompt": []}, "prompt"),
    (False, {"model": "m"}, "prompt"),
    (False, {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    (False, {"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    (False, {"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    (False, {"model": "m", "prompt": "x", "n": 0}, "n"),
    (False, {"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop"),
    (False, {"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (False, {"model": "m", "prompt": "x", "seed": 2**63}, "seed"),
    (False, {"model": 7, "prompt": "x"}, "model"),
    (False, {"prompt": "x"}, "model"),
    (True, {"model": "m", "messages": []}, "messages"),
    (True, {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (True, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (True, {"model": "m", "messages": "hi"}, "messages"),
    (True, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
])
def test_wrong_types_are_400_naming_the_field(chat: bool, body: dict[str, object], param: str) -> None:
    err = parse_error(chat, body)
    assert err.param == param
    assert param in err.message
    error = orjson.loads(err.body())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_unknown_fields_are_ignored() -> None:
    # Fields that change nothing in the answer (an answer-changing one is refused: see below).
    req = parse_request(False, orjson.dumps({"model": "m", "prompt": "x", "metadata": {"team": "a"}, "store": False}))
    assert req.model == "m"


@pytest.mark.parametrize("loc, param", [
    (("prompt", "str"), "prompt"),
    (("prompt", "list[int]", 3), "prompt[3]"),
    (("prompt", "function-after[_single_prompt(), union[str,list[int],list[str]]]"), "prompt"),
    (("messages", 0, "content", "list[dict[str,any]]", 1), "messages[0].content[1]"),
    ((), None),
])
def test_field_param_drops_pydantic_union_tags(loc: tuple[int | str, ...], param: str | None) -> None:
    assert field_param(loc) == param


def completion(**fields: object) -> object:
    return parse_request(False, orjson.dumps({"model": "m", "prompt": "x", **fields}))


def limit_error(req: object, tenant_: Tenant, num_prompt: int) -> APIError:
    with pytest.raises(APIError) as info:
        check_limits(COMPLETIONS, req, tenant_, MODEL, num_prompt)  # type: ignore[arg-type]
    assert info.value.status == 400
    return info.value


def test_max_tokens_over_the_tenant_cap_is_400() -> None:
    err = limit_error(completion(max_tokens=65), tenant(max_tokens_cap=64), 10)
    assert (err.code, err.param) == ("max_tokens_too_large", "max_tokens")
    assert check_limits(COMPLETIONS, completion(max_tokens=64), tenant(max_tokens_cap=64), MODEL, 10) == 64  # type: ignore[arg-type]


def test_n_over_the_tenant_cap_is_400() -> None:
    err = limit_error(completion(n=3, temperature=1.0), tenant(max_n=2), 10)
    assert (err.code, err.param) == ("n_too_large", "n")


def test_n_above_one_needs_sampling() -> None:
    err = limit_error(completion(n=2, temperature=0), tenant(max_n=2), 10)
    assert err.param == "n"


def test_prompt_over_the_tenant_limit_is_400() -> None:
    err = limit_error(completion(max_tokens=1), tenant(max_prompt_tokens=20), 21)
    assert (err.code, err.param) == ("prompt_too_long", "prompt")


def test_prompt_over_the_model_context_is_400() -> None:
    err = limit_error(completion(max_tokens=1), tenant(), 256)
    assert err.code == "context_length_exceeded"
    err = limit_error(completion(max_tokens=50), tenant(), 220)
    assert (err.code, err.param) == ("context_length_exceeded", "max_tokens")


def test_default_max_tokens_fits_cap_and_context() -> None:
    req = parse_request(True, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert check_limits(CHAT, req, tenant(max_tokens_cap=1000), MODEL, 200) == 56
    assert check_limits(CHAT, req, tenant(max_tokens_cap=8), MODEL, 200) == 8


def test_a_request_no_tokens_per_minute_window_can_hold_is_400_naming_the_limit() -> None:
    err = limit_error(completion(max_tokens=50, n=2, temperature=1.0), tenant(tokens_per_minute=100, max_n=2), 10)
    assert (err.code, err.param) == ("exceeds_token_limit", "max_tokens")
    assert "tokens-per-minute limit is 100" in err.message and "110" in err.message
    assert check_limits(COMPLETIONS, completion(max_tokens=45, n=2, temperature=1.0),  # type: ignore[arg-type]
                        tenant(tokens_per_minute=100, max_n=2), MODEL, 10) == 45


def test_the_smaller_of_rate_and_budget_bounds_a_request() -> None:
    err = limit_error(completion(max_tokens=60), tenant(tokens_per_minute=1000, token_budget=50,
                                                        budget_period="day"), 10)
    assert err.code == "exceeds_token_limit" and "token budget per day is 50" in err.message
    prompt_alone = limit_error(completion(), tenant(token_budget=50), 60)
    assert (prompt_alone.code, prompt_alone.param) == ("exceeds_token_limit", "prompt")


def test_left_out_max_tokens_becomes_what_fits_the_limit() -> None:
    chat = parse_request(True, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert check_limits(CHAT, chat, tenant(tokens_per_minute=40), MODEL, 10) == 30
    assert check_limits(CHAT, chat, tenant(), MODEL, 10) == 246  # the model's context, as before


@pytest.mark.parametrize("field, value", [
    ("logprobs", True), ("top_logprobs", 5), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("response_format", {"type": "json_object"}), ("logit_bias", {"50": 10}),
    ("presence_penalty", 0.5), ("echo", True), ("best_of", 3),
])
def test_fields_tessera_does_not_serve_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(APIError) as info:
        parse_request(True, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          field: value}))
    assert (info.value.status, info.value.code, info.value.param) == (400, "unsupported_field", field)


@pytest.mark.parametrize("fields", [
    {"logprobs": False}, {"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
    {"presence_penalty": 0}, {"logit_bias": None}, {"best_of": 1}, {"parallel_tool_calls": True},
    {"some_client_extension": 1},
])
def test_their_off_values_and_unknown_fields_pass(fields: dict[str, object]) -> None:
    assert parse_request(False, orjson.dumps({"model": "m", "prompt": "x", **fields})).model == "m"
