"""Usage is never lost: a request's ``finish`` (reconcile + usage) is retried until Redis takes it.

The request path calls ``FinishQueue.finish`` once, after the last token, also when the client went away or
the engine failed. Over the gateway's lean connection it returns as soon as the finish is written: Redis bills
on receipt, and the reply, read with the next request's admission or at the next whole second (an unhurried
call, redis_wire.py), only says whether it did; an error there parks the finish as below (NOSCRIPT included:
the retry loads the script), so the reply costs the request no wake-up of its own. When Redis does not
answer (or is full: OOM under noeviction), the call is parked and retried in the background with backoff;
``finish.lua`` is idempotent per lease, so a retry after a lost reply does not count twice. A parked finish
still holds its concurrency lease and its TPM reservation in Redis until then, which errs on the side of the
limits (the lease also expires by itself).

A parked finish is also written to a ``FinishJournal`` (gateway/finish_journal.py: a file in the gateway's
data dir), so neither a SIGKILL nor the end of the shutdown grace loses it: the next start replays it
(``restore``). A recorded one is marked done in the journal, so a replay never bills it twice even after its
done marker expired. ``void`` parks the undoing of an admission whose reply was lost the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from redis.exceptions import NoScriptError, OutOfMemoryError

from tessera.redis_wire import unhurried_failure
from tessera.tenancy.admission import SETTLED_MARKER_TTL_S, Admission, Lease
from tessera.tenancy.settlement import SettleKind

logger = logging.getLogger(__name__)

RETRY_INITIAL_S = 0.25
RETRY_MAX_S = 5.0
# Beyond this many parked finishes the oldest is dropped (and logged): memory stays bounded.
MAX_PARKED = 100_000


@dataclass(frozen=True, slots=True)
class PendingFinish:
    lease: Lease
    prompt_tokens: int
    completion_tokens: int
    finished_at: datetime
    kind: SettleKind = SettleKind.GATEWAY  # or VOID: undo a lost admission


class FinishJournal(Protocol):
    """Where parked finishes survive the process (gateway/finish_journal.py)."""

    def append(self, pending: PendingFinish) -> bool:
        """Keeps ``pending`` (written before this returns); False when the journal is full."""
        ...

    def recorded(self, pending: PendingFinish) -> None:
        """``pending`` reached Redis: a replay must skip it."""
        ...

    def compact(self, remaining: list[PendingFinish]) -> None:
        """Only ``remaining`` still waits: the journal may forget the rest."""
        ...

    def close(self) -> None: ...


def replayable(pending: PendingFinish, now: datetime) -> bool:
    """Whether a journaled finish may still be sent. A lease admitted through Redis that waited longer than a
    settled lease's marker lives was billed by the settler long ago (its gateway was gone that long), and its
    marker may be gone: sending it could bill twice. A detached (fail-open) lease has no settler: always."""
    return pending.lease.detached or (now - pending.finished_at).total_seconds() < SETTLED_MARKER_TTL_S


def _waits(exc: BaseException, is_transient: Callable[[BaseException], bool]) -> bool:
    """Whether a failed finish is parked. Besides the caller's transient errors: a Redis at maxmemory
    (noeviction, as Tessera requires) refuses the finish with OOM, and takes it once memory is freed."""
    return is_transient(exc) or isinstance(exc, OutOfMemoryError)


class FinishQueue:
    """Finishes leases now, or later when Redis is unreachable or full; ``is_transient`` says which other
    errors wait."""

    def __init__(self, admission: Admission, is_transient: Callable[[BaseException], bool],
                 journal: FinishJournal | None = None) -> None:
        self._admission = admission
        self._is_transient = is_transient
        self._journal = journal
        self._parked: deque[PendingFinish] = deque()
        self._task: asyncio.Task[None] | None = None
        # Unhurried finishes whose reply has not been read yet (``finish``).
        self._unanswered: set[asyncio.Future[list[Any]]] = set()

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_unanswered(self) -> int:
        """Finishes sent whose reply has not been read yet."""
        return len(self._unanswered)

    async def finish(self, lease: Lease, prompt_tokens: int, completion_tokens: int) -> None:
        """Sends the finish; its reply is handled when it comes (module docstring), or now without a lean
        connection. Raises only what ``_waits`` does not park, and only while sending."""
        pending = PendingFinish(lease, prompt_tokens, completion_tokens, datetime.now(UTC))
        try:
            reply = await self._admission.send_finish(lease, prompt_tokens, completion_tokens, pending.finished_at)
        except Exception as exc:
            if not _waits(exc, self._is_transient):
                raise
            self._park(pending)
            return
        if reply is not None:
            self._unanswered.add(reply)
            reply.add_done_callback(functools.partial(self._answered, pending))

    async def read_replies(self, timeout_s: float = 2.0) -> None:
        """Has the unhurried finishes' replies read now and waits for them (up to ``timeout_s``): those that
        failed are parked by the time it returns."""
        if self._unanswered:
            self._admission.read_replies()
            await asyncio.wait(list(self._unanswered), timeout=timeout_s)

    def _answered(self, pending: PendingFinish, reply: asyncio.Future[list[Any]]) -> None:
        """An unhurried finish's reply: nothing to do once billed (or billed before); parked to be sent again
        on a failure that waits (the lost connection, OOM, NOSCRIPT: the retry loads the script); logged on
        any other."""
        self._unanswered.discard(reply)
        failure = unhurried_failure(reply)
        if failure is None:
            return
        if isinstance(failure, asyncio.CancelledError | NoScriptError) or _waits(failure, self._is_transient):
            self._park(pending)
        else:
            logger.error("usage of lease %s (tenant %s) could not be recorded: %s", pending.lease.lease_id,
                         pending.lease.tenant, failure)

    async def unserved(self, lease: Lease) -> None:
        """Undoes the admission of a request no engine saw (none was live, the route could not be read, or
        every replica refused the connection): its slot in the rate window, its reservation and lease go back,
        nothing is billed — an outage must not spend the tenant's limits. A request an engine may have seen is
        always finished instead (a tenant whose requests break engines gets no free retries)."""
        if not lease.detached:
            await self._send_or_park(PendingFinish(lease, 0, 0, datetime.now(UTC), SettleKind.VOID))

    async def _send_or_park(self, pending: PendingFinish) -> None:
        try:
            await self._send(pending)
        except Exception as exc:
            if not _waits(exc, self._is_transient):
                raise
            self._park(pending)

    def void(self, lease: Lease) -> None:
        """Undoes, as soon as Redis answers, an admission whose reply never came (the client got an error):
        if the script ran, its reservation and lease are freed and nothing is billed (finish.lua). Parked at
        once: Redis has just failed to answer."""
        if not lease.detached:
            self._park(PendingFinish(lease, 0, 0, datetime.now(UTC), SettleKind.VOID))

    def restore(self, pending: list[PendingFinish]) -> None:
        """Parks the finishes a journal kept from an earlier process (already in this one's journal)."""
        now = datetime.now(UTC)
        for item in pending:
            if replayable(item, now):
                self._park(item, journaled=True)
            else:
                logger.error("journaled finish of lease %s (tenant %s) from %s dropped: the settler billed it "
                             "long ago", item.lease.lease_id, item.lease.tenant, item.finished_at.isoformat())

    def _park(self, pending: PendingFinish, journaled: bool = False) -> None:
        if len(self._parked) >= MAX_PARKED:
            lost = self._parked.popleft()
            logger.error("usage of lease %s (tenant %s) dropped: %d finishes parked", lost.lease.lease_id,
                         lost.lease.tenant, MAX_PARKED)
        if not journaled and self._journal is not None and not self._journal.append(pending):
            logger.error("finish of lease %s (tenant %s) kept in memory only: the journal is full",
                         pending.lease.lease_id, pending.lease.tenant)
        self._parked.append(pending)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _send(self, item: PendingFinish) -> None:
        if item.kind is SettleKind.VOID:
            await self._admission.void(item.lease)
        else:
            await self._admission.finish(item.lease, item.prompt_tokens, item.completion_tokens, item.finished_at)

    async def _drain(self) -> None:
        delay = RETRY_INITIAL_S
        while self._parked:
            await asyncio.sleep(delay)
            num_sent = 0
            while self._parked:
                item = self._parked[0]
                try:
                    await self._send(item)
                except Exception as exc:
                    if not _waits(exc, self._is_transient):
                        logger.exception("usage of lease %s could not be recorded", item.lease.lease_id)
                        self._parked.popleft()
                        continue
                    delay = min(RETRY_MAX_S, delay * 2)
                    break
                self._parked.popleft()
                num_sent += 1
                if self._journal is not None:
                    self._journal.recorded(item)
                delay = RETRY_INITIAL_S
            if num_sent and self._journal is not None:
                self._journal.compact(list(self._parked))

    async def close(self, timeout_s: float = 2.0) -> None:
        """Reads the replies still unread, gives parked finishes one last chance (gateway shutdown); logs what
        could not be recorded."""
        await self.read_replies(timeout_s)
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
        kept = "kept in the journal for the next start" if self._journal is not None else "not recorded"
        for item in self._parked:
            logger.error("usage of lease %s (tenant %s: %d prompt + %d completion tokens) %s",
                         item.lease.lease_id, item.lease.tenant, item.prompt_tokens, item.completion_tokens, kept)
        if self._journal is not None:
            self._journal.close()
