"""The per-token path against the real replica (vLLM on CPU, the session's ``fp8_engine``): the chunks its HTTP
server writes while a generation streams are ones the per-token step takes (gateway/delta_chunk.py). A replica
whose framing or line shape drifted from what ``split_delta_chunk`` accepts would still be served correctly, by
the batched path, so only this test would notice that every token had gone the slow way."""

from __future__ import annotations

import orjson
import pytest

from tessera.engine.host import EngineHost
from tessera.engine.protocol import Delta
from tessera.gateway import engine_client
from tessera.gateway.engine_client import EngineClient, StreamResult
from tests.support.data_plane import session_signer

pytestmark = [pytest.mark.engine]
MAX_TOKENS = 24


@pytest.mark.asyncio
async def test_the_replicas_own_chunks_take_the_per_token_path_and_every_token_is_billed_once(
        fp8_engine: EngineHost, monkeypatch: pytest.MonkeyPatch) -> None:
    offered: list[bool] = []  # per read offered to the step: taken or not
    step = engine_client.split_delta_chunk

    def counting_step(data: bytes, head: bytes, tail: bytes) -> tuple[bytes, list[int]] | None:
        split = step(data, head, tail)
        offered.append(split is not None)
        return split

    monkeypatch.setattr(engine_client, "split_delta_chunk", counting_step)
    per_token: list[str] = []
    batched: list[str] = []

    class ClientSide:  # a ChunkSink whose chunks hold the text as a JSON array: [<text>]
        text_frame = (b"[", b"]")

        def write_now(self, framed: bytes) -> bool:
            if not framed:  # an empty text: nothing to write
                per_token.append("")
                return True
            size, _, chunk = framed.partition(b"\r\n")
            assert len(chunk) == int(size, 16) + 2 and chunk.endswith(b"\r\n")
            per_token.append(orjson.loads(chunk[:-2])[0])
            return True

    def on_deltas(deltas: list[Delta], last: bool) -> None:
        batched.extend(d.text for d in deltas)

    result = StreamResult()
    client = EngineClient(signer=session_signer())
    try:
        await client.relay([(fp8_engine.engine_id, fp8_engine.url)],
                           {"request_id": "per-token/r1", "prompt_token_ids": list(range(100, 164)),
                            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
                           {"x-tessera-tenant": "per-token"}, result, on_deltas, ClientSide())
    finally:
        await client.close()
    assert result.completion_tokens == MAX_TOKENS and result.finish == {0: "length"}
    assert any(offered), "no read of the replica's stream took the per-token path"
    assert len(per_token) == sum(offered) and batched, "the first delta goes batched, the rest per token"
