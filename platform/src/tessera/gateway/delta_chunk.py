"""One HTTP chunk of an engine's streamed body in, the client's HTTP chunk out: the per-token step.

Once a response streams, each engine delta arrives ~one inter-token latency after the last, so its steps run
from cold caches and every Python frame and C routine on the way costs a refill (``bench/relay_cold.py``: the
parser's callback, a JSON parse, the client's framing and the write took 37-40 us a chunk cold in process). The
engine writes each delta as its own chunk (engine/generation.py), so the relay can take the socket's read whole
when it is exactly one such chunk: ``split_delta_chunk`` checks that and builds the client's chunk in one call,
and the relay writes it (engine_client.py ``_Attempt.chunk_received``; http_wire.py offers the read only where
the response parser stands between two chunks, so skipping it leaves the parser as it was).

Two implementations, one contract. The C one (``_delta_chunk.c``, built by ``make install`` where a compiler
is; 12-14 us a chunk cold in its prototype) takes only the text in the canonical form orjson writes and copies
it; the Python one, used where no build could be made or ``TESSERA_NATIVE_RELAY=0``, parses and re-encodes it.
Where the C one takes a chunk, both give the same bytes (tests/unit/gateway/test_delta_chunk.py); where it
declines (a line not written by ``delta_line``, a choice other than 0, two lines in one read), the relay's
batched path parses the line as before.

``split_delta_chunk(data, head, tail)`` returns ``(framed, ids)`` or None: ``framed`` is the client's HTTP chunk
``<hex size>\\r\\n`` + head + the JSON text + tail + ``\\r\\n`` (b"" when the text is empty: nothing to write),
``ids`` the delta's token ids.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from tessera.native_steps import RELAY_STEP

_LINE_HEAD = b'{"i":0,"t":'
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_MAX_SIZE_DIGITS = 8

SplitDeltaChunk = Callable[[bytes, bytes, bytes], "tuple[bytes, list[int]] | None"]


def split_delta_chunk_py(data: bytes, head: bytes, tail: bytes) -> tuple[bytes, list[int]] | None:
    """The Python implementation (see the module's docstring)."""
    size_end = data.find(b"\r\n", 0, _MAX_SIZE_DIGITS + 2)
    if size_end < 1 or not _HEX_DIGITS.issuperset(data[:size_end]):
        return None
    line = data[size_end + 2:-2]
    if (len(line) != int(data[:size_end], 16) or not data.endswith(b"\r\n") or not line.startswith(_LINE_HEAD)
            or line.find(b"\n") != len(line) - 1):
        return None
    try:
        message = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if type(message) is not dict or len(message) != 3:
        return None
    text, ids = message.get("t"), message.get("d")
    if (message.get("i") != 0 or type(text) is not str or type(ids) is not list
            or not all(type(i) is int and i >= 0 for i in ids)):
        return None
    if not text:
        return b"", ids
    chunk = head + orjson.dumps(text) + tail
    return b"%x\r\n%b\r\n" % (len(chunk), chunk), ids


NATIVE_SPLIT: SplitDeltaChunk | None = RELAY_STEP.load()
split_delta_chunk: SplitDeltaChunk = NATIVE_SPLIT or split_delta_chunk_py

__all__ = ["NATIVE_SPLIT", "split_delta_chunk", "split_delta_chunk_py"]
