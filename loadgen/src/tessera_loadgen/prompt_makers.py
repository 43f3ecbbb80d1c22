"""Synthetic prompt content of a requested length: in words (no tokenizer) or in the model's tokens.

A request asks for ``content_tokens`` of new text, after a shared prefix of ``prefix.num_tokens`` (a
prefix group) or after a conversation's history. Both makers return the content and the *asked* prompt
length: what the server should report as ``usage.prompt_tokens``, recorded as ``n_in_asked`` beside the
server's ``n_in``.

- ``ApproximatePrompts`` counts words (about one token each for large vocabularies, several for small
  ones); the asked length is the workload's number, which the server's count may miss by a factor.
- ``TokenExactPrompts`` counts as the server does (``PromptTokenizer``): the asked length is the whole
  prompt, chat template included, and the content is fitted until the rendered prompt has that count.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tessera_loadgen.token_corpus import TokenCorpus
from tessera_loadgen.token_fit import fit_to_tokens

if TYPE_CHECKING:
    from tessera_loadgen.prompt_tokenizer import Message, PromptTokenizer
    from tessera_loadgen.prompts import PrefixGroupTexts, SyntheticText

PROBE_TOKENS = 16
"""Length of the sample content used to measure the tokens a template or prefix adds around content."""

TRUST_AFTER_EXACT = 3
"""Consecutive exactly predicted prompts of one shape after which that shape is no longer re-counted."""

CALIBRATION_TOKENS = (24, 160, 700)
"""Content lengths of the prompts counted per shape before a run (``TRUST_AFTER_EXACT`` of them)."""

_NEVER = -(1 << 30)


@dataclass(frozen=True, slots=True)
class PrefixText:
    """One prefix of a prefix group and the length the workload asked for it."""

    text: str
    num_tokens: int


class PromptMaker(Protocol):
    """Synthetic content for one model."""

    @property
    def exact(self) -> bool:
        """Lengths are in the model's tokens (else approximate)."""
        ...

    def prefix(self, group: str, rng: random.Random) -> PrefixText: ...

    def completion(self, rng: random.Random, content_tokens: int, prefix: PrefixText | None) -> tuple[str, int]:
        """The whole completion prompt and its asked length."""
        ...

    def chat_turn(
        self, rng: random.Random, content_tokens: int, history: Sequence[Message], history_tokens: int | None
    ) -> tuple[str, int | None]:
        """A user message to append to ``history`` and the asked length of the whole chat prompt.

        ``history_tokens``: the asked length of ``history`` (0 for none, a system prefix's length); ``None``
        for a conversation under way, whose length the maker measures if it can.
        """
        ...


class ApproximatePrompts:
    """Word-counted content (no tokenizer): the asked length is the workload's number of words."""

    exact = False

    def __init__(self, synthetic: SyntheticText, prefix_groups: Mapping[str, PrefixGroupTexts]) -> None:
        self._synthetic = synthetic
        self._groups = prefix_groups

    def prefix(self, group: str, rng: random.Random) -> PrefixText:
        texts = self._groups[group]
        return PrefixText(texts.pick(rng), texts.prefix_tokens)

    def completion(self, rng: random.Random, content_tokens: int, prefix: PrefixText | None) -> tuple[str, int]:
        text = self._synthetic.text(rng, content_tokens)
        if prefix is None:
            return text, content_tokens
        return f"{prefix.text}\n{text}", prefix.num_tokens + content_tokens

    def chat_turn(
        self, rng: random.Random, content_tokens: int, history: Sequence[Message], history_tokens: int | None
    ) -> tuple[str, int | None]:
        text = self._synthetic.text(rng, content_tokens)
        return text, None if history_tokens is None else history_tokens + content_tokens


