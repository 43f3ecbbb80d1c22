"""The achieved prompt lengths (the server's ``n_in``) reported beside the asked ones, per group."""

from __future__ import annotations

import pytest

from tessera_loadgen.metrics import summarize_run
from tessera_loadgen.records import RequestRecord
from tessera_loadgen.results import format_prompt_lengths, summary_rows


def record(i: int, asked: int | None, achieved: int, ok: bool = True) -> RequestRecord:
    r = RequestRecord(f"r{i}", "a", "c", "chat", True, t_sched=0.0)
    r.t_send_first = r.t_send = 0.0
    r.t_first = r.t_last = r.t_done = 0.1
    r.chunk_times = [0.1]
    r.n_out = 1
    r.n_in_asked, r.n_in = asked, achieved
    if not ok:
        r.fail("http_400", "too long", 0.2)
    return r


def test_summary_compares_asked_and_achieved_prompt_tokens() -> None:
    rows = [
        record(0, 200, 200),
        record(1, 200, 203),
        record(2, 600, 660),
        record(3, None, 50),
        record(4, 900, 0, False),
    ]
    summary = summarize_run(rows)
    lengths = summary["tenants"]["a"]["classes"]["c"]["prompt_tokens"]
    # Only completed requests with both lengths: not the ShareGPT-like one (no ask), not the failed one.
    assert lengths["num_compared"] == 3
    assert (lengths["asked"]["p50"], lengths["asked"]["mean"]) == (200, pytest.approx(1000 / 3))
    assert (lengths["achieved"]["p50"], lengths["achieved"]["max"]) == (203, 660)
    assert lengths["share_within_tolerance"] == pytest.approx(2 / 3)  # 203 is within 2 % of 200; 660 is not
    row = next(r for r in summary_rows(summary) if r["scope"] == "class")
    assert (row["prompt_tokens_asked_p50"], row["prompt_tokens_achieved_p50"]) == (200, 203)


def test_prompt_length_table_says_what_the_asked_lengths_are() -> None:
    summary = summarize_run([record(0, 200, 200), record(1, 200, 610)])
    exact = format_prompt_lengths(summary, "tokens")
    assert "  a/c" in exact and "50.0%" in exact and "asked in the model's tokens" in exact
    assert "asked in words (approximate: no tokenizer)" in format_prompt_lengths(summary, "approximate")
