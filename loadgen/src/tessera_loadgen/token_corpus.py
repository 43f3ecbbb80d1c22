"""Text of a predicted token count, cut from a seeded word stream whose words' token counts are known.

Encoding every candidate prompt to measure it costs about a microsecond per token, on the path that
starts requests. Instead, each distinct word of the stream is encoded once, in two positions: first in
the text (no leading space) and after another word and a space. With the usual pre-tokenizers (byte-level
BPE, SentencePiece's metaspace) a space-separated word never merges with its neighbours, so the tokens
of a run of words are the sum of its words' counts, and a prompt of ``k`` tokens is found with one
bisection over cumulative counts. A few single-token words pad the last gap. The prediction is only a
first guess: ``token_fit.fit_to_tokens`` counts the rendered prompt and corrects it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence


class TokenCorpus:
    """A word stream (repeated end to end as needed) with each word's token count in context."""

    def __init__(self, words: Sequence[str], count_tokens: Callable[[str], int]) -> None:
        if not words:
            raise ValueError("a token corpus needs at least one word")
        self.words = tuple(words)
        distinct = sorted(set(self.words))
        anchor = distinct[0]
        anchor_tokens = count_tokens(anchor)
        self.first_tokens = {w: count_tokens(w) for w in distinct}
        self.next_tokens = {w: max(1, count_tokens(f"{anchor} {w}") - anchor_tokens) for w in distinct}
        # cumulative[i]: predicted tokens of words[0:i] when each is a following word (space before it).
        self._cumulative = [0, *itertools.accumulate(self.next_tokens[w] for w in self.words)]
        self._period_tokens = self._cumulative[-1]
        singles = [w for w in distinct if self.first_tokens[w] == 1 and self.next_tokens[w] == 1]
        # NOTE: padding needs words of exactly one token in both positions; without any (an unusual
        # tokenizer), the stream's own words pad and fit_to_tokens absorbs the error.
        self._fillers = tuple(singles) or (min(distinct, key=lambda w: self.next_tokens[w]),)

    def __len__(self) -> int:
        return len(self.words)

    def _cumulative_at(self, index: int) -> int:
        """Predicted tokens of the (repeated) stream's words before ``index``."""
        periods, offset = divmod(index, len(self.words))
        return periods * self._period_tokens + self._cumulative[offset]

    def _end_for(self, start: int, budget_tokens: int) -> int:
        """The largest word index ``end`` such that words ``start + 1 .. end - 1`` fit in ``budget_tokens``."""
        goal = self._cumulative_at(start + 1) + budget_tokens
        periods, rest = divmod(goal, self._period_tokens)
        return periods * len(self.words) + bisect.bisect_right(self._cumulative, rest) - 1

    def text(self, start: int, num_tokens: int) -> str:
        """Words from index ``start`` whose predicted count is ``num_tokens`` (at least one word).

        Standalone, a text begins without a space, so its first word is counted in the first position.
        """
        n = len(self.words)
        first = self.words[start % n]
        first_tokens = self.first_tokens[first]
        if num_tokens < first_tokens:
            return " ".join(self._padding(start, max(1, num_tokens)))
        end = max(start + 1, self._end_for(start, num_tokens - first_tokens))
        predicted = first_tokens + self._cumulative_at(end) - self._cumulative_at(start + 1)
        words = list(self.words[start:end]) if end <= n else [self.words[i % n] for i in range(start, end)]
        words.extend(self._padding(end, num_tokens - predicted))
        return " ".join(words)

    def _padding(self, seed_index: int, num_tokens: int) -> list[str]:
        """``num_tokens`` single-token words, chosen from the position (no random draw, so no rng state)."""
        fillers = self._fillers
        return [fillers[(seed_index + i) % len(fillers)] for i in range(num_tokens)]
