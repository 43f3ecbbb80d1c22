"""The finishes that could not reach Redis, kept on disk until they do (``tenancy.billing.FinishJournal``).

One file per gateway worker in the journal directory (``TESSERA_FINISH_JOURNAL_DIR``), held under an
exclusive ``flock`` while the worker lives. A line is one JSON object: a parked finish, or ``{"done": id}``
once it reached Redis. A file nobody holds belongs to a worker that is gone (SIGKILL, OOM, a shutdown that
ran out of time): a worker adopts it when it starts (``adopt``), copies what still waits into its own file,
deletes it, and replays it.

Bounds:
- SIGKILL loses nothing journaled: each line goes to the kernel in one ``write`` before ``append`` returns.
  A crash of the machine loses at most the lines of the last ``fsync_interval_s`` (fsync'd on that timer).
- At most ``max_entries`` lines (finishes and done marks) per file; beyond it a finish is kept in memory only
  (``append`` answers False and the queue logs it). The file is rewritten with only what still waits after
  every pass that recorded something, and emptied when nothing waits.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from tessera.tenancy.admission import Lease
from tessera.tenancy.billing import PendingFinish
from tessera.tenancy.settlement import SettleKind

logger = logging.getLogger(__name__)

FILE_PREFIX = "finishes-"
FILE_SUFFIX = ".jsonl"


def _entry_id(pending: PendingFinish) -> str:
    return f"{pending.lease.tenant}:{pending.lease.lease_id}:{pending.kind.value}"


def encode_entry(pending: PendingFinish) -> bytes:
    lease = pending.lease
    return orjson.dumps({"id": _entry_id(pending), "lease": lease.lease_id, "tenant": lease.tenant,
                         "reserved": lease.reserved_tokens, "keys": list(lease.keys), "detached": lease.detached,
                         "prompt": pending.prompt_tokens, "completion": pending.completion_tokens,
                         "at": pending.finished_at.timestamp(), "kind": pending.kind.value}) + b"\n"


def encode_done(pending: PendingFinish) -> bytes:
    return orjson.dumps({"done": _entry_id(pending)}) + b"\n"


def decode_entries(data: bytes) -> list[PendingFinish]:
    """The finishes of a journal file that were never marked done, in order; a torn or foreign line (a
    machine crash mid-write) is skipped and logged."""
    pending: dict[str, PendingFinish] = {}
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            raw: dict[str, Any] = orjson.loads(line)
            if "done" in raw:
                pending.pop(str(raw["done"]), None)
                continue
            lease = Lease(str(raw["lease"]), str(raw["tenant"]), int(raw["reserved"]),
                          tuple(str(k) for k in raw["keys"]), bool(raw["detached"]))
            item = PendingFinish(lease, int(raw["prompt"]), int(raw["completion"]),
                                 datetime.fromtimestamp(float(raw["at"]), UTC), SettleKind(raw["kind"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            logger.error("finish journal line skipped (%s): %r", exc, line[:200])
            continue
        pending[_entry_id(item)] = item
    return list(pending.values())


@dataclass(frozen=True, slots=True)
class JournalConfig:
    directory: Path
    max_entries: int
    fsync_interval_s: float


class FinishJournal:
    """This worker's journal file (see the module docstring); ``open`` it in the event loop."""

    def __init__(self, config: JournalConfig) -> None:
        if config.max_entries < 1 or config.fsync_interval_s <= 0:
            raise ValueError(f"finish journal needs max_entries >= 1 and fsync_interval_s > 0, got {config}")
        self.config = config
        self.path = config.directory / f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{FILE_SUFFIX}"
        self._fd = -1
        self._num_lines = 0
        self._dirty = False
        self._fsync_timer: asyncio.TimerHandle | None = None

    def open(self) -> FinishJournal:
        self.config.directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return self

    @property
    def num_lines(self) -> int:
        return self._num_lines

    def adopt(self) -> list[PendingFinish]:
        """The waiting finishes of every file no live worker holds, moved into this one's file."""
        adopted: list[PendingFinish] = []
        for path in sorted(self.config.directory.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}")):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # another worker adopted it meanwhile
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its worker lives
                if os.fstat(fd).st_nlink == 0:
                    continue  # adopted and deleted by another worker between our open and our lock
                items = decode_entries(path.read_bytes())
                for item in items:
                    self._write(encode_entry(item))
                self._sync()
                path.unlink()  # under the lock: no other worker adopts it twice
                if items:
                    logger.warning("finish journal %s adopted: %d finishes to replay", path.name, len(items))
                adopted += items
            finally:
                os.close(fd)
        return adopted

    # ---- tenancy.billing.FinishJournal ---------------------------------------------------------------

    def append(self, pending: PendingFinish) -> bool:
        if self._fd < 0 or self._num_lines >= self.config.max_entries:
            return False
        self._write(encode_entry(pending))
        return True

    def recorded(self, pending: PendingFinish) -> None:
        if self._fd >= 0:
            # NOTE: past max_entries too: a done mark that is missing could bill a replayed finish twice.
            self._write(encode_done(pending))

    def compact(self, remaining: list[PendingFinish]) -> None:
        """Rewrites the file with ``remaining`` only: written beside it, fsync'd, then renamed over it; the
        lock moves to the new file (no other worker could take the old one meanwhile: it is held)."""
        if self._fd < 0:
            return
        if not remaining:
            os.ftruncate(self._fd, 0)
            self._num_lines = 0
            self._sync()
            return
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"".join(encode_entry(item) for item in remaining))
        os.fsync(fd)
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd, self._num_lines, self._dirty = fd, len(remaining), False

    def close(self) -> None:
        """Syncs and releases the file; what it holds is replayed by the next worker that starts."""
        if self._fsync_timer is not None:
            self._fsync_timer.cancel()
        if self._fd >= 0:
            self._sync()
            empty = self._num_lines == 0
            os.close(self._fd)
            self._fd = -1
            if empty:
                self.path.unlink(missing_ok=True)

    # ---- the file ------------------------------------------------------------------------------------

    def _write(self, line: bytes) -> None:
        os.write(self._fd, line)  # one write per line: a SIGKILL never tears it
        self._num_lines += 1
        if not self._dirty:
            self._dirty = True
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._sync()
                return
            self._fsync_timer = loop.call_later(self.config.fsync_interval_s, self._sync)

    def _sync(self) -> None:
        if self._fd >= 0 and self._dirty:
            os.fsync(self._fd)
        self._dirty = False