class TokenExactPrompts:
    """Content fitted so the whole prompt has the asked number of the model's tokens.

    Shape of a prompt: what surrounds the content (a completion's prefix, a chat's history and template).
    For each shape the tokens around the content are measured once with a probe, the content is cut from
    ``TokenCorpus`` by predicted count, and the rendered prompt is counted; after ``TRUST_AFTER_EXACT``
    exact predictions in a row a shape is trusted and no longer counted, which keeps encoding (about a
    microsecond per token) off the path that starts requests. The single-request shapes (each prefix, or
    none, for completions and chat) are calibrated when the maker is built; conversation turns, whose
    history is new every time, are always counted.
    """

    exact = True

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        words: Sequence[str],
        seed: int,
        prefix_groups: Mapping[str, tuple[int, int]],
    ) -> None:
        self.tokenizer = tokenizer
        self.corpus = TokenCorpus(words, tokenizer.count)
        self._probe = self.corpus.text(0, PROBE_TOKENS)
        self._probe_tokens = tokenizer.count(self._probe)
        self._completion_around: dict[str, int] = {}
        self._chat_around: dict[tuple[tuple[str, str], ...], int] = {}
        self._exact_streak: dict[object, int] = {}
        self.prefix_groups = {
            name: self._group(name, num_prefixes, prefix_tokens, seed)
            for name, (num_prefixes, prefix_tokens) in prefix_groups.items()
        }
        self._calibrate(seed)

    # prefixes ---------------------------------------------------------------------------------------------
    def _group(self, name: str, num_prefixes: int, prefix_tokens: int, seed: int) -> list[PrefixText]:
        """Prefixes of exactly ``prefix_tokens`` tokens each (counted on their own), labelled like the
        approximate ones; the same for every tenant of this model, so they are shared token for token."""
        rng = random.Random(f"prefix:{name}:{seed}")
        prefixes = []
        for i in range(num_prefixes):
            label = f"[{name} {i}] "
            text = self._fit_prefix(label, rng.randrange(len(self.corpus)), prefix_tokens)
            prefixes.append(PrefixText(label + text, prefix_tokens))
        return prefixes

    def _fit_prefix(self, label: str, start: int, prefix_tokens: int) -> str:
        fitted = fit_to_tokens(
            prefix_tokens,
            lambda k: self.corpus.text(start, k),
            lambda content: self.tokenizer.count(label + content),
            prefix_tokens - self._completion_overhead(label),
        )
        return fitted.text

    def _calibrate(self, seed: int) -> None:
        """Count ``TRUST_AFTER_EXACT`` prompts of every single-request shape now, before the run, so that
        the first requests are not the ones paying for the encoding. A request's text does not depend on
        this: a trusted shape gives the same text as the counted fit's first (exact) candidate."""
        rng = random.Random(f"calibrate:{seed}")
        prefixes = [None, *(p for group in self.prefix_groups.values() for p in group)]
        for prefix in prefixes:
            history = [] if prefix is None else [{"role": "system", "content": prefix.text}]
            history_tokens = 0 if prefix is None else prefix.num_tokens
            for content_tokens in CALIBRATION_TOKENS:
                self.completion(rng, content_tokens, prefix)
                self.chat_turn(rng, content_tokens, history, history_tokens)

    def prefix(self, group: str, rng: random.Random) -> PrefixText:
        prefixes = self.prefix_groups[group]
        return prefixes[rng.randrange(len(prefixes))]

    # requests ---------------------------------------------------------------------------------------------
    def completion(self, rng: random.Random, content_tokens: int, prefix: PrefixText | None) -> tuple[str, int]:
        lead = "" if prefix is None else f"{prefix.text}\n"
        asked = content_tokens + (0 if prefix is None else prefix.num_tokens)
        start = rng.randrange(len(self.corpus))
        text = self._fit(
            ("completion", lead),
            asked,
            start,
            lambda content: self.tokenizer.count(lead + content),
            asked - self._completion_overhead(lead),
        )
        return lead + text, asked

    def chat_turn(
        self, rng: random.Random, content_tokens: int, history: Sequence[Message], history_tokens: int | None
    ) -> tuple[str, int | None]:
        shape: object
        if history_tokens is None:
            # A conversation under way: its history as the server will count it inside the next prompt.
            history_tokens = self.tokenizer.count_chat(history, add_generation_prompt=False)
            guess = content_tokens - self._chat_overhead(())
            shape = None
        else:
            key = tuple((m["role"], m["content"]) for m in history)
            guess = history_tokens + content_tokens - self._chat_overhead(key)
            shape = ("chat", key)
        asked = history_tokens + content_tokens
        start = rng.randrange(len(self.corpus))
        text = self._fit(
            shape,
            asked,
            start,
            lambda content: self.tokenizer.count_chat([*history, {"role": "user", "content": content}]),
            guess,
        )
        return text, asked

    # internals --------------------------------------------------------------------------------------------
    def _fit(self, shape: object, asked: int, start: int, count: Callable[[str], int], guess: int) -> str:
        """Content for a prompt of ``asked`` tokens; ``shape`` ``None``: never trusted, always counted."""
        streak = self._exact_streak.get(shape, 0) if shape is not None else _NEVER
        if streak >= TRUST_AFTER_EXACT:
            return self.corpus.text(start, max(1, guess))
        fitted = fit_to_tokens(asked, lambda k: self.corpus.text(start, k), count, guess)
        # NOTE: an asked length below what the shape itself takes (guess < 1) says nothing about the
        # prediction, so it neither builds nor breaks the shape's streak.
        if shape is not None and guess >= 1:
            exact_at_once = fitted.num_tries == 1 and fitted.num_tokens == asked
            self._exact_streak[shape] = streak + 1 if exact_at_once else _NEVER
        return fitted.text

    def _completion_overhead(self, lead: str) -> int:
        """Tokens ``lead`` adds in front of content (0 for none)."""
        if lead not in self._completion_around:
            self._completion_around[lead] = self.tokenizer.count(lead + self._probe) - self._probe_tokens
        return self._completion_around[lead]

    def _chat_overhead(self, history: tuple[tuple[str, str], ...]) -> int:
        """Tokens of ``history`` and the template around one more user message."""
        if history not in self._chat_around:
            messages = [{"role": role, "content": content} for role, content in history]
            messages.append({"role": "user", "content": self._probe})
            self._chat_around[history] = self.tokenizer.count_chat(messages) - self._probe_tokens
        return self._chat_around[history]
