"""The two generation endpoints as kinds: what differs between ``/v1/chat/completions`` and
``/v1/completions`` (the body's schema, how its prompt becomes token ids, the response's shapes) is a
method of its ``Endpoint``, and the phases call it instead of branching on a flag."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jinja2

from tessera.gateway.errors import bad_request
from tessera.gateway.openai_format import ChunkWriter, full_response
from tessera.gateway.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from tessera.gateway.models import ServedModel

OpenAIRequest = ChatCompletionRequest | CompletionRequest


class Endpoint:
    path: ClassVar[str]
    schema: ClassVar[type[ChatCompletionRequest] | type[CompletionRequest]]
    prompt_param: ClassVar[str]  # the body field a too-long prompt is reported on
    id_prefix: ClassVar[str]
    chat: ClassVar[bool]

    def parse(self, data: dict[str, Any]) -> OpenAIRequest:
        """Validates the decoded body (raises pydantic's ``ValidationError``)."""
        return self.schema.model_validate(data)

    def tokenize(self, body: Any, model: ServedModel) -> list[int]:
        raise NotImplementedError

    def requested_max_tokens(self, body: Any) -> int | None:
        return body.max_tokens  # type: ignore[no-any-return]

    def role_choices(self, n: int) -> int:
        """How many choices open a stream with the assistant's role chunk."""
        return 0

    def chunk_writer(self, response_id: str, model: str, created: int) -> ChunkWriter:
        return ChunkWriter(self.chat, response_id, model, created)

    def full_response(self, response_id: str, model: str, created: int, texts: dict[int, str],
                      finish: dict[int, str], usage_body: dict[str, Any]) -> bytes:
        return full_response(self.chat, response_id, model, created, texts, finish, usage_body)


class ChatEndpoint(Endpoint):
    path = "/v1/chat/completions"
    schema = ChatCompletionRequest
    prompt_param = "messages"
    id_prefix = "chatcmpl-"
    chat = True

    def tokenize(self, body: ChatCompletionRequest, model: ServedModel) -> list[int]:
        messages = []
        for i, message in enumerate(body.messages):
            try:
                messages.append({"role": message.role, "content": message.text()})
            except ValueError as exc:
                param = f"messages[{i}].content"
                raise bad_request(f"Invalid request: {param}: {exc}", "unsupported_content", param) from None
        try:
            return model.encode_chat(messages)
        except jinja2.TemplateError as exc:
            raise bad_request(f"The model's chat template rejects these messages: {exc}", "invalid_messages",
                              "messages") from None

    def requested_max_tokens(self, body: ChatCompletionRequest) -> int | None:
        return body.requested_max_tokens

    def role_choices(self, n: int) -> int:
        return n


class CompletionsEndpoint(Endpoint):
    path = "/v1/completions"
    schema = CompletionRequest
    prompt_param = "prompt"
    id_prefix = "cmpl-"
    chat = False

    def tokenize(self, body: CompletionRequest, model: ServedModel) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, str):
            return model.encode(prompt)
        if prompt and isinstance(prompt[0], str):
            return model.encode(str(prompt[0]))
        ids = [int(t) for t in prompt]
        vocab = model.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"Prompt token ids must be in [0, {vocab}).", "invalid_token_id", "prompt")
        return ids


CHAT = ChatEndpoint()
COMPLETIONS = CompletionsEndpoint()
# path -> the endpoint serving it
ENDPOINTS: dict[str, Endpoint] = {CHAT.path: CHAT, COMPLETIONS.path: COMPLETIONS}
