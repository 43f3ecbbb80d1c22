"""Counts a prompt's tokens the way the Tessera gateway does.

The gateway renders chat messages with the model's chat template (jinja2, ``add_generation_prompt``,
``bos_token``/``eos_token`` as variables; without a template, a ``role: content`` transcript ending in
``assistant:``) and encodes the text without adding special tokens; a completion prompt is encoded as it
is. Its count is what the server reports as ``usage.prompt_tokens``. ``tokenizers`` and ``jinja2`` are
imported when a ``PromptTokenizer`` is built, never at module import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera_loadgen.tokenizer_spec import TokenizerSpec

Message = dict[str, str]


def transcript(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The gateway's rendering of a chat for a model that ships no chat template."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + "assistant:" if add_generation_prompt else text


class PromptTokenizer:
    """A model's tokenizer and chat template, counting as the server counts ``prompt_tokens``."""

    def __init__(self, spec: TokenizerSpec) -> None:
        import jinja2
        from tokenizers import Tokenizer

        self.spec = spec
        self._tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        # NOTE: the gateway's jinja2 settings (no trim_blocks/lstrip_blocks, unlike transformers'
        # apply_chat_template): whitespace in the rendered text is tokens, and the gateway is the counter.
        env = jinja2.Environment(autoescape=False, keep_trailing_newline=True)
        self._template: Any = env.from_string(spec.chat_template) if spec.chat_template else None

    @property
    def max_model_len(self) -> int | None:
        return self.spec.max_model_len

    def count(self, text: str) -> int:
        """Tokens of ``text`` encoded as a completion prompt (no special tokens added)."""
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The text the server tokenizes for ``messages``."""
        if self._template is None:
            return transcript(messages, add_generation_prompt)
        rendered: str = self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.spec.bos_token,
            eos_token=self.spec.eos_token,
        )
        return rendered

    def count_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> int:
        """Tokens of a chat request as the server counts them (``usage.prompt_tokens``)."""
        return self.count(self.render_chat(messages, add_generation_prompt))
