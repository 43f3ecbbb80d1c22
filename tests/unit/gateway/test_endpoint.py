"""The endpoint kinds: what differs between chat and completions lives in the ``Endpoint``, not a flag."""

from __future__ import annotations

import orjson
import pytest

from tessera.gateway.errors import APIError
from tessera.gateway.request.endpoint import CHAT, COMPLETIONS, ENDPOINTS
from tessera.gateway.request.parse import parse_body
from tessera.gateway.request.respond_stream import error_event
from tessera.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tessera.routing.pod_in_flight import PodInFlight
from tessera.routing.pod_view import PodEngines
from tessera.routing.router import InFlight


def test_each_path_has_its_kind() -> None:
    assert ENDPOINTS == {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}
    chat = parse_body(CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          "max_completion_tokens": 7, "n": 2}))
    assert isinstance(chat, ChatCompletionRequest) and CHAT.requested_max_tokens(chat) == 7
    assert CHAT.role_choices(2) == 2 and CHAT.prompt_param == "messages"
    completion = parse_body(COMPLETIONS, orjson.dumps({"model": "m", "prompt": "x"}))
    assert isinstance(completion, CompletionRequest) and COMPLETIONS.requested_max_tokens(completion) == 16
    assert COMPLETIONS.role_choices(2) == 0 and COMPLETIONS.prompt_param == "prompt"


def test_the_writers_frame_each_kind() -> None:
    chat = CHAT.chunk_writer("chatcmpl-1", "m", 0).text(0, "hi")
    completion = COMPLETIONS.chunk_writer("cmpl-1", "m", 0).text(0, "hi")
    assert b'"object":"chat.completion.chunk"' in chat and b'"delta":{"content":"hi"}' in chat
    assert b'"object":"text_completion"' in completion and b'"text":"hi"' in completion


def test_the_mid_stream_error_event_carries_the_error_body() -> None:
    event = error_event(APIError(502, "engine went away", "engine_error"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:]) == {"error": {"message": "engine went away", "type": "upstream_error",
                                                 "code": "engine_error", "param": None}}


def test_in_flight_counts_until_the_block_ends_even_when_it_raises() -> None:
    loads = PodInFlight.private()
    engines = PodEngines(["a", "b"])

    def counts() -> tuple[dict[str, int], dict[str, int]]:
        requests, tokens, _ = loads.totals(engines, 0.0)
        return dict(requests), dict(tokens)

    with InFlight(loads, "a"):
        with InFlight(loads, "a", 100):
            assert counts() == ({"a": 2}, {"a": 100})
        assert counts() == ({"a": 1}, {})
    assert counts() == ({}, {})
    with pytest.raises(ValueError), InFlight(loads, "b", 100):
        raise ValueError("engine failed")
    assert counts() == ({}, {})
