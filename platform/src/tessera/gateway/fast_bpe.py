"""A byte-level BPE tokenizer's pieces encoded by tiktoken's merge loop, where that gives the tokenizer's own ids.

Tokenizing the prompt is the largest fixed part of a streamed request's gateway CPU: ~0.8 ms of ~4.5 for a
different 350-token prompt each time on an Intel Xeon VM (docs/performance.md, "The prompt's tokens by
tiktoken's merge loop"). tiktoken merges the same way in 3-4x less CPU: it looks ranks up in one hash map of
byte strings, where the Hugging Face BPE keeps words, merges and an alphabet of its own.

The two agree where the tokenizer's merges are the ones tiktoken's rule would take: byte-level BPE splits each
pre-tokenized word into bytes and merges, step by step, the adjacent pair of the highest priority; tiktoken
takes the adjacent pair whose concatenation has the lowest rank (its id). So ``tiktoken_pieces`` accepts a
tokenizer only when
- its model is a BPE over the 256-byte alphabet (no dropout, no word prefix or suffix, no byte fallback), its
  normalizer none or NFC, its pre-tokenizer the GPT-2 regex of ``ByteLevel`` or one ``Split`` regex followed by
  a ``ByteLevel`` that maps bytes only;
- every merge makes a token of a higher id than the merge before it, and tiktoken's rule, applied to that token's
  bytes with the lower ranks only, ends in exactly that merge's two halves (which is how Hugging Face's
  converter derives merges from tiktoken ranks, so that its BPE repeats tiktoken's; checked for each merge: 0.8 s
  for a 50,000-token vocabulary here, in a thread, ``ServedModel.speed_up``);
- a sample of texts (every Unicode category the regexes name, whitespace runs, digits, emoji) encodes alike.

Anything else gets None and the Hugging Face tokenizer encodes as before. The pieces are what lies between
added tokens: the caller cuts them out first (segment_tokens.py), as the tokenizer does.
tests/unit/gateway/test_fast_bpe.py compares the ids on generated texts for the small model and for
trained tokenizers of both pre-tokenizer shapes.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Callable, Collection
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)

# The regex that tokenizers' ByteLevel pre-tokenizer applies when ``use_regex`` is on (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Texts both encoders must agree on before the fast one is used (a guard beside the merge check, which is the
# argument).
SELF_TEST_TEXTS = (
    "Hello, world! It's the KV cache's 2nd block: 3.14159 tokens.",
    "  leading spaces\n\n\ttabs and\r\nnewlines   trailing   ",
    "naïve café Ωmega ﬁnance 東京タワー 한국어 😀🙂👍🏽 emoji",
    "don't won't I'LL we've THEY'RE 'quoted' \"double\" `code` (paren) [brackets] {braces}",
    "1234567890 12 345 6789 x1 1x ٣٤٥ ½ ² Ⅻ",
    "a\u00a0b\u2009c\u3000d \u200be\ufeff",
    "<|user|> a tag's text </s> <unk> <s>",
    "\x00\x01\x7f control bytes and \ufffd replacement",
)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """The printable character ``ByteLevel`` writes for each byte, to that byte (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


def pretokenizer_pattern(spec: dict[str, Any] | None) -> str | None:
    """The split regex of a pre-tokenizer tiktoken can run the same way, or None."""
    if spec is None:
        return None
    if spec.get("type") == "ByteLevel":
        return GPT2_PATTERN if spec.get("use_regex", True) and not spec.get("add_prefix_space") else None
    if spec.get("type") != "Sequence" or len(spec.get("pretokenizers", [])) != 2:
        return None
    split, byte_level = spec["pretokenizers"]
    pattern = split.get("pattern", {}).get("Regex") if isinstance(split.get("pattern"), dict) else None
    if (split.get("type") != "Split" or pattern is None or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space")):
        return None
    return str(pattern)


def normalizer_form(spec: dict[str, Any] | None) -> str | None:
    """"" for no normalizer, "NFC" for NFC, None for one tiktoken's path does not repeat."""
    if spec is None:
        return ""
    return "NFC" if spec.get("type") == "NFC" else None


def merge_ranks(model: dict[str, Any], added: Collection[str] = ()) -> dict[bytes, int] | None:
    """The tiktoken ranks of a byte-level BPE model (its 256 bytes and every merge's token, by id), or None where
    tiktoken's rule would not reproduce the merges (see the module docstring). ``added``: the tokenizer's added
    tokens, cut out of the text before any word reaches the model."""
    if (model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix") or model.get("byte_fallback")):
        return None
    alphabet = byte_alphabet()

    def to_bytes(token: str) -> bytes | None:
        try:
            return bytes(alphabet[char] for char in token)
        except KeyError:
            return None

    vocab: dict[str, int] = model["vocab"]
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        raw = to_bytes(token)
        if raw is not None and len(raw) == 1:
            ranks[raw] = token_id
    if len(ranks) != 256:
        return None
    last_rank = -1
    for merge in model.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        left_bytes, right_bytes, merged = to_bytes(left), to_bytes(right), vocab.get(left + right)
        if left_bytes is None or right_bytes is None or merged is None or merged <= last_rank:
            return None
        whole = left_bytes + right_bytes
        if whole in ranks or not _ends_in(whole, ranks, left_bytes, right_bytes):
            return None
        ranks[whole] = last_rank = merged
    # ``ignore_merges``: the whole word first, where it is in the vocabulary. tiktoken does that too, but looks in
    # its ranks only, so every token of the vocabulary a word can be must be one (an added token's text never
    # reaches the model: it was cut out before).
    if model.get("ignore_merges") and any(t not in added and (raw := to_bytes(t)) is not None and raw not in ranks
                                          for t in vocab):
        return None
    # Two tokens under one id (a hand-edited vocabulary): tiktoken could not decode, and would not load, them.
    return ranks if len(set(ranks.values())) == len(ranks) else None


def _ends_in(word: bytes, ranks: dict[bytes, int], left: bytes, right: bytes) -> bool:
    """tiktoken's rule on ``word``'s bytes with the ranks made so far (all lower) ends in ``left``, ``right``."""
    parts = [word[i:i + 1] for i in range(len(word))]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            return False
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts == [left, right]


def tiktoken_pieces(tokenizer_json: dict[str, Any], reference: Callable[[str], list[int]],
                    added: Collection[str], name: str = "") -> Callable[[str], list[int]] | None:
    """An encoder of text with none of the ``added`` tokens in it, by tiktoken, giving ``reference``'s ids (the
    Hugging Face tokenizer's); None where that cannot be shown (logged: the slower path is still right)."""
    try:
        import tiktoken
    except ImportError:
        return None
    pattern = pretokenizer_pattern(tokenizer_json.get("pre_tokenizer"))
    form = normalizer_form(tokenizer_json.get("normalizer"))
    ranks = (merge_ranks(tokenizer_json.get("model", {}), added) if pattern is not None and form is not None
             else None)
    if ranks is None or pattern is None:
        logger.info("model %s: tokenized by its own BPE (its shape is not one tiktoken repeats)", name)
        return None
    try:
        encoding = tiktoken.Encoding(f"tessera-{name}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    except ValueError as exc:
        logger.info("model %s: tiktoken refused its ranks (%s); tokenizing with its own BPE", name, exc)
        return None
    encode_ordinary = encoding.encode_ordinary
    encode: Callable[[str], list[int]]
    if not form:
        encode = encode_ordinary
    else:
        def encode(text: str) -> list[int]:
            return encode_ordinary(unicodedata.normalize("NFC", text))
    samples = [text for text in SELF_TEST_TEXTS if not any(token in text for token in added)]
    mismatched = [text for text in samples if encode(text) != reference(text)]
    if mismatched:
        logger.warning("model %s: tiktoken's ids differ from the tokenizer's on %r; tokenizing with its own BPE",
                       name, mismatched[0])
        return None
    return encode


__all__ = ["tiktoken_pieces"]
