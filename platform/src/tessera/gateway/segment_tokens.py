"""A conversation's token ids from the pieces between its special tokens, each piece's ids kept (bounded).

A multi-turn chat sends its whole history with every turn, and the rendered template puts each message between
special tokens (``<|user|>``, ``<|im_end|>``, ...). A Hugging Face tokenizer cuts a text at its added tokens
before anything else and then normalizes, pre-tokenizes and merges each piece between them on its own, so a
text's ids are the concatenation of its pieces' ids and the added tokens' ids. The gateway cuts the rendered
text the same way and keeps the ids of recent pieces: turn n of a conversation tokenizes only what turn n-1
did not have (the new messages), where the whole history was tokenized again on every turn — O(turns²) work
over a conversation, and the largest part of a long chat's gateway CPU.

Exact only where the cut is the tokenizer's own: every added token matched on the raw text (not
``normalized``) and as written (no ``lstrip``/``rstrip``/``single_word``), and special tokens split out
(``encode_special_tokens`` off). ``SegmentTokenizer.of`` returns None for any other tokenizer, which then
encodes the whole text as before. tests/unit/gateway/test_segment_tokens.py checks the ids against whole-text
encoding on generated conversations.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# The pieces' ids kept per model and gateway worker, least recently used out first, bounded in tokens (~36 bytes
# an id: a list slot and an int object) so a tenant's distinct long messages cannot grow a worker past ~2.5 MiB.
MAX_CACHED_PIECE_TOKENS = 65_536
# A piece longer than this is tokenized every time: one message would otherwise flush every other.
MAX_CACHED_PIECE_CHARS = 16_384


class SegmentTokenizer:
    """``encode(text)``: ``text``'s ids, each piece between added tokens tokenized once while it stays cached."""

    def __init__(self, added: dict[str, int], encode_piece: Callable[[str], list[int]]) -> None:
        # Longest first: at one position the regex takes the first alternative that matches, which makes the
        # scan leftmost-longest, as the tokenizer's own matcher is.
        self._added = added
        self._split = re.compile("|".join(re.escape(token) for token in sorted(added, key=len, reverse=True)))
        self._encode_piece = encode_piece
        self._pieces: dict[str, list[int]] = {}
        self._num_cached_tokens = 0

    @classmethod
    def of(cls, tokenizer: Any, encode_piece: Callable[[str], list[int]]) -> SegmentTokenizer | None:
        """The segment path for a ``tokenizers.Tokenizer``, or None where cutting the text would not give the
        tokenizer's own ids (see the module docstring)."""
        decoder = getattr(tokenizer, "get_added_tokens_decoder", None)
        if decoder is None or getattr(tokenizer, "encode_special_tokens", False):
            return None
        added: dict[str, int] = {}
        for token_id, token in decoder().items():
            if token.normalized or token.lstrip or token.rstrip or token.single_word or not token.content:
                return None
            added[token.content] = token_id
        return cls(added, encode_piece) if added else None

    def use_piece_encoder(self, encode_piece: Callable[[str], list[int]]) -> None:
        """Encodes pieces with ``encode_piece`` from now on (one giving the same ids: the cached pieces stay)."""
        self._encode_piece = encode_piece

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens

    def encode(self, text: str, remember: bool = True) -> list[int]:
        """``text``'s ids; with ``remember`` False its pieces are neither looked up nor kept (text sent once)."""
        piece = self._piece if remember else self._encode_piece
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text):
            if match.start() > start:
                ids += piece(text[start:match.start()])
            ids.append(self._added[match.group()])
            start = match.end()
        if start < len(text):
            ids += piece(text[start:])
        return ids

    def _piece(self, piece: str) -> list[int]:
        ids = self._pieces.pop(piece, None)
        if ids is not None:
            # Back to the newest end: a system prompt every conversation repeats stays while one-off text ages out.
            self._pieces[piece] = ids
            return ids
        ids = self._encode_piece(piece)
        if len(piece) <= MAX_CACHED_PIECE_CHARS and len(ids) <= MAX_CACHED_PIECE_TOKENS // 4:
            while self._pieces and self._num_cached_tokens + len(ids) > MAX_CACHED_PIECE_TOKENS:
                self._num_cached_tokens -= len(self._pieces.pop(next(iter(self._pieces))))
            self._pieces[piece] = ids
            self._num_cached_tokens += len(ids)
        return ids
