"""Usage is never lost: a request's ``finish`` (reconcile + usage) is retried until Redis takes it.

The request path calls ``FinishQueue.finish`` once, after the last token, also when the client went away or
the engine failed. When Redis does not answer (or is full: OOM under noeviction), the call is parked and
retried in the background with backoff; ``finish.lua`` is idempotent per lease, so a retry after a lost
reply does not count twice. A parked finish still holds its concurrency lease and its TPM reservation in
Redis until then, which errs on the side of the limits (the lease also expires by itself).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from redis.exceptions import OutOfMemoryError

from tessera.tenancy.admission import Admission, Lease

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


def _waits(exc: BaseException, is_transient: Callable[[BaseException], bool]) -> bool:
    """Whether a failed finish is parked. Besides the caller's transient errors: a Redis at maxmemory
    (noeviction, as Tessera requires) refuses the finish with OOM, and takes it once memory is freed."""
    return is_transient(exc) or isinstance(exc, OutOfMemoryError)


class FinishQueue:
    """Finishes leases now, or later when Redis is unreachable or full; ``is_transient`` says which other
    errors wait."""

    def __init__(self, admission: Admission, is_transient: Callable[[BaseException], bool]) -> None:
        self._admission = admission
        self._is_transient = is_transient
        self._parked: deque[PendingFinish] = deque()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    async def finish(self, lease: Lease, prompt_tokens: int, completion_tokens: int) -> None:
        pending = PendingFinish(lease, prompt_tokens, completion_tokens, datetime.now(UTC))
        try:
            await self._admission.finish(lease, prompt_tokens, completion_tokens, pending.finished_at)
        except Exception as exc:
            if not _waits(exc, self._is_transient):
                raise
            self._park(pending)

    def _park(self, pending: PendingFinish) -> None:
        if len(self._parked) >= MAX_PARKED:
            lost = self._parked.popleft()
            logger.error("usage of lease %s (tenant %s) dropped: %d finishes parked", lost.lease.lease_id,
                         lost.lease.tenant, MAX_PARKED)
        self._parked.append(pending)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        delay = RETRY_INITIAL_S
        while self._parked:
            await asyncio.sleep(delay)
            while self._parked:
                item = self._parked[0]
                try:
                    await self._admission.finish(item.lease, item.prompt_tokens, item.completion_tokens,
                                                 item.finished_at)
                except Exception as exc:
                    if not _waits(exc, self._is_transient):
                        logger.exception("usage of lease %s could not be recorded", item.lease.lease_id)
                        self._parked.popleft()
                        continue
                    delay = min(RETRY_MAX_S, delay * 2)
                    break
                self._parked.popleft()
                delay = RETRY_INITIAL_S

    async def close(self, timeout_s: float = 2.0) -> None:
        """Gives parked finishes one last chance (gateway shutdown); logs what could not be recorded."""
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
        for item in self._parked:
            logger.error("usage of lease %s (tenant %s: %d prompt + %d completion tokens) not recorded",
                         item.lease.lease_id, item.lease.tenant, item.prompt_tokens, item.completion_tokens)
