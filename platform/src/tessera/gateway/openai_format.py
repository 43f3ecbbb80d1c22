"""OpenAI response shapes. Stream chunks are assembled from pre-encoded byte templates: the gateway's
per-chunk cost is one ``orjson.dumps`` of the text and two concatenations (see ``make bench-gateway``)."""

from __future__ import annotations

from typing import Any

import orjson


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class ChunkWriter:
    """SSE framing for one request (``chat`` or ``completion``)."""

    def __init__(self, chat: bool, response_id: str, model: str, created: int) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = orjson.dumps({"id": response_id, "object": obj, "created": created, "model": model})[:-1]
        self._head = b"data: " + head + b',"choices":[{"index":'
        self._text_key = b',"delta":{"content":' if chat else b',"text":'
        self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n' if chat else \
            b',"logprobs":null,"finish_reason":null}]}\n\n'
        self._usage_head = b"data: " + head + b',"choices":[],"usage":'
        self._text_heads: dict[int, bytes] = {}  # choice index -> the bytes before its text, made once

    def role(self, index: int) -> bytes:
        return self._head + str(index).encode() + b',"delta":{"role":"assistant","content":""},' \
            b'"logprobs":null,"finish_reason":null}]}\n\n'

    def text(self, index: int, text: str) -> bytes:
        head, tail = self.text_frame(index)
        return head + orjson.dumps(text) + tail

    def text_frame(self, index: int) -> tuple[bytes, bytes]:
        """What ``text`` writes before and after the JSON string of choice ``index``'s text."""
        head = self._text_heads.get(index)
        if head is None:
            head = self._text_heads[index] = self._head + str(index).encode() + self._text_key
        return head, self._tail

    def finish(self, index: int, reason: str) -> bytes:
        body = b',"delta":{}' if self.chat else b',"text":""'
        return (self._head + str(index).encode() + body + b',"logprobs":null,"finish_reason":'
                + orjson.dumps(reason) + b"}]}\n\n")

    def usage(self, body: dict[str, Any]) -> bytes:
        return self._usage_head + orjson.dumps(body) + b"}\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"


def finish_reason(engine_reason: str | None) -> str:
    # vLLM says "abort" for requests it dropped; OpenAI clients only know stop/length/content_filter.
    return engine_reason if engine_reason in ("stop", "length") else "stop"


def full_response(chat: bool, response_id: str, model: str, created: int, texts: dict[int, str],
                  finish: dict[int, str], usage_body: dict[str, Any]) -> bytes:
    choices = []
    for index in sorted(texts):
        reason = finish_reason(finish.get(index))
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": texts[index]},
                            "logprobs": None, "finish_reason": reason})
        else:
            choices.append({"index": index, "text": texts[index], "logprobs": None, "finish_reason": reason})
    return orjson.dumps({
        "id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": model, "choices": choices, "usage": usage_body,
    })
