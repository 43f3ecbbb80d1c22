"""The per-token step's two implementations (gateway/delta_chunk.py): the C one copies the engine's text only
in the canonical form orjson writes, the Python one parses and re-encodes it. Where the C one takes a chunk,
both must give the bytes the batched path writes (``ChunkWriter.text`` framed as uvicorn frames a chunk);
anything else the C one declines, so no engine byte reaches the client's SSE line unchecked."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from tessera.engine.protocol import delta_line
from tessera.gateway.delta_chunk import NATIVE_SPLIT, split_delta_chunk_py
from tessera.gateway.openai_format import ChunkWriter

WRITER = ChunkWriter(True, "chatcmpl-x", "m", 1)
HEAD, TAIL = WRITER.text_frame(0)
# Every kind of character orjson writes differently: plain, escaped short, escaped \u00xx, raw multi-byte.
ALPHABET = ([chr(c) for c in range(0x20)] + list(' "\\/azAZ09~\x7f') +
            ["é", "€", "\u2028", "\u2029", "\ufeff", "\uffff", "😀", "\U0010ffff", "中"])

native = pytest.mark.skipif(NATIVE_SPLIT is None, reason="the C step is not built here")


def chunk(line: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(line), line)


def engine_chunk(text: str, ids: list[int]) -> bytes:
    return chunk(delta_line(0, text, ids) + b"\n")


def random_delta(rng: random.Random) -> tuple[str, list[int]]:
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 12)))
    ids = [rng.choice([0, rng.randrange(1, 200_000), rng.randrange(0, 2**40)]) for _ in range(rng.randrange(0, 4))]
    return text, ids


def test_the_python_step_writes_what_the_batched_path_writes() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        text, ids = random_delta(rng)
        framed, got_ids = split_delta_chunk_py(engine_chunk(text, ids), HEAD, TAIL) or (b"?", [])
        assert got_ids == ids
        assert framed == (chunk(WRITER.text(0, text)) if text else b"")


@native
def test_the_c_step_takes_every_chunk_the_engine_writes_and_gives_the_same_bytes() -> None:
    assert NATIVE_SPLIT is not None
    rng = random.Random(11)
    for _ in range(5000):
        text, ids = random_delta(rng)
        data = engine_chunk(text, ids)
        got = NATIVE_SPLIT(data, HEAD, TAIL)
        assert got is not None, data
        assert got == split_delta_chunk_py(data, HEAD, TAIL)


@native
@pytest.mark.parametrize("line", [
    b'{"i":0,"t":"\\/","d":[1]}',  # an escape orjson never writes
    b'{"i":0,"t":"\\u0041","d":[1]}',
    b'{"i":0,"t":"\\u000A","d":[1]}',  # upper-case hex
    b'{"i":0,"t":"\\u000a","d":[1]}',  # \n has a short escape
    b'{"i":0,"t":"\\ud83d\\ude00","d":[1]}',  # a surrogate pair escaped
    b'{"i":0,"t":"a\rb","d":[1]}',  # a raw control character: it would end the client's SSE line
    b'{"i":0,"t":"a\nb","d":[1]}',
    b'{"i":0,"t":"\xc0\x80","d":[1]}',  # overlong
    b'{"i":0,"t":"\xe0\x80\x80","d":[1]}',
    b'{"i":0,"t":"\xed\xa0\x80","d":[1]}',  # a surrogate in UTF-8
    b'{"i":0,"t":"\xf4\x90\x80\x80","d":[1]}',  # past U+10FFFF
    b'{"i":0,"t":"\xf5\x80\x80\x80","d":[1]}',
    b'{"i":0,"t":"\x80","d":[1]}',  # a lone continuation byte
    b'{"i":0,"t":"\xe2\x82","d":[1]}',  # cut short
    b'{"i":0,"t":"a\\","d":[1]}',
    b'{"i":0,"t":"a","d":[01]}',  # a leading zero
    b'{"i":0,"t":"a","d":[-1]}',
    b'{"i":0,"t":"a","d":[1.0]}',
    b'{"i":0,"t":"a","d":[1,]}',
    b'{"i":0,"t":"a","d":[1 ]}',
    b'{"i":0,"t":"a","d":[1234567890123456789]}',  # past 18 digits
    b'{"i":1,"t":"a","d":[1]}',  # another choice
    b'{"i":0, "t":"a","d":[1]}',
    b'{"i":0,"t":"a","d":[1],"x":1}',
    b'{"i":0,"t":"a","d":[1]} ',
    b'{"done":true,"finish":{"0":"stop"},"stats":{}}',
    b'{"i":0,"t":"a"',
])
def test_the_c_step_declines_what_orjson_would_not_have_written(line: bytes) -> None:
    assert NATIVE_SPLIT is not None
    assert NATIVE_SPLIT(chunk(line + b"\n"), HEAD, TAIL) is None


@native
@pytest.mark.parametrize("data", [
    b"",
    b"\r\n",
    b"1a",
    engine_chunk("a", [1])[:-1],  # the chunk's CRLF cut short
    engine_chunk("a", [1]) + b"0\r\n\r\n",  # the body's end in the same read
    engine_chunk("a", [1]) + engine_chunk("b", [2]),  # two chunks
    chunk(delta_line(0, "a", [1]) + b"\n" + delta_line(0, "b", [2]) + b"\n"),  # two lines in one chunk
    chunk(delta_line(0, "a", [1])),  # no newline
    b"10;ext=1\r\n" + delta_line(0, "a", [1]) + b"\n\r\n",  # a chunk extension
    b"+" + engine_chunk("a", [1]),
    b"000000001\r\n\n\r\n",  # past the size line's digits
])
def test_the_c_step_takes_only_exactly_one_chunk(data: bytes) -> None:
    assert NATIVE_SPLIT is not None
    assert NATIVE_SPLIT(data, HEAD, TAIL) is None


@native
def test_mutated_chunks_are_declined_or_give_what_python_gives() -> None:
    """A byte replaced, inserted or removed anywhere: the C step either declines or agrees with the parse."""
    assert NATIVE_SPLIT is not None
    rng = random.Random(3)
    taken = 0
    for _ in range(20_000):
        data = bytearray(engine_chunk(*random_delta(rng)))
        for _ in range(rng.randrange(1, 3)):
            at = rng.randrange(len(data))
            byte = rng.choice([rng.randrange(256), *b'"\\\r\n{}[],:0u'])
            kind = rng.randrange(3)
            if kind == 0:
                data[at] = byte
            elif kind == 1:
                data.insert(at, byte)
            elif len(data) > 1:
                del data[at]
        got = NATIVE_SPLIT(bytes(data), HEAD, TAIL)
        if got is not None:
            taken += 1
            assert got == split_delta_chunk_py(bytes(data), HEAD, TAIL), bytes(data)
    assert taken > 100, "the mutations never kept a chunk whole: the test compared nothing"


@native
def test_the_c_step_refuses_arguments_that_are_not_bytes() -> None:
    assert NATIVE_SPLIT is not None
    with pytest.raises(TypeError, match="bytes"):
        NATIVE_SPLIT(bytearray(engine_chunk("a", [1])), HEAD, TAIL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        NATIVE_SPLIT(engine_chunk("a", [1]), HEAD)  # type: ignore[call-arg]


def test_native_relay_off_takes_the_python_step() -> None:
    code = "from tessera.gateway import delta_chunk as d; print(d.split_delta_chunk is d.split_delta_chunk_py)"
    out = subprocess.run([sys.executable, "-c", code], env={"TESSERA_NATIVE_RELAY": "0", "PATH": ""},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
