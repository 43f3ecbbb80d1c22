"""A small real HTTP server speaking the Tessera gateway's contract for the load generator's token lengths.

It serves ``GET /v1/models``, ``GET /v1/models/{model}/tokenizer`` (Bearer key required; 404 with an
OpenAI-style error for an unknown model) and the two generation endpoints, streamed or not, whose
``usage.prompt_tokens`` is counted with the gateway's own code (``tessera.gateway.models.ServedModel``):
what the platform would report, without engines. The output is a fixed word repeated ``max_tokens`` times.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tessera.gateway.models import ServedModel, load_served_model
from tessera.registry import ModelInfo


@dataclass
class StubState:
    """What the stub serves and what it saw."""

    model: ServedModel
    document: dict[str, Any]
    keys: set[str]
    tokenizer_requests: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def tokenizer_document(model_dir: Path, name: str, max_model_len: int) -> dict[str, Any]:
    """The endpoint's body, written from the contract (not from the gateway's code)."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (model_dir / "chat_template.jinja").read_text()
    return {
        "model": name,
        "max_model_len": max_model_len,
        "tokenizer": json.loads((model_dir / "tokenizer.json").read_text()),
        "chat_template": template,
        "bos_token": config.get("bos_token", ""),
        "eos_token": config.get("eos_token", ""),
    }


def _handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    name = state.model.info.name

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the load generator's client expects

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str, code: str) -> None:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
            self._send(status, json.dumps(body).encode())

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": name, "object": "model"}]}).encode())
            elif self.path.startswith("/v1/models/") and self.path.endswith("/tokenizer"):
                with state.lock:
                    state.tokenizer_requests.append(self.headers.get("Authorization", ""))
                key = self.headers.get("Authorization", "").removeprefix("Bearer ")
                requested = self.path.removeprefix("/v1/models/").removesuffix("/tokenizer")
                if key not in state.keys:
                    self._error(401, "Invalid API key.", "invalid_api_key")
                elif requested != name:
                    self._error(404, f"The model {requested!r} does not exist.", "model_not_found")
                else:
                    self._send(200, json.dumps(state.document).encode())
            else:
                self._error(404, f"No route GET {self.path}.", "not_found")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            if self.path == "/v1/chat/completions":
                num_prompt = len(state.model.encode_chat(body["messages"]))
            elif self.path == "/v1/completions":
                num_prompt = len(state.model.encode(body["prompt"]))
            else:
                self._error(404, f"No route POST {self.path}.", "not_found")
                return
            with state.lock:
                state.prompt_tokens.append(num_prompt)
            if num_prompt >= state.model.info.max_model_len:
                self._error(400, f"The prompt has {num_prompt} tokens.", "context_length_exceeded")
                return
            self._answer(body, self.path == "/v1/chat/completions", num_prompt)

        def _answer(self, body: dict[str, Any], chat: bool, num_prompt: int) -> None:
            n_out = int(body.get("max_tokens", 4))
            usage = {"prompt_tokens": num_prompt, "completion_tokens": n_out, "total_tokens": num_prompt + n_out}
            if not body.get("stream"):
                choice = {"index": 0, "finish_reason": "length"}
                choice.update(
                    {"message": {"role": "assistant", "content": " word" * n_out}}
                    if chat
                    else {"text": " word" * n_out}
                )
                self._send(200, json.dumps({"id": "x", "choices": [choice], "usage": usage}).encode())
                return
            events = []
            for i in range(n_out):
                choice = {"index": 0, **({"delta": {"content": " word"}} if chat else {"text": " word"})}
                chunk_usage = {"prompt_tokens": num_prompt, "completion_tokens": i + 1, "total_tokens": 0}
                events.append({"id": "x", "choices": [choice], "usage": chunk_usage})
            events.append({"id": "x", "choices": [], "usage": usage})
            payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self._send(200, payload.encode(), "text/event-stream")

    return Handler


@contextmanager
def gateway_stub(
    model_dir: Path, keys: set[str], name: str = "tessera-small", max_model_len: int = 2048
) -> Iterator[tuple[str, StubState]]:
    """Serve on a free local port in a thread; yields the base URL and the stub's state."""
    state = StubState(
        model=load_served_model(ModelInfo(name, str(model_dir), max_model_len, 16)),
        document=tokenizer_document(model_dir, name, max_model_len),
        keys=keys,
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="gateway-stub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
