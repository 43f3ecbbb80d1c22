"""The OpenAI request bodies Tessera accepts. Unknown fields are ignored (clients send many), but every
field Tessera acts on is type-checked, so a wrong type is a 400 naming the field, never a 500; and an OpenAI
field that would change the answer, which Tessera does not serve, is refused by name (``unsupported_field``)
rather than silently dropped: a client asking for logprobs or tool calls must not get a plain answer that
looks like one."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator


def _is_unset(value: Any) -> bool:
    # null, false, 0, [], {}, "": what clients send for "off" (False == 0 in Python).
    return value is None or value == 0 or value in ([], {}, "")


# OpenAI request fields that would change what the answer contains, with the values that change nothing
# (what a client sends for "off": null, false, 0, [], "", or the default named here).
_INERT_VALUES: dict[str, Any] = {
    "logprobs": _is_unset, "top_logprobs": _is_unset, "echo": _is_unset, "suffix": _is_unset,
    "logit_bias": _is_unset, "frequency_penalty": _is_unset, "presence_penalty": _is_unset,
    "best_of": lambda v: _is_unset(v) or v == 1,
    "tools": _is_unset, "functions": _is_unset, "parallel_tool_calls": lambda v: True,
    "tool_choice": lambda v: _is_unset(v) or v == "none",
    "function_call": lambda v: _is_unset(v) or v == "none",
    "response_format": lambda v: _is_unset(v) or v == {"type": "text"},
    "modalities": lambda v: _is_unset(v) or v == ["text"],
    "audio": _is_unset, "prediction": _is_unset,
}


def unsupported_field(data: dict[str, Any]) -> str | None:
    """The first field of ``data`` that asks for something Tessera does not serve, or None."""
    for name, inert in _INERT_VALUES.items():
        if name in data and not inert(data[name]):
            return name
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # The engine's transport carries 64-bit integers.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: StrictBool = Field(default=False, description="vLLM extension: generate max_tokens tokens.")

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        if value == "" or (isinstance(value, list) and any(not s for s in value)):
            raise ValueError("stop sequences must not be empty")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(description="A string, a list of token ids, or one string in a list.")
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > 1 and isinstance(value[0], str):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
