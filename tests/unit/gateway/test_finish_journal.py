"""The finish journal (gateway/finish_journal.py) with the queue that writes it (tenancy/billing.py): a
parked finish is on disk before ``finish`` returns, a recorded one is never replayed, a dead worker's file is
adopted once, a full journal says so, and the queue replays what it adopts."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tessera.gateway.finish_journal import FinishJournal, JournalConfig, decode_entries, encode_entry
from tessera.tenancy import billing
from tessera.tenancy.admission import SETTLED_MARKER_TTL_S, Lease
from tessera.tenancy.billing import FinishQueue, PendingFinish, replayable
from tessera.tenancy.settlement import SettleKind


def lease(lease_id: str, detached: bool = False) -> Lease:
    return Lease(lease_id, "acme", 0 if detached else 100, ("k1", "k2", "k3", "k4", "k5"), detached)


def pending(lease_id: str, completion: int = 7, kind: SettleKind = SettleKind.GATEWAY) -> PendingFinish:
    return PendingFinish(lease(lease_id), 10, completion, datetime(2026, 12, 2, 1, 0, tzinfo=UTC), kind)


def journal(directory: Path, max_entries: int = 100) -> FinishJournal:
    return FinishJournal(JournalConfig(directory, max_entries, fsync_interval_s=0.01)).open()


class Redis:
    """An admission whose Redis is down until ``up`` is set; records what it is sent."""

    def __init__(self) -> None:
        self.up = False
        self.sent: list[tuple[str, str, int]] = []

    async def finish(self, lease: Lease, prompt: int, completion: int, now: datetime | None = None) -> bool:
        if not self.up:
            raise ConnectionError("down")
        self.sent.append(("finish", lease.lease_id, completion))
        return True

    async def send_finish(self, lease: Lease, prompt: int, completion: int, now: datetime) -> None:
        await self.finish(lease, prompt, completion, now)  # as ``Admission`` without a lean connection

    def read_replies(self) -> None:
        pass

    async def void(self, lease: Lease) -> bool:
        if not self.up:
            raise ConnectionError("down")
        self.sent.append(("void", lease.lease_id, 0))
        return True


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(billing, "RETRY_INITIAL_S", 0.001)
    monkeypatch.setattr(billing, "RETRY_MAX_S", 0.004)


def test_an_entry_is_in_the_file_when_append_returns(tmp_path: Path) -> None:
    kept = journal(tmp_path)
    assert kept.append(pending("L1"))
    # Read by another open, as a successor would after a SIGKILL: no close, no flush needed.
    assert decode_entries(kept.path.read_bytes()) == [pending("L1")]


def test_a_recorded_finish_is_not_replayed(tmp_path: Path) -> None:
    kept = journal(tmp_path)
    kept.append(pending("L1"))
    kept.append(pending("L2"))
    kept.recorded(pending("L1"))
    assert decode_entries(kept.path.read_bytes()) == [pending("L2")]


def test_a_torn_line_is_skipped(tmp_path: Path) -> None:
    kept = journal(tmp_path)
    kept.append(pending("L1"))
    with open(kept.path, "ab") as f:
        f.write(b'{"id": "acme:L2:gateway", "lease": "L2", "ten')
    assert decode_entries(kept.path.read_bytes()) == [pending("L1")]


def test_compaction_keeps_only_what_waits(tmp_path: Path) -> None:
    kept = journal(tmp_path)
    for i in range(5):
        kept.append(pending(f"L{i}"))
    kept.compact([pending("L4")])
    assert kept.num_lines == 1 and decode_entries(kept.path.read_bytes()) == [pending("L4")]
    kept.append(pending("L5"))  # appends go to the compacted file
    assert decode_entries(kept.path.read_bytes()) == [pending("L4"), pending("L5")]
    kept.compact([])
    assert kept.path.read_bytes() == b""


def test_a_full_journal_refuses(tmp_path: Path) -> None:
    kept = journal(tmp_path, max_entries=2)
    assert kept.append(pending("L1")) and kept.append(pending("L2"))
    assert not kept.append(pending("L3"))


def test_a_dead_workers_file_is_adopted_once_and_a_live_ones_never(tmp_path: Path) -> None:
    dead = journal(tmp_path)
    dead.append(pending("L1"))
    dead.append(pending("L2"))
    dead.recorded(pending("L1"))
    live = journal(tmp_path)
    live.append(pending("L9"))
    os.close(dead._fd)  # the worker died: the kernel released its lock (file left behind)
    successor = journal(tmp_path)
    assert successor.adopt() == [pending("L2")]
    assert not dead.path.exists() and live.path.exists()
    # Now in the successor's own file: it survives the successor too.
    assert decode_entries(successor.path.read_bytes()) == [pending("L2")]
    assert journal(tmp_path).adopt() == []  # the successor holds its file; the live worker its own


def test_a_file_held_by_another_process_is_not_adopted(tmp_path: Path) -> None:
    other = tmp_path / "finishes-1-abcd.jsonl"
    other.write_bytes(encode_entry(pending("L1")))
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a live worker elsewhere: holds the lock until killed
        fcntl.flock(os.open(other, os.O_RDWR), fcntl.LOCK_EX)
        os.write(ready_w, b"1")
        while True:
            signal.pause()
    try:
        assert os.read(ready_r, 1) == b"1"
        assert journal(tmp_path).adopt() == [] and other.exists()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert journal(tmp_path).adopt() == [pending("L1")]  # its worker is gone now


async def test_the_queue_journals_what_it_parks_and_marks_what_it_sends(tmp_path: Path) -> None:
    redis = Redis()
    kept = journal(tmp_path)
    queue = FinishQueue(redis, lambda exc: isinstance(exc, ConnectionError), kept)  # type: ignore[arg-type]
    await queue.finish(lease("L1"), 10, 7)
    queue.void(lease("L2"))
    on_disk = decode_entries(kept.path.read_bytes())
    assert [(p.lease.lease_id, p.kind) for p in on_disk] == [("L1", SettleKind.GATEWAY), ("L2", SettleKind.VOID)]
    redis.up = True
    for _ in range(400):
        if not queue.num_parked:
            break
        await asyncio.sleep(0.005)
    assert redis.sent == [("finish", "L1", 7), ("void", "L2", 0)]
    assert kept.path.read_bytes() == b""  # nothing waits: emptied


async def test_without_a_journal_nothing_is_written(tmp_path: Path) -> None:
    redis = Redis()
    queue = FinishQueue(redis, lambda exc: True)  # type: ignore[arg-type]
    await queue.finish(lease("L1"), 10, 7)
    assert queue.num_parked == 1 and not list(tmp_path.iterdir())
    redis.up = True
    await queue.close(timeout_s=1.0)
    assert redis.sent == [("finish", "L1", 7)]


async def test_a_restarted_queue_replays_the_journal_of_the_dead_one(tmp_path: Path) -> None:
    dead = journal(tmp_path)
    queue = FinishQueue(Redis(), lambda exc: True, dead)  # type: ignore[arg-type]
    await queue.finish(lease("L1"), 10, 7)
    os.close(dead._fd)  # SIGKILL: the parked finish lives on only in the file

    redis = Redis()
    redis.up = True
    successor = journal(tmp_path)
    restarted = FinishQueue(redis, lambda exc: True, successor)  # type: ignore[arg-type]
    restarted.restore(successor.adopt())
    await restarted.close(timeout_s=1.0)
    assert redis.sent == [("finish", "L1", 7)]


def test_an_old_journaled_finish_of_an_admitted_lease_is_not_replayed() -> None:
    now = datetime(2026, 12, 2, tzinfo=UTC)
    old = PendingFinish(lease("L1"), 1, 1, now - timedelta(seconds=SETTLED_MARKER_TTL_S + 1))
    assert not replayable(old, now)  # the settler billed it long ago; its marker may be gone
    assert replayable(PendingFinish(lease("L1"), 1, 1, now - timedelta(seconds=60)), now)
    assert replayable(PendingFinish(lease("L2", detached=True), 1, 1, old.finished_at), now)  # no settler
