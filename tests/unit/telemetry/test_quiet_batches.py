"""Batches from a thread that sleeps while nothing comes (quiet_batches.py): handed on after the delay, sooner
when a batch is full, bounded, and not a single wake-up of the thread while idle (the SDK's batch processor
wakes every delay)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from tessera.telemetry.quiet_batches import QuietBatches, QuietSpanProcessor


class Sink:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.handed = threading.Event()

    def __call__(self, batch: list[int]) -> None:
        self.batches.append(batch)
        self.handed.set()


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not handed on in time"
        time.sleep(0.005)


def _times_scheduled(thread: threading.Thread) -> int:
    """How many times the kernel has run ``thread`` (its schedstat's third field): each wake-up counts."""
    return int(Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()[2])


def _thread_named(name: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == name)


def test_items_go_on_together_after_the_delay_and_at_once_on_flush() -> None:
    sink = Sink()
    batches: QuietBatches[int] = QuietBatches(sink, delay_s=0.05, name="test-batches")
    batches.add(1)
    batches.add(2)
    _wait_for(lambda: bool(sink.batches))
    assert sink.batches == [[1, 2]]
    batches.add(3)
    batches.flush()  # in the caller's thread, now
    assert sink.batches == [[1, 2], [3]]
    batches.stop()


def test_a_full_batch_goes_on_before_the_delay() -> None:
    sink = Sink()
    batches: QuietBatches[int] = QuietBatches(sink, delay_s=60, name="test-full", max_batch=3)
    for item in range(3):
        batches.add(item)
    _wait_for(lambda: bool(sink.batches))
    assert sink.batches == [[0, 1, 2]]
    batches.stop()


def test_at_most_max_items_wait_and_none_are_taken_after_stop() -> None:
    sink = Sink()
    batches: QuietBatches[int] = QuietBatches(sink, delay_s=60, name="test-bound", max_batch=2, max_items=3)
    assert [batches.add(item) for item in range(4)] == [True, True, True, False]
    batches.stop()  # hands on what waits, in batches of at most max_batch
    assert sink.batches == [[0, 1], [2]]
    assert batches.add(9) is False


def test_a_failing_sink_does_not_end_the_thread(caplog: pytest.LogCaptureFixture) -> None:
    handed: list[list[int]] = []

    def sink(batch: list[int]) -> None:
        handed.append(batch)
        if batch == [1]:
            raise OSError("disk full")

    batches: QuietBatches[int] = QuietBatches(sink, delay_s=0.01, name="test-failing")
    batches.add(1)
    _wait_for(lambda: bool(handed))
    batches.add(2)
    _wait_for(lambda: len(handed) == 2)
    assert handed == [[1], [2]] and "could not be handed on" in caplog.text
    batches.stop()


def test_the_thread_is_not_woken_while_nothing_comes() -> None:
    """The defence: the SDK's processor at the same delay is scheduled every 0.1 s here, ours not once."""
    sink = Sink()
    batches: QuietBatches[int] = QuietBatches(sink, delay_s=0.1, name="test-quiet")
    batches.add(1)
    _wait_for(lambda: bool(sink.batches))
    time.sleep(0.05)  # the thread is back in its wait
    ours = _thread_named("test-quiet")
    sdk = BatchSpanProcessor(InMemorySpanExporter(), schedule_delay_millis=100)
    theirs = next(t for t in threading.enumerate() if t.name.startswith("OtelBatchSpan") and t.is_alive())
    ours_before, theirs_before = _times_scheduled(ours), _times_scheduled(theirs)
    time.sleep(1.0)
    assert _times_scheduled(ours) == ours_before
    assert _times_scheduled(theirs) >= theirs_before + 5  # the check itself can see wake-ups
    sdk.shutdown()
    batches.stop()


def test_the_span_processor_exports_the_sampled_spans_in_batches() -> None:
    exporter = InMemorySpanExporter()
    processor = QuietSpanProcessor(exporter, delay_s=0.02)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    with provider.get_tracer("test").start_as_current_span("a"):
        pass
    _wait_for(lambda: len(exporter.get_finished_spans()) == 1)
    provider.get_tracer("test").start_span("b").end()
    provider.force_flush()
    assert [s.name for s in exporter.get_finished_spans()] == ["a", "b"]
    unsampled = TracerProvider(sampler=ALWAYS_OFF)
    unsampled.add_span_processor(processor)
    unsampled.get_tracer("test").start_span("c").end()
    processor.force_flush()
    assert len(exporter.get_finished_spans()) == 2
    provider.shutdown()  # hands on what waits, shuts the exporter down
    provider.get_tracer("test").start_span("d").end()
    assert processor.num_dropped == 1 and len(exporter.get_finished_spans()) == 2


def test_stop_ends_the_thread_even_in_the_middle_of_a_batch() -> None:
    sink = Sink()
    batches: QuietBatches[int] = QuietBatches(sink, delay_s=60, name="test-stop")
    batches.add(1)
    time.sleep(0.2)  # the thread now waits out the batch's delay
    thread = _thread_named("test-stop")
    batches.stop()
    thread.join(5)
    assert not thread.is_alive() and sink.batches == [[1]]


def test_handed_to_the_caller_items_wait_for_its_flush_and_no_thread_runs() -> None:
    sink = Sink()
    batches: QuietBatches[int] = QuietBatches(sink, delay_s=0.01, name="test-caller")
    batches.hand_to_caller()
    batches.add(1)
    batches.add(2)
    time.sleep(0.1)
    assert sink.batches == [] and not any(t.name == "test-caller" for t in threading.enumerate())
    batches.flush()
    assert sink.batches == [[1, 2]]
