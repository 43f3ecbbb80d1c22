"""Fit a prompt to a token count by measuring it: build, count as the server will, correct, repeat.

Concatenating text changes tokenization at the seams (a chat template's markers, a prefix's separator),
so a prompt's length is known only once the whole prompt is encoded. ``fit_to_tokens`` builds a candidate
with ``k`` content tokens, counts the whole prompt, moves ``k`` by the difference and stops at the exact
count, at a repeated ``k`` (the count jumps over the target) or after ``max_tries``; it returns the
closest candidate seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_TRIES = 4


@dataclass(frozen=True, slots=True)
class FittedText:
    """Content text, the token count of the whole prompt built around it, and how many candidates were
    counted (1: the first guess was exact)."""

    text: str
    num_tokens: int
    num_tries: int


def fit_to_tokens(
    target_tokens: int,
    build: Callable[[int], str],
    count: Callable[[str], int],
    first_guess: int,
    max_tries: int = DEFAULT_MAX_TRIES,
) -> FittedText:
    """The content whose whole prompt has the count closest to ``target_tokens``.

    ``build(k)`` makes content of about ``k`` tokens (``k >= 1``); ``count(content)`` counts the whole
    prompt around it; ``first_guess`` is the ``k`` to try first.
    """
    k = max(1, first_guess)
    tried: set[int] = set()
    best_text, best_tokens, tries = "", -1, 0
    while tries < max(1, max_tries):
        tries += 1
        tried.add(k)
        text = build(k)
        num_tokens = count(text)
        if best_tokens < 0 or abs(num_tokens - target_tokens) < abs(best_tokens - target_tokens):
            best_text, best_tokens = text, num_tokens
        if num_tokens == target_tokens:
            break
        k = max(1, k + target_tokens - num_tokens)
        if k in tried:
            break
    return FittedText(best_text, best_tokens, tries)
