"""contamination's run-end summary, in milliseconds: the dirty rows left without a finding of their own are counted."""
from __future__ import annotations

from harness.plugins.contamination.summary import span_counts, summary_message


def _row(example: str, status: str, longest: int) -> dict:
    return {"eval_set": "eval_dataset", "id": example, "status": status, "longest_span": longest}


def test_the_summary_counts_the_dirty_rows_past_max_reports() -> None:
    rows = [_row("0", "dirty", 40), _row("1", "dirty", 20), _row("2", "dirty", 14), _row("3", "partial", 13), _row("4", "clean", 0)]
    counts = span_counts(rows, 32, named={("eval_dataset", "0"), ("eval_dataset", "1")})
    assert counts["eval_dataset"] == {"rows": 5, "long_spans": 1, "dirty": 3, "partial": 1, "longest_span": 40, "unreported": 1}
    message = summary_message(counts, 32, 0.5, 13, "contamination/dirty_ids.rank-0.txt", "contamination/summary.rank-0.json", 2)
    assert message is not None
    assert "3 of 5 are dirty" in message and "1 of the dirty rows have no finding of their own (findings stop at 2 per rank and attempt" in message
    assert "contamination/summary.rank-0.json" in message
    everyone = span_counts(rows, 32, named={("eval_dataset", e) for e in "012"})
    assert "no finding of their own" not in (summary_message(everyone, 32, 0.5, 13, "ids.txt") or "")
    assert summary_message(span_counts(rows[3:], 32, named=set()), 32, 0.5, 13, "ids.txt") is None  # nothing dirty
