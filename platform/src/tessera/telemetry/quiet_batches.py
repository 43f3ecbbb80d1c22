"""Batches handed on from a thread of their own that sleeps while nothing comes.

The SDK's ``BatchSpanProcessor`` wakes its export thread every ``schedule_delay`` whether or not a span is
queued: at the 0.5 s delay Tessera's processes use, two wake-ups a second in every gateway worker, engine
replica and controller, with nothing to export. On this project's VMs a wake-up after a pause costs ~100-170
µs of CPU (docs/performance.md section 9), so an idle gateway paid ~0.3 ms/s a worker for it. Here the thread
waits for the first item of a batch with no timeout, then ``delay_s`` for the rest of it (or less, once
``max_batch`` items are waiting), and hands the batch on: as prompt under load, silent while idle.

``QuietBatches`` is the batching (``SpanLines`` writes its encoded lines through one); ``QuietSpanProcessor``
is the SDK span processor made of it, in place of ``BatchSpanProcessor`` (same queue bound and batch size;
a span past the bound is dropped and counted, as there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter

T = TypeVar("T")

# The SDK's BatchSpanProcessor defaults (OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE).
MAX_QUEUED_SPANS = 2048
MAX_EXPORT_BATCH = 512

logger = logging.getLogger(__name__)


class QuietBatches(Generic[T]):
    """Items given to ``sink`` in batches of at most ``max_batch``, ``delay_s`` after the first item of a
    batch (sooner once ``max_batch`` wait), from a daemon thread started by the first item; at most
    ``max_items`` wait (``add`` returns False for one past it). ``flush`` hands on what waits, now, in the
    caller's thread (after ``hand_to_caller``, only then); after ``stop`` items are refused and the thread ends."""

    def __init__(self, sink: Callable[[list[T]], object], delay_s: float, name: str,
                 max_batch: int = MAX_EXPORT_BATCH, max_items: int = MAX_QUEUED_SPANS) -> None:
        self._sink = sink
        self._delay_s = delay_s
        self._name = name
        self._max_batch = max(1, max_batch)
        self._max_items = max(1, max_items)
        self._items: list[T] = []
        self._lock = threading.Lock()
        self._sink_lock = threading.Lock()  # one batch handed on at a time, in order
        self._due = threading.Event()  # set by a batch's first item
        self._full = threading.Event()  # set once max_batch items wait: the delay ends early
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._caller_flushes = False
        os.register_at_fork(after_in_child=self._forget_thread)

    def add(self, item: T) -> bool:
        """Queues ``item``; False (nothing queued) once stopped or while ``max_items`` wait."""
        with self._lock:
            if self._stopped or len(self._items) >= self._max_items:
                return False
            self._items.append(item)
            if self._caller_flushes:
                return True
            num_items = len(self._items)
            if num_items == 1:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._due.set()
            if num_items == self._max_batch:
                self._full.set()
        return True

    def _run(self) -> None:
        while True:
            self._due.wait()
            if self._stopped:
                return
            # Items that come meanwhile join this batch: one hand-on per ``delay_s`` under load.
            self._full.wait(self._delay_s)
            if self._stopped:
                return  # ``stop`` hands on what waits
            self._due.clear()
            self._full.clear()
            self.flush()

    def flush(self) -> None:
        with self._sink_lock:
            with self._lock:
                items, self._items = self._items, []
            for start in range(0, len(items), self._max_batch):
                batch = items[start:start + self._max_batch]
                try:
                    self._sink(batch)
                except Exception:  # the telemetry's sink failing must not end the thread, nor its caller
                    logger.exception("%s: a batch of %d could not be handed on", self._name, len(batch))

    def hand_to_caller(self) -> None:
        """From now on the caller hands the items on (``flush``, on a period of its own): no thread is woken."""
        self._caller_flushes = True

    def stop(self) -> None:
        """Refuses further items, hands on what waits, and ends the thread."""
        self._stopped = True
        self._due.set()
        self._full.set()
        self.flush()

    def _forget_thread(self) -> None:
        """A forked child has no copy of the thread, and what waited is the parent's to hand on."""
        self._thread = None
        self._lock = threading.Lock()
        self._sink_lock = threading.Lock()
        self._due, self._full = threading.Event(), threading.Event()
        self._items = []


class QuietSpanProcessor(SpanProcessor):
    """The SDK's batch span processor, quiet while no span ends (see the module docstring)."""

    def __init__(self, exporter: SpanExporter, delay_s: float = 0.5) -> None:
        self._exporter = exporter
        self._batches: QuietBatches[ReadableSpan] = QuietBatches(exporter.export, delay_s, "tessera-span-export")
        self.num_dropped = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if not self._batches.add(span):
            self.num_dropped += 1  # the queue is full (an exporter that cannot keep up) or shut down

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._batches.flush()
        return True

    def shutdown(self) -> None:
        self._batches.stop()
        self._exporter.shutdown()


__all__ = ["MAX_EXPORT_BATCH", "MAX_QUEUED_SPANS", "QuietBatches", "QuietSpanProcessor"]
