"""A gateway worker's exit without dropping a stream: stop taking work, finish what is open, cut at a deadline.

On SIGTERM (Kubernetes sends it after the pod's ``preStop`` sleep, by when the Service no longer sends it
new connections) each worker of ``tessera gateway``:

1. begins draining at the signal itself (``LeanServer.handle_exit``): ``/ready`` answers 503 ``draining``
   and a new generation request is refused with 503 ``gateway_draining`` and ``Retry-After`` (a client
   retries it on a new connection, which lands on another pod);
2. at once (the signal ends the server tick's sleep, ``lean_server``) stops accepting: uvicorn closes the listening
   socket (with ``--workers`` > 1 the supervisor closes its copy too, ``lean_server.LeanSupervisor``, so a
   new connection is refused rather than left in the kernel's backlog), closes idle keep-alive connections
   and lets each open response finish on a connection that then closes;
3. at ``drain_timeout_s`` after the signal (TESSERA_DRAIN_TIMEOUT_S) cuts the requests still open
   (``GatewayDrain.cut``): each is cancelled, which ends its engine call (the replica aborts the vLLM
   request) and runs its ``settle`` phase, so it is billed for the tokens it generated; then it ends with
   the answer ``cut_answer`` picks: one SSE error event (``errors.error_body``) for a stream under way, a
   503 for a request that had sent nothing yet, nothing for one whose response was complete (it was only
   settling: cancelling it could lose its usage);
4. closes Redis only after every request has ended (at most ``SETTLE_GRACE_S`` more), so none loses its usage.

Invariant (tests/unit/platform/test_gateway_drain.py): a request is cut only after the deadline, never one
whose response is complete, and a cut request's answer is chosen by what it had sent.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.gateway.errors import APIError
from tessera.gateway.request.respond_stream import error_event
from tessera.gateway.responses import respond_error

if TYPE_CHECKING:
    from tessera.asgi import Send

logger = logging.getLogger(__name__)

# Where the app leaves its ``GatewayDrain`` in the ASGI lifespan state, for the server to find
# (``LeanServer``): the spec's one namespace that both sides of a worker see.
DRAIN_STATE_KEY = "tessera.gateway.drain"
# After the cut, uvicorn's own shutdown timeout cancels whatever is still open, without an answer and without
# waiting for it to settle: a backstop for a request stuck past its cut (a client that reads nothing), set
# well past the milliseconds a cut request takes to settle and answer, even on a starved CPU.
BACKSTOP_AFTER_DEADLINE_S = 10.0
# Then the worker's lifespan shutdown waits at most this for the open requests to settle before it closes
# Redis (parked finishes get FinishQueue.close's 2 s after that).
SETTLE_GRACE_S = 5.0
# Signal to exit, at worst: the deadline, the backstop, the settle grace, the parked finishes' 2 s. The chart's
# terminationGracePeriodSeconds adds this to preStop and the deadline.
EXIT_AFTER_DEADLINE_S = BACKSTOP_AFTER_DEADLINE_S + SETTLE_GRACE_S + 2.0
_POLL_S = 0.05


class CutAnswer(enum.Enum):
    """What a request cut at the deadline answers, after it settled."""

    ERROR_EVENT = "error_event"  # the SSE stream is under way: one error event ends it
    ERROR_RESPONSE = "error_response"  # nothing sent yet: a 503 error body
    LEAVE = "leave"  # the response is complete (the request is settling): not cut at all


@dataclass(frozen=True, slots=True)
class ResponseProgress:
    started: bool
    complete: bool


def cut_answer(progress: ResponseProgress) -> CutAnswer:
    if progress.complete:
        return CutAnswer.LEAVE
    return CutAnswer.ERROR_EVENT if progress.started else CutAnswer.ERROR_RESPONSE


def response_progress(send: Send) -> ResponseProgress:
    """How far the response on ``send`` has got, read from the server's own request cycle.

    NOTE: uvicorn's ``send`` is the bound method of its per-request cycle, which keeps ``response_started`` and
    ``response_complete`` (both protocol implementations; tests/unit/platform/test_gateway_drain.py checks
    it). Read once per open request at the cut, rather than wrapping ``send`` for every chunk of every
    stream. A server without them reads as a stream under way: it gets the error event."""
    cycle = getattr(send, "__self__", None)
    started = getattr(cycle, "response_started", True)
    complete = getattr(cycle, "response_complete", False)
    return ResponseProgress(bool(started), bool(complete))


def draining_error() -> APIError:
    """A request that arrives once the worker drains (on a connection opened before it stopped accepting)."""
    return APIError(503, "This gateway is shutting down; retry the request.", "gateway_draining",
                    headers={"Retry-After": "1"})


def cut_error(timeout_s: float) -> APIError:
    return APIError(503, f"The gateway shut down before the response ended (drain deadline of {timeout_s:g} s); "
                    "the tokens generated so far are billed. Retry the request.", "gateway_draining")


class GatewayDrain:
    """One worker's drain: its state, the generation requests it has open, and the cut at the deadline.

    Only the worker's event loop touches it, except ``begin``, which the signal handler calls (it only sets
    a float)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self.began_at: float | None = None
        self._open: dict[asyncio.Task[object], Send] = {}
        self._cut: dict[asyncio.Task[object], CutAnswer] = {}

    @property
    def draining(self) -> bool:
        return self.began_at is not None

    @property
    def num_open(self) -> int:
        return len(self._open)

    def begin(self) -> None:
        if self.began_at is None:
            self.began_at = self._clock()

    def seconds_to_deadline(self) -> float:
        assert self.began_at is not None, "the drain has not begun"
        return max(0.0, self.began_at + self.timeout_s - self._clock())

    def track(self, task: asyncio.Task[object], send: Send) -> None:
        self._open[task] = send

    def untrack(self, task: asyncio.Task[object]) -> None:
        self._open.pop(task, None)

    def cut(self) -> int:
        """Cancels the open requests that ``cut_answer`` does not leave; returns how many."""
        assert self.began_at is not None and self.seconds_to_deadline() == 0.0, "cut before the deadline"
        for task, send in list(self._open.items()):
            answer = cut_answer(response_progress(send))
            if answer is not CutAnswer.LEAVE and task not in self._cut:
                self._cut[task] = answer
                task.cancel()
        return len(self._cut)

    def take_cut(self, task: asyncio.Task[object]) -> CutAnswer | None:
        """The answer of ``task`` if the drain cut it (its ``CancelledError`` is then the drain's), else None."""
        return self._cut.pop(task, None)

    async def cut_at_deadline(self) -> None:
        # uvloop's timers have millisecond resolution and may fire that much early: sleep until the deadline
        # has really passed (``cut`` refuses to cut before it).
        while (left := self.seconds_to_deadline()) > 0.0:
            await asyncio.sleep(left)
        num_cut = self.cut()
        if num_cut:
            logger.warning("drain deadline (%.0f s) passed: %d requests cut", self.timeout_s, num_cut)

    async def wait_closed(self, timeout_s: float) -> int:
        """Waits until no generation request is open, at most ``timeout_s``; returns how many still are."""
        deadline = self._clock() + timeout_s
        while self._open and self._clock() < deadline:
            await asyncio.sleep(_POLL_S)
        return len(self._open)


async def answer_cut(send: Send, answer: CutAnswer, timeout_s: float, request_id: str) -> APIError:
    """The end of a request the drain cut, once it settled; returns the error it answered (for its span)."""
    err = cut_error(timeout_s)
    if answer is CutAnswer.ERROR_EVENT:
        await send({"type": "http.response.body", "body": error_event(err), "more_body": False})
    elif answer is CutAnswer.ERROR_RESPONSE:
        await respond_error(send, err, request_id)
    return err


__all__ = ["BACKSTOP_AFTER_DEADLINE_S", "DRAIN_STATE_KEY", "EXIT_AFTER_DEADLINE_S", "SETTLE_GRACE_S", "CutAnswer",
           "GatewayDrain", "ResponseProgress", "answer_cut", "cut_answer", "draining_error", "response_progress"]
