"""A replica runs one request per id: a second request under the id of a running one is refused (409) before
any work, and the running one is not cut short. vLLM aborts every request sharing an id and the replica keys
its in-flight table by it, so without the check a caller reusing an id truncates another caller's stream."""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest

from tessera.engine.host import EngineHost
from tests.support.data_plane import ENGINE_AUTH
from tests.support.poll import wait_until

pytestmark = pytest.mark.engine


def test_a_running_requests_id_is_refused_and_the_running_request_finishes(fp8_engine: EngineHost) -> None:
    request_id = f"shared-{time.monotonic_ns()}"
    body = {"request_id": request_id, "prompt_token_ids": list(range(100, 164)), "max_tokens": 300,
            "temperature": 0.0, "ignore_eos": True}
    lines: list[dict] = []

    def first() -> None:
        with httpx.stream("POST", f"{fp8_engine.url}/generate", json=body, timeout=60, auth=ENGINE_AUTH) as response:
            lines.extend(orjson.loads(line) for line in response.iter_lines() if line)

    runner = threading.Thread(target=first)
    runner.start()
    wait_until(lambda: any(r["request_id"] == request_id
                           for r in httpx.get(f"{fp8_engine.url}/requests", auth=ENGINE_AUTH).json()),
               timeout_s=30, what="the first request running")
    second = httpx.post(f"{fp8_engine.url}/generate", json={**body, "max_tokens": 1}, timeout=30, auth=ENGINE_AUTH)
    assert second.status_code == 409 and "already running" in second.json()["error"]
    runner.join(60)
    assert lines[-1].get("done") is True, lines[-1]
    assert lines[-1]["finish"] == {"0": "length"} and lines[-1]["stats"]["num_output_tokens"] == 300
