"""schemathesis over the gateway's own /openapi.json, against the running platform (bounded examples).

No generated request may get a 5xx, and none may succeed without a key. The ``model`` field is pinned to
the served model for the keyed run, so generated requests get past the model lookup to the limits,
admission, the engine and back (the tenant's caps keep the engine work tiny).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tessera.local.platform import LocalPlatform
from tessera.tenancy.policy import TenantPolicy

MAX_EXAMPLES = 20
FUZZ_POLICY = TenantPolicy(max_tokens_cap=16, max_prompt_tokens=96, max_n=2)


@pytest.fixture(scope="module")
def document(platform_stack: LocalPlatform) -> dict[str, Any]:
    response = httpx.get(f"{platform_stack.base_url}/openapi.json", timeout=10)
    assert response.status_code == 200
    return dict(response.json())


@pytest.fixture(scope="module")
def fuzz_key(platform_stack: LocalPlatform) -> str:
    return asyncio.run(platform_stack.create_tenant("e2e-fuzz", FUZZ_POLICY))


def pinned_model(document: dict[str, Any], model: str) -> dict[str, Any]:
    pinned = copy.deepcopy(document)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        pinned["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [model]}
    return pinned


def fuzz(schema: Any, base_url: str, headers: dict[str, str], modes: list[GenerationMode],
         check: Callable[[Any, httpx.Response], None]) -> int:
    """Runs every operation of ``schema`` for MAX_EXAMPLES examples per mode; returns the number of calls."""
    calls = 0
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in modes:
                @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def run(case: Any) -> None:
                    nonlocal calls
                    kwargs = case.as_transport_kwargs(base_url=base_url)
                    sent = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "authorization"}
                    response = client.request(kwargs["method"], kwargs["url"], params=kwargs.get("params"),
                                              headers={**sent, **headers}, content=kwargs.get("data"),
                                              json=kwargs.get("json"))
                    calls += 1
                    check(case, response)

                run()
    return calls


def describe(case: Any, response: httpx.Response) -> str:
    return f"{case.method} {case.path} body={str(case.body)[:300]!r} -> {response.status_code} {response.text[:300]}"


def test_no_request_succeeds_without_a_key(platform_stack: LocalPlatform, document: dict[str, Any]) -> None:
    def check(case: Any, response: httpx.Response) -> None:
        assert response.status_code in (401, 413), describe(case, response)

    for headers in ({}, {"authorization": "Bearer tsk-0123456789ab-guess"}):
        schema = schemathesis.openapi.from_dict(pinned_model(document, platform_stack.model))
        assert fuzz(schema, platform_stack.base_url, headers, [GenerationMode.POSITIVE], check) > 0


def test_no_generated_request_gets_a_server_error(platform_stack: LocalPlatform, document: dict[str, Any],
                                                  fuzz_key: str) -> None:
    statuses: set[tuple[str, int]] = set()

    def check(case: Any, response: httpx.Response) -> None:
        assert response.status_code < 500, describe(case, response)
        statuses.add((case.path, response.status_code))

    headers = {"authorization": f"Bearer {fuzz_key}"}
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    fuzz(schemathesis.openapi.from_dict(document), platform_stack.base_url, headers, modes, check)
    fuzz(schemathesis.openapi.from_dict(pinned_model(document, platform_stack.model)), platform_stack.base_url,
         headers, modes, check)
    # Generated requests were both served by the engine and refused by validation or limits.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert (path, 200) in statuses and (path, 400) in statuses, statuses
