"""The replica's routes refuse every call not signed with the data-plane key, before any work: no
generation starts, nothing is listed or aborted, and the body is not even parsed. /health stays open;
/metrics also opens to the scrape token, and nothing else does."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from tessera.data_plane_auth import SIGNATURE_HEADER, Signer
from tests.unit.platform.test_engine_endpoints import FakeEngine, call, generate_body, make

ATTACK = generate_body(request_id="other-tenant/1", priority=-1000)


class CountingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__([7, 8, 9])
        self.generated: list[str] = []

    async def generate(self, prompt, params, request_id, priority=0):  # type: ignore[no-untyped-def,override]
        self.generated.append(request_id)
        async for output in super().generate(prompt, params, request_id, priority):
            yield output


def signature(method: str, path: str, body: bytes = b"", key: bytes = b"k" * 32) -> list[tuple[bytes, bytes]]:
    return [(SIGNATURE_HEADER.encode(), Signer(key).sign(method, path, body).encode())]


@pytest.mark.adversarial
async def test_unsigned_calls_are_401_and_the_engine_does_nothing() -> None:
    engine = CountingEngine()
    endpoints, in_flight, _ = make(engine)
    generate = await call(endpoints, "POST", "/generate", ATTACK, signed=False)
    assert generate.status == 401 and generate.json()["error"].startswith("missing x-tessera-signature header")
    assert generate.headers[b"www-authenticate"].startswith(b"Tessera-Signature")
    assert (await call(endpoints, "GET", "/requests", signed=False)).status == 401
    aborted = await call(endpoints, "POST", "/abort", orjson.dumps({"request_id": "r1"}), signed=False)
    assert aborted.status == 401
    assert (await call(endpoints, "GET", "/stats", signed=False)).status == 401
    assert (await call(endpoints, "GET", "/metrics", signed=False)).status == 401
    assert engine.generated == [] and engine.aborted == [] and len(in_flight) == 0


@pytest.mark.adversarial
# Signed when the test runs, not at collection: a signature made then is stale by the time a late test runs.
@pytest.mark.parametrize("sign", [
    lambda: signature("POST", "/generate", generate_body(request_id="other-tenant/1")),  # signed another body
    lambda: signature("POST", "/generate", ATTACK, key=b"a guessed key, thirty-two chars!"),
    lambda: signature("POST", "/abort", ATTACK),  # signed for another route
], ids=["another-body", "another-key", "another-route"])
async def test_a_signature_for_another_call_or_key_is_401(sign: Callable[[], list[tuple[bytes, bytes]]]) -> None:
    engine = CountingEngine()
    endpoints, in_flight, _ = make(engine)
    response = await call(endpoints, "POST", "/generate", ATTACK, headers=sign(), signed=False)
    assert response.status == 401 and "does not match this call" in response.json()["error"]
    assert engine.generated == [] and len(in_flight) == 0


@pytest.mark.adversarial
async def test_the_mac_is_checked_before_the_body_is_parsed() -> None:
    endpoints, _, _ = make()
    forged = [(SIGNATURE_HEADER.encode(), Signer(b"k" * 32).sign("POST", "/generate", b"").encode())]
    response = await call(endpoints, "POST", "/generate", b"{not json", headers=forged, signed=False)
    assert response.status == 401  # not the 400 a parser would give


@pytest.mark.adversarial
async def test_a_replayed_generate_is_401() -> None:
    engine = CountingEngine()
    endpoints, _, _ = make(engine)
    headers = signature("POST", "/generate", generate_body())
    assert (await call(endpoints, "POST", "/generate", generate_body(), headers=headers, signed=False)).status == 200
    again = await call(endpoints, "POST", "/generate", generate_body(), headers=headers, signed=False)
    assert again.status == 401 and "used already" in again.json()["error"]
    assert engine.generated == ["r1"]


@pytest.mark.adversarial
async def test_health_is_open_and_the_scrape_token_opens_metrics_only() -> None:
    endpoints, _, _ = make()
    assert (await call(endpoints, "GET", "/health", signed=False)).status == 200
    bearer = [(b"authorization", b"Bearer " + b"m" * 32)]
    metrics = await call(endpoints, "GET", "/metrics", headers=bearer, signed=False)
    assert metrics.status == 200 and b"tessera_engine_" in metrics.body
    assert (await call(endpoints, "GET", "/stats", headers=bearer, signed=False)).status == 401
    assert (await call(endpoints, "GET", "/requests", headers=bearer, signed=False)).status == 401
