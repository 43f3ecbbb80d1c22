"""Request identity belongs to the gateway: a tenant that sends another tenant's ``X-Request-Id`` and leaves
mid-stream does not cut that tenant's stream short (vLLM aborts every request sharing an id; the gateway
gives each engine request an id of its own and keeps the client's as a label)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tessera.local.platform import LocalPlatform
from tests.support.data_plane import ENGINE_AUTH
from tests.support.poll import wait_until

SHARED_ID = "the-same-id-for-everyone"
VICTIM_TOKENS = 400


@pytest.mark.adversarial
def test_a_tenant_reusing_anothers_request_id_cannot_cut_its_stream(platform_stack: LocalPlatform,
                                                                     engine_url: str) -> None:
    victim_key = asyncio.run(platform_stack.create_tenant("e2e-victim"))
    attacker_key = asyncio.run(platform_stack.create_tenant("e2e-attacker"))
    url = f"{platform_stack.base_url}/v1/chat/completions"
    body = {"model": platform_stack.model, "messages": [{"role": "user", "content": "count with me"}],
            "max_tokens": VICTIM_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    echoed: list[str] = []

    def victim() -> None:
        headers = {"Authorization": f"Bearer {victim_key}", "x-request-id": SHARED_ID}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
            echoed.append(response.headers["x-request-id"])
            events.extend(line for line in response.iter_lines() if line.startswith("data: "))

    running = threading.Thread(target=victim)
    running.start()
    wait_until(lambda: any(r["tenant"] == "e2e-victim"
                           for r in httpx.get(f"{engine_url}/requests", auth=ENGINE_AUTH).json()),
               timeout_s=60, what="the victim's request running in the engine")
    attacker = {"Authorization": f"Bearer {attacker_key}", "x-request-id": SHARED_ID}
    with httpx.stream("POST", url, json={**body, "max_tokens": 64}, headers=attacker, timeout=60) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    # The attacker left mid-stream: its own engine request is aborted, the victim's runs on.
    running.join(120)
    assert echoed == [SHARED_ID]  # the client's id is still echoed as its label
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(events)
    assert f'"completion_tokens":{VICTIM_TOKENS}' in events[-2], events[-2]
