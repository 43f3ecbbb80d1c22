"""A served model's tokenizer as plain data, read from a Hugging Face model directory or from the gateway.

``TokenizerSpec`` carries what prompt synthesis needs to count tokens as the server does: the
``tokenizer.json`` document, the chat template and its special tokens, and the context length when known.
It is plain data (no ``tokenizers`` object), so it pickles cheaply to worker processes and this module
imports nothing heavy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MODEL_CONFIG_FILE = "config.json"

# The keys a model config may give its context length under, in the order vLLM looks them up.
CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """Everything needed to count a prompt's tokens the way the server will."""

    tokenizer_json: str
    chat_template: str | None
    bos_token: str
    eos_token: str
    max_model_len: int | None
    source: str


class TokenizerDocument(BaseModel):
    """The body of the gateway's ``GET /v1/models/{model}/tokenizer``."""

    # NOTE: extra="ignore", unlike the workload models: this is a server's answer, and a field the gateway
    # adds later must not break older load generators.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="The served model's name.")
    max_model_len: int = Field(..., gt=0, description="Longest context the platform serves, in tokens.")
    tokenizer: dict[str, Any] = Field(..., description="The tokenizer.json document the gateway counts with.")
    chat_template: str | None = Field(None, description="Jinja chat template; none: role-prefixed transcript.")
    bos_token: str = Field("", description="Text of the beginning-of-sequence token, for the template.")
    eos_token: str = Field("", description="Text of the end-of-sequence token, for the template.")

    def to_spec(self, source: str) -> TokenizerSpec:
        return TokenizerSpec(
            tokenizer_json=json.dumps(self.tokenizer),
            chat_template=self.chat_template,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            max_model_len=self.max_model_len,
            source=source,
        )


def _token_text(value: Any) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    return str(value.get("content", "")) if isinstance(value, dict) else str(value or "")


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def context_length_from_config(model_dir: Path) -> int | None:
    """The model's own context length from ``config.json``; ``None`` when the file or the key is absent.

    The platform may serve a model with a shorter context (vLLM's ``max_model_len``) than the model's own.
    """
    path = model_dir / MODEL_CONFIG_FILE
    if not path.exists():
        return None
    config = _read_json(path)
    for key in CONTEXT_LENGTH_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_model_dir(model_dir: str | Path) -> TokenizerSpec:
    """The tokenizer of a local Hugging Face model directory, read as the Tessera gateway reads it.

    ``tokenizer.json`` is required; the chat template is ``tokenizer_config.json``'s ``chat_template``,
    else ``chat_template.jinja``; the context length is ``config.json``'s (``None`` without one).
    """
    path = Path(model_dir)
    tokenizer_file = path / TOKENIZER_FILE
    if not tokenizer_file.exists():
        raise FileNotFoundError(f"{path}: no {TOKENIZER_FILE} (--tokenizer expects a Hugging Face model directory)")
    config: dict[str, Any] = {}
    if (path / TOKENIZER_CONFIG_FILE).exists():
        config = _read_json(path / TOKENIZER_CONFIG_FILE)
    template = config.get("chat_template")
    if not isinstance(template, str) or not template:
        template = (path / CHAT_TEMPLATE_FILE).read_text() if (path / CHAT_TEMPLATE_FILE).exists() else None
    return TokenizerSpec(
        tokenizer_json=tokenizer_file.read_text(),
        chat_template=template,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        max_model_len=context_length_from_config(path),
        source=str(path),
    )
