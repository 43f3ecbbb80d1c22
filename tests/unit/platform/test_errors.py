from __future__ import annotations

import orjson

from tessera.gateway.errors import APIError, bad_request, error_body, unauthorized


def test_error_body_is_openai_shaped() -> None:
    body = orjson.loads(error_body("boom", "invalid_request_error", "bad", "model"))
    assert body == {"error": {"message": "boom", "type": "invalid_request_error", "code": "bad", "param": "model"}}


def test_status_maps_to_openai_type() -> None:
    assert unauthorized().status == 401 and unauthorized().type == "authentication_error"
    assert bad_request("x").type == "invalid_request_error"
    assert APIError(429, "slow down", "requests_per_minute").type == "rate_limit_error"
    assert APIError(403, "no", "model_not_allowed").type == "permission_error"
    assert APIError(404, "no", "model_not_found").type == "not_found_error"
    assert APIError(503, "down", "store_unavailable").type == "service_unavailable"


def test_retry_after_travels_in_headers() -> None:
    err = APIError(429, "slow down", "requests_per_minute", headers={"Retry-After": "7"})
    assert err.headers["Retry-After"] == "7"
    assert orjson.loads(err.body())["error"]["code"] == "requests_per_minute"
