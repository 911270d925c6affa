"""The durable outbox (harness.lib.journal): records delivered from a persisted cursor, never lost, torn lines skipped."""
from __future__ import annotations

from pathlib import Path

from harness.lib.journal import Journal


def _records(n: int, start: int = 0) -> list[dict[str, int]]:
    return [{"i": i} for i in range(start, start + n)]


def test_pending_reads_from_the_committed_cursor(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "out.jsonl")
    journal.append(_records(5))
    assert journal.cursor == 0
    first, offset = journal.pending(max_records=3)
    assert first == _records(3)
    journal.commit(offset)
    assert journal.cursor == offset
    rest, end = journal.pending(max_records=10)
    assert rest == _records(2, start=3)
    assert end == (tmp_path / "out.jsonl").stat().st_size
    journal.close()


def test_a_delivery_not_committed_is_delivered_again(tmp_path: Path) -> None:
    """A kill between delivery and commit re-delivers: deliveries must be idempotent."""
    journal = Journal(tmp_path / "out.jsonl")
    journal.append(_records(2))
    assert journal.pending(10)[0] == journal.pending(10)[0] == _records(2)
    journal.close()


def test_the_cursor_survives_a_new_process_and_readers_are_independent(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    writer = Journal(path)
    writer.append(_records(4))
    _, offset = writer.pending(2)
    writer.commit(offset)
    writer.close()
    again, other = Journal(path), Journal(path, cursor="mirror")
    assert again.pending(10)[0] == _records(2, start=2)
    assert other.cursor == 0 and other.pending(10)[0] == _records(4)
    assert other.cursor_path.name == "out.jsonl.mirror"
    again.close(), other.close()


def test_an_unfinished_last_line_waits_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"i": 0}\n{"i": tor\n{"i": 2}\n{"i": 3')  # a torn line closed by a later writer; one still being written
    journal = Journal(path)  # opening for append ends the unfinished line first
    records, offset = journal.read(0, 10)
    assert [r["i"] for r in records] == [0, 2]
    journal.append([{"i": 4}])
    records, _ = journal.read(offset, 10)
    assert records == [{"i": 4}]  # the fragment '{"i": 3' became its own torn line, the new record stays whole
    journal.close()


def test_a_damaged_cursor_file_restarts_from_zero_and_unsent_bytes_count_down(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "out.jsonl")
    journal.append(_records(3))
    size = (tmp_path / "out.jsonl").stat().st_size
    assert journal.unsent_bytes() == size
    journal.cursor_path.write_text("not a number", encoding="utf-8")
    assert journal.cursor == 0
    journal.commit(size)
    assert journal.unsent_bytes() == 0 and journal.pending(10) == ([], size)
    journal.append([])  # nothing to write is a no-op
    assert journal.unsent_bytes() == 0
    journal.close()
