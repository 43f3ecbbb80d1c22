"""How long an engine takes to prefill a prompt, learned from this process's own requests, and when the prompts
it has queued at each engine should be prefilled: the wait a request would meet there, in seconds.

Why time and not tokens (issue #17, docs/routing.md "The wait priced in time"): a request that hits a prefix
waits behind whatever its holder still has to prefill. The holder's backlog in tokens says how much, not when
it ends: a 4,000-token prompt dispatched a moment ago and one nearly done read alike. Seconds do: a prompt's
prefill ends about ``fit.seconds(tokens)`` after it started, and it starts when it is dispatched or when the
one before it ends (first come, first served). With them, a policy can see that a hit reaches its first token
sooner on another engine that prefills the whole prompt at once than behind the holder's queue.

The fit: first-token delay against prompt tokens to prefill, least squares over the last ``FIT_SAMPLES``
requests that found their engine with nothing of this pod's to prefill (``isolated``: their delay is their own
prefill, the engine's step and the network, not a queue). Where the prompts barely differ in length (no slope
to fit), the delay is taken as proportional to the tokens. No fit until ``MIN_SAMPLES`` such requests came:
the policies then keep to the token counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

# The fit's window (isolated requests) and how often it is recomputed, in new samples: ~256 x 2 float ops
# every 16 requests, a few microseconds a request.
FIT_SAMPLES = 256
REFIT_EVERY = 16
MIN_SAMPLES = 16
# Prompts whose lengths spread less than this (tokens, standard deviation) give no slope worth fitting.
MIN_TOKEN_SPREAD = 8.0


class PrefillFit(NamedTuple):
    """First-token delay = ``intercept_s`` + ``s_per_token`` x prompt tokens to prefill."""

    intercept_s: float
    s_per_token: float

    def seconds(self, tokens: int) -> float:
        return self.intercept_s + self.s_per_token * tokens


def fit_prefill(samples: Sequence[tuple[int, float]]) -> PrefillFit | None:
    """The least-squares line through (tokens, delay s) samples, its slope positive and its intercept not
    negative; through the origin where the tokens barely spread or the line slopes down (noise); None with fewer
    than ``MIN_SAMPLES`` or no tokens at all."""
    if len(samples) < MIN_SAMPLES:
        return None
    count = len(samples)
    mean_tokens = sum(tokens for tokens, _ in samples) / count
    mean_delay = sum(delay for _, delay in samples) / count
    if mean_tokens <= 0:
        return None
    spread = sum((tokens - mean_tokens) ** 2 for tokens, _ in samples)
    if spread > count * MIN_TOKEN_SPREAD ** 2:
        slope = sum((tokens - mean_tokens) * (delay - mean_delay) for tokens, delay in samples) / spread
        if slope > 0:
            intercept = mean_delay - slope * mean_tokens
            if intercept >= 0:
                return PrefillFit(intercept, slope)
            # A negative intercept: the line through the origin with the same mean is the nearest sensible one.
    return PrefillFit(0.0, max(mean_delay, 0.0) / mean_tokens or 1e-9)


def fcfs_done_at(pending: Iterable[tuple[float, int]], fit: PrefillFit) -> float:
    """When the last of ``pending`` (dispatch time, tokens), in dispatch order, is prefilled: each starts when
    dispatched or when the one before it is done, whichever is later (0.0 for none)."""
    done = 0.0
    for dispatched_at, tokens in pending:
        done = max(done, dispatched_at) + fit.seconds(tokens)
    return done


class PrefillWaits(Mapping[str, float]):
    """Seconds from ``now`` until each engine should have prefilled what was sent there, read on demand from the
    finish times: a decision looks up the few engines it ranks, and pays for those, not for every engine with
    prompts in flight (hundreds in a large fleet). Engines with none, or overdue, are not in it."""

    __slots__ = ("_done_at", "_now")

    def __init__(self, done_at: Mapping[str, float], now: float) -> None:
        self._done_at = done_at
        self._now = now

    def __getitem__(self, engine_id: str) -> float:
        done = self._done_at[engine_id]
        if done <= self._now:
            raise KeyError(engine_id)
        return done - self._now

    def get(self, engine_id: str, default: float = 0.0) -> float:  # type: ignore[override]
        done = self._done_at.get(engine_id, 0.0)
        return done - self._now if done > self._now else default

    def __iter__(self) -> Iterator[str]:
        return (engine_id for engine_id, done in self._done_at.items() if done > self._now)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Pending(NamedTuple):
    dispatched_at: float
    tokens: int
    isolated: bool


class PrefillClock:
    """This process's prompts awaiting their first token, per engine, and the fit learned from them. Times are
    ``time.monotonic()`` seconds (CLOCK_MONOTONIC: one clock for every process of the host, which the pod's
    table relies on, pod_in_flight.py)."""

    __slots__ = ("_done_at", "_new_samples", "_next_ticket", "_pending", "_samples", "fit")

    def __init__(self) -> None:
        self._pending: dict[str, dict[int, _Pending]] = {}
        self._done_at: dict[str, float] = {}
        self._samples: deque[tuple[int, float]] = deque(maxlen=FIT_SAMPLES)
        self._new_samples = 0
        self._next_ticket = 0
        self.fit: PrefillFit | None = None

    @property
    def num_samples(self) -> int:
        """The isolated requests in the fit's window."""
        return len(self._samples)

    def idle(self, engine_id: str) -> bool:
        """Nothing of this process's awaits its first token at ``engine_id``."""
        return engine_id not in self._pending

    def dispatch(self, engine_id: str, tokens: int, now: float, isolated: bool) -> int:
        """Notes a prompt of ``tokens`` to prefill sent to ``engine_id`` at ``now``; ``isolated``: the engine had
        nothing of the pod's to prefill (its delay is a sample of the fit). Returns the ticket ``first_token``
        takes."""
        ticket = self._next_ticket
        self._next_ticket += 1
        self._pending.setdefault(engine_id, {})[ticket] = _Pending(now, tokens, isolated)
        self._update(engine_id)
        return ticket

    def first_token(self, engine_id: str, ticket: int, now: float) -> None:
        """The prompt of ``ticket`` is prefilled: its first token came at ``now``."""
        entry = self._take(engine_id, ticket)
        if entry is not None and entry.isolated:
            self._samples.append((entry.tokens, now - entry.dispatched_at))
            self._new_samples += 1
            if self._new_samples >= REFIT_EVERY or (self.fit is None and len(self._samples) >= MIN_SAMPLES):
                self._new_samples = 0
                self.fit = fit_prefill(self._samples)
        self._update(engine_id)

    def drop(self, engine_id: str, ticket: int) -> None:
        """The request of ``ticket`` ended without a first token (refused, failed, cut): no longer queued there,
        and its time is no sample of a prefill."""
        if self._take(engine_id, ticket) is not None:
            self._update(engine_id)

    def _take(self, engine_id: str, ticket: int) -> _Pending | None:
        queue = self._pending.get(engine_id)
        entry = queue.pop(ticket, None) if queue is not None else None
        if queue is not None and not queue:
            del self._pending[engine_id]
        return entry

    def done_at(self, engine_id: str) -> float:
        """When this process's prompts at ``engine_id`` should all be prefilled (0.0: none, or no fit yet)."""
        return self._done_at.get(engine_id, 0.0)

    def waits(self, now: float) -> PrefillWaits:
        """Seconds until each engine should have prefilled this process's prompts (engines with none left out): a
        view of the clock's live finish times, valid until its next event."""
        return PrefillWaits(self._done_at, now)

    def _update(self, engine_id: str) -> None:
        queue = self._pending.get(engine_id)
        if queue is None or self.fit is None:
            self._done_at.pop(engine_id, None)
            return
        # Dispatch order is insertion order (one process, one clock).
        self._done_at[engine_id] = fcfs_done_at(((p.dispatched_at, p.tokens) for p in queue.values()), self.fit)
