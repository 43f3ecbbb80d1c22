"""The real replica (vLLM on CPU) refuses every caller without the data-plane key, before any work, and
listens on the address it registers only (issue #15). Played against the session's ``fp8_engine``.

"Nothing ran" is read from the engine itself: its ``generate`` and ``abort`` are wrapped to record every
request id the replica hands them, so a refused call that reached vLLM would show there."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tessera.engine.host import EngineHost
from tests.support.data_plane import ENGINE_AUTH, signed_headers
from tests.support.poll import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.adversarial]


class EngineSpy:
    """Records the request ids the replica passes to vLLM's ``generate`` and ``abort``."""

    def __init__(self, engine: Any) -> None:
        self.generated: list[str] = []
        self.aborted: list[str] = []
        self._generate, self._abort = engine.generate, engine.abort

    def generate(self, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        self.generated.append(request_id)
        return self._generate(prompt, params, request_id, *args, **kwargs)

    async def abort(self, request_id: Any, *args: Any, **kwargs: Any) -> Any:
        self.aborted.append(request_id)
        return await self._abort(request_id, *args, **kwargs)


@pytest.fixture
def spy(fp8_engine: EngineHost, monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineSpy]:
    watcher = EngineSpy(fp8_engine.engine)
    monkeypatch.setattr(fp8_engine.engine, "generate", watcher.generate)
    monkeypatch.setattr(fp8_engine.engine, "abort", watcher.abort)
    yield watcher


def body(request_id: str, **fields: object) -> dict[str, object]:
    return {"request_id": request_id, "prompt_token_ids": list(range(100, 164)), "max_tokens": 2,
            "temperature": 0.0, **fields}


def test_unsigned_generate_with_top_priority_is_401_and_never_reaches_vllm(fp8_engine: EngineHost,
                                                                           spy: EngineSpy) -> None:
    attack = body("mallory/jump-the-queue", priority=-1000)
    refused = httpx.post(f"{fp8_engine.url}/generate", json=attack, headers={"x-tessera-tenant": "mallory"},
                         timeout=30)
    assert refused.status_code == 401 and "x-tessera-signature" in refused.json()["error"]
    forged = httpx.post(f"{fp8_engine.url}/generate", content=orjson.dumps(attack), timeout=30,
                        headers={"x-tessera-signature": signed_headers("POST", "/generate", b"{}")[
                            "x-tessera-signature"]})
    assert forged.status_code == 401 and "does not match" in forged.json()["error"]
    # The replica serves requests in order on one loop: a signed request that ran after the refused ones shows
    # vLLM got that one and nothing before it.
    signed = httpx.post(f"{fp8_engine.url}/generate", json=body(f"gateway/{time.monotonic_ns()}"), timeout=60,
                        auth=ENGINE_AUTH)
    assert signed.status_code == 200 and orjson.loads(signed.text.splitlines()[-1])["done"] is True
    assert [rid for rid in spy.generated if "mallory" in rid] == [] and len(spy.generated) == 1


def test_unsigned_listing_and_abort_are_401_and_the_victim_runs_to_its_end(fp8_engine: EngineHost,
                                                                           spy: EngineSpy) -> None:
    victim = f"victim/{time.monotonic_ns()}"
    lines: list[bytes] = []

    def run_victim() -> None:
        with httpx.stream("POST", f"{fp8_engine.url}/generate", json=body(victim, max_tokens=48), timeout=120,
                          headers={"x-tessera-tenant": "victim"}, auth=ENGINE_AUTH) as response:
            lines.extend(line.encode() for line in response.iter_lines() if line)

    runner = threading.Thread(target=run_victim)
    runner.start()
    try:
        wait_until(lambda: any(r["request_id"] == victim for r in
                               httpx.get(f"{fp8_engine.url}/requests", auth=ENGINE_AUTH, timeout=10).json()),
                   timeout_s=60, what="the victim's request running")
        listing = httpx.get(f"{fp8_engine.url}/requests", timeout=10)
        assert listing.status_code == 401 and victim.encode() not in listing.content
        assert b"victim" not in listing.content
        abort = httpx.post(f"{fp8_engine.url}/abort", json={"request_id": victim, "reason": "mallory"}, timeout=10)
        assert abort.status_code == 401
        assert httpx.get(f"{fp8_engine.url}/stats", timeout=10).status_code == 401
    finally:
        runner.join(timeout=120)
    done = orjson.loads(lines[-1])
    assert done["done"] is True and done["finish"] == {"0": "length"} and spy.aborted == []


def _listeners(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (this network namespace, any process:
    vLLM's engine process binds the KV-event socket)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(_ipv4(address) if width == 8 else address)
    return found


def _ipv4(little_endian_hex: str) -> str:
    return ".".join(str(b) for b in reversed(bytes.fromhex(little_endian_hex)))


def test_the_replica_and_its_kv_events_listen_on_loopback_only(fp8_engine: EngineHost) -> None:
    # The fixture's replica registers 127.0.0.1 (TESSERA_ADVERTISE_HOST's default, as under `tessera up`).
    assert fp8_engine.advertise_host == "127.0.0.1"
    assert _listeners(fp8_engine.port) == {"127.0.0.1"}
    assert fp8_engine.kv_events_port and _listeners(fp8_engine.kv_events_port) == {"127.0.0.1"}
