"""The data ledger around a resume (harness.lib.ledger): attempts, what was trained before and what came next."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.lib.ledger import Continuation, LedgerWriter, around_resume, continuation, iter_records, last_attempt, ledger_path, read_ledger


def _record(step: int, micro_batch: int = 0) -> dict[str, object]:
    return {"step": step, "micro_batch": micro_batch, "epoch": 0, "batch_hash": f"b{step}.{micro_batch}",
            "sample_hashes": [f"h{step}.{micro_batch}"], "sample_ids": [step * 10 + micro_batch]}


def _attempt(run_dir: Path, start: int, steps: range, resume_step: int | None = None) -> LedgerWriter:
    writer = LedgerWriter(run_dir, rank=0, fsync_every=1, resume_step=resume_step)
    writer.start(step=start, world_size=1, resumed_from=None if resume_step is None else f"checkpoint-{resume_step}")
    for step in steps:
        writer.write_step([_record(step, 0), _record(step, 1)])
    return writer


def _steps(records: list[dict[str, object]]) -> list[tuple[object, object, object]]:
    return sorted((r["attempt"], r["step"], r["micro_batch"]) for r in records)


def test_a_resume_sees_what_was_trained_up_to_it_and_what_the_killed_run_did_next(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 7)).close()  # attempt 1 trained steps 1..6, then was killed
    resumed = _attempt(tmp_path, 4, range(0), resume_step=4)  # attempt 2 resumes checkpoint-4
    assert resumed.attempt == 2
    before, after = around_resume(tmp_path, 0, 4)
    assert _steps(before) == [(1, s, m) for s in range(1, 5) for m in (0, 1)]
    assert _steps(after) == [(1, s, m) for s in (5, 6) for m in (0, 1)]
    resumed.close()


def test_the_running_attempt_is_left_out_and_the_newest_earlier_attempt_wins(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 7)).close()  # attempt 1: steps 1..6
    _attempt(tmp_path, 4, range(5, 9), resume_step=4).close()  # attempt 2: resumed at 4, trained 5..8
    running = _attempt(tmp_path, 5, range(6, 8), resume_step=5)  # attempt 3: resumed at 5, already trained 6, 7
    assert running.attempt == 3 and last_attempt(ledger_path(tmp_path, 0)) == 3
    before, after = around_resume(tmp_path, 0, 5)
    assert _steps(before) == [(1, s, m) for s in range(1, 5) for m in (0, 1)] + [(2, 5, 0), (2, 5, 1)]
    assert _steps(after) == [(2, s, m) for s in (6, 7, 8) for m in (0, 1)]  # attempt 2's next steps, not attempt 1's
    running.close()


def test_a_line_cut_by_a_kill_is_skipped_and_attempts_stay_distinct(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 3)).close()
    path = ledger_path(tmp_path, 0)
    with open(path, "ab") as handle:
        handle.write(b'{"attempt": 1, "step": 3, "micro')  # killed mid-line
    resumed = _attempt(tmp_path, 2, range(3, 4), resume_step=2)
    assert resumed.attempt == 2
    resumed.close()
    frame = read_ledger(tmp_path)
    assert sorted(zip(frame.attempt, frame.step)) == [(1, 1), (1, 1), (1, 2), (1, 2), (2, 3), (2, 3)]


def test_read_ledger_marks_steps_trained_past_the_resumed_checkpoint(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 5)).close()
    _attempt(tmp_path, 2, range(3, 5), resume_step=2).close()
    frame = read_ledger(tmp_path)
    superseded = sorted(set(zip(frame.attempt[frame.superseded], frame.step[frame.superseded])))
    assert superseded == [(1, 3), (1, 4)]
    assert list(frame.columns)[-1] == "superseded" and set(frame.sample_id) == {s * 10 + m for s in range(1, 5) for m in (0, 1)}


def test_no_ledger_means_nothing_around_the_resume(tmp_path: Path) -> None:
    assert around_resume(tmp_path, 0, 3) == ([], [])
    assert last_attempt(ledger_path(tmp_path, 0)) == 0


def test_the_per_step_fast_path_writes_the_same_lines_as_records(tmp_path: Path) -> None:
    """``write_hashes`` formats lines itself (the per-step path); they must be the bytes ``write_step`` writes."""
    cases = [(0, "00ff", ["0a", "0b"], None), (1, "01", [], [1, 2]), (2, "02", ["0c"], ['a"b', "ü"])]
    writer = LedgerWriter(tmp_path, rank=0)
    writer.write_hashes(5, 1, cases)
    writer.write_step([{"step": 5, "micro_batch": m, "epoch": 1, "batch_hash": b, "sample_hashes": s, "sample_ids": i}
                       for m, b, s, i in cases])
    writer.close()
    lines = [line for line in writer.path.read_text().splitlines() if '"event"' not in line]
    assert len(lines) == 6 and lines[:3] == lines[3:]


KILLED_ATTEMPT = """
import os, signal, sys
from pathlib import Path
from harness.lib.ledger import LedgerWriter
writer = LedgerWriter(Path(sys.argv[1]), rank=0, fsync_every=1000)
writer.start(step=0, world_size=1, resumed_from=None)
for step in range(1, 7):
    writer.write_hashes(step, 0, [(0, f"{step:016x}", [f"{step:016x}"], [step])])
os.kill(os.getpid(), signal.SIGKILL)  # no close, no fsync: what the page cache holds is all there is
"""


def test_a_kill_9_loses_no_step_and_the_resumed_attempt_continues_the_file(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    kept = [r.get("step") for r in iter_records(ledger_path(tmp_path, 0))]  # as the killed run left it: with its unwritten window
    assert kept == [0, 1, 2, 3, 4, 5, 6]
    resumed = LedgerWriter(tmp_path, rank=0, resume_step=4)
    resumed.start(step=4, world_size=1, resumed_from="checkpoint-4")
    before, after = around_resume(tmp_path, 0, 4)
    assert resumed.attempt == 2 and [r["step"] for r in before] == [1, 2, 3, 4] and [r["step"] for r in after] == [5, 6]
    for step in range(5, 8):
        resumed.write_step([_record(step)])
    resumed.close()
    raw = ledger_path(tmp_path, 0).read_bytes()
    assert b"\0" not in raw and raw.endswith(b"\n")
    frame = read_ledger(tmp_path)
    assert sorted(set(zip(frame.attempt, frame.step))) == [(1, s) for s in range(1, 7)] + [(2, s) for s in range(5, 8)]
    assert sorted(set(frame.step[frame.superseded])) == [5, 6]


# -- attempts numbered by the run, and the interrupted run read over all its ranks (issue 43, item 4) -----------------


def _rank_record(step: int, rank: int, rows: int = 2) -> dict[str, object]:
    return {"step": step, "micro_batch": 0, "epoch": 0, "batch_hash": f"b{step}.{rank}",
            "sample_hashes": [f"h{step}.{rank}.{i}" for i in range(rows)], "sample_ids": None}


def _ranks_attempt(run_dir: Path, ranks: range, start: int, steps: range, resume_step: int | None = None) -> list[LedgerWriter]:
    """One attempt on ``ranks``: every rank opens its writer and writes its start line, then each step on every rank."""
    writers = []
    for rank in ranks:
        writer = LedgerWriter(run_dir, rank=rank, fsync_every=1, resume_step=resume_step)
        writer.start(step=start, world_size=len(ranks), resumed_from=None if resume_step is None else f"checkpoint-{resume_step}")
        writers.append(writer)
    for step in steps:
        for rank, writer in zip(ranks, writers):
            writer.write_step([_rank_record(step, rank, rows=2 * 2 // len(ranks))])
    return writers


def test_a_rank_that_joins_at_a_resume_takes_the_runs_attempt_number(tmp_path: Path) -> None:
    """1 process trained steps 1-15; the resume on 2 processes is attempt 2 on both ranks. Rank 1, without a ledger of
    its own, numbered it 1 (the killed run's number): the two attempts could not be told apart across the files."""
    for writer in _ranks_attempt(tmp_path, range(1), 0, range(1, 16)):
        writer.close()
    resumed = _ranks_attempt(tmp_path, range(2), 10, range(11, 13), resume_step=10)  # rank 0 writes its start line first
    assert [w.attempt for w in resumed] == [2, 2]
    for writer in resumed:
        writer.close()
    # the other order: rank 1 opens its writer first
    again = [LedgerWriter(tmp_path, rank=r, resume_step=12) for r in (1, 0)]
    assert [w.attempt for w in again] == [3, 3]
    for writer in again:
        writer.close()


def test_an_attempt_killed_before_its_first_step_does_not_split_the_numbering(tmp_path: Path) -> None:
    """Start lines with no step after them (this attempt's other ranks, or an attempt killed at its start) never make
    one rank of a launch number differently from another."""
    for writer in _ranks_attempt(tmp_path, range(2), 0, range(1, 4)):
        writer.close()
    dead = LedgerWriter(tmp_path, rank=0, resume_step=2)  # killed before its first step: rank 0's start line only
    dead.start(step=2, world_size=2, resumed_from="checkpoint-2")
    dead.close()
    launch = _ranks_attempt(tmp_path, range(2), 2, range(3, 5), resume_step=2)
    assert [w.attempt for w in launch] == [2, 2]
    for writer in launch:
        writer.close()
    frame = read_ledger(tmp_path)
    assert sorted(set(zip(frame.attempt, frame["rank"], frame.step))) == sorted(
        [(1, r, s) for r in (0, 1) for s in (1, 2, 3)] + [(2, r, s) for r in (0, 1) for s in (3, 4)])


def test_the_interrupted_run_is_read_over_all_its_ranks(tmp_path: Path) -> None:
    """2 ranks trained steps 1-15 (2 samples each a step); the resume from step 10 runs on 1 process. What the killed
    run trained at step 11 is both ranks' 4 samples, not rank 0's 2."""
    for writer in _ranks_attempt(tmp_path, range(2), 0, range(1, 16)):
        writer.close()
    (resumed,) = _ranks_attempt(tmp_path, range(1), 10, range(0), resume_step=10)
    found = continuation(tmp_path, 10)
    assert (found.attempt, found.world_size) == (1, 2)
    steps = found.steps()
    assert sorted(steps) == list(range(11, 16))
    assert steps[11] == ["h11.0.0", "h11.0.1", "h11.1.0", "h11.1.1"]
    resumed.write_step([_rank_record(11, 0, rows=4)])  # the running attempt's own steps are never the interrupted run's
    assert continuation(tmp_path, 10).steps()[11] == steps[11]
    assert continuation(tmp_path, 10, ranks={1}).steps()[11] == ["h11.1.0", "h11.1.1"]
    resumed.close()
    # rank 1's steps past the checkpoint were lost with the killed run: superseded, though rank 1 never started again
    frame = read_ledger(tmp_path)
    lost = frame[frame.superseded]
    assert sorted(set(zip(lost.attempt, lost["rank"], lost.step))) == [(1, r, s) for r in (0, 1) for s in range(11, 16)]


def test_the_interrupted_run_is_the_attempt_that_saved_the_checkpoint_over_all_ranks(tmp_path: Path) -> None:
    """Attempt 1 (2 ranks) trained 1-15; attempt 2 (1 process) resumed from 10 wrongly and was stopped at step 11;
    attempt 3 resumes from 10 again: what came next is attempt 1's (it trained step 10 and saved its checkpoint)."""
    for writer in _ranks_attempt(tmp_path, range(2), 0, range(1, 16)):
        writer.close()
    for writer in _ranks_attempt(tmp_path, range(1), 10, range(11, 12), resume_step=10):
        writer.close()
    (running,) = _ranks_attempt(tmp_path, range(1), 10, range(0), resume_step=10)
    assert running.attempt == 3
    found = continuation(tmp_path, 10)
    assert found.attempt == 1 and len(found.steps()[11]) == 4
    running.close()
    assert continuation(tmp_path / "nothing", 10) == Continuation()


def test_the_newest_attempt_of_another_rank_is_read_behind_its_open_writers_window(tmp_path: Path) -> None:
    """Another rank's file ends in up to a window of NUL bytes while its writer is open (or after a kill): the attempt
    number is read from the last line before them, a start line of the running launch left out."""
    from harness.lib.ledger import _newest_trained

    path = ledger_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    lines = [{"event": "start", "attempt": 4, "step": 0}, {"attempt": 4, **_rank_record(1, 1)},
             {"event": "start", "attempt": 5, "step": 1}]
    import json

    path.write_bytes("".join(json.dumps(r) + "\n" for r in lines).encode() + b"\0" * (3 << 16))
    assert _newest_trained(path) == 4
    path.write_bytes(b'{"event": "start", "attempt": 1, "step": 0}\n' + b"\0" * 100)
    assert _newest_trained(path) == 0


# -- the interrupted run's continuation is read from the files' ends, not whole (review of issue 43, item 4) ----------


def _line(attempt: int, step: int, rank: int) -> str:
    """A record line as the writer formats it (``write_hashes``): four samples per step and rank."""
    samples = '","'.join(f"{step:08x}{rank:04x}{i:04x}" for i in range(4))
    return (f'{{"attempt":{attempt},"step":{step},"micro_batch":0,"epoch":0,"batch_hash":"{step:012x}{rank:04x}",'
            f'"sample_hashes":["{samples}"],"sample_ids":null}}\n')


def _start(attempt: int, step: int, world_size: int) -> str:
    return f'{{"event":"start","attempt":{attempt},"step":{step},"world_size":{world_size},"resumed_from":null}}\n'


def _write_ledgers(run_dir: Path, attempts: list[tuple[int, int, range, range]], tail: bytes = b"") -> None:
    """``attempts``: (attempt, start step, its ranks, the steps it trained), oldest first, written rank by rank; ``tail``
    ends every file (a torn line, a writer's NUL window)."""
    folder = run_dir / "ledger"
    folder.mkdir(parents=True, exist_ok=True)
    for rank in sorted({r for _, _, ranks, _ in attempts for r in ranks}):
        text = "".join(_start(a, s, len(ranks)) + "".join(_line(a, step, rank) for step in steps)
                       for a, s, ranks, steps in attempts if rank in ranks)
        (folder / f"rank-{rank}.jsonl").write_bytes(text.encode() + tail)


def _continuation_read_whole(run_dir: Path, resume_step: int) -> Continuation:
    """The reference: every line of every file read, the rules of ``continuation`` applied to them."""
    writers, after, worlds = set(), {}, {}
    for rank, path in sorted((int(p.stem.split("-")[1]), p) for p in (run_dir / "ledger").glob("rank-*.jsonl")):
        for record in iter_records(path):
            if record.get("event") == "start":
                worlds.setdefault(record["attempt"], record["world_size"])
            elif record["step"] == resume_step:
                writers.add(record["attempt"])
            elif record["step"] > resume_step:
                after.setdefault(record["attempt"], []).append({**record, "rank": rank})
    chosen = max(writers) if writers else max(after, default=None)
    records = sorted(after.get(chosen, []), key=lambda r: (r["step"], r["rank"], r["micro_batch"]))
    return Continuation(chosen, worlds.get(chosen), records)


def _counting_reads(monkeypatch: Any) -> list[int]:
    """Every byte the ledger module reads from a file, counted (its ``open`` replaced by one over a counting FileIO)."""
    import builtins
    import io

    import harness.lib.ledger as ledger

    read = [0]

    class Counting(io.FileIO):
        def readinto(self, buffer: Any) -> int | None:
            n = super().readinto(buffer)
            read[0] += n or 0
            return n

        def readall(self) -> bytes:
            data = super().readall()
            read[0] += len(data)
            return data

    def counting_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "rb":
            return io.BufferedReader(Counting(path, "r"))
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(ledger, "open", counting_open, raising=False)
    return read


def test_a_resume_late_in_a_long_run_reads_the_ledgers_back_to_the_checkpoint_only(tmp_path: Path, monkeypatch: Any) -> None:
    """2 ranks trained 12,000 steps (2 MB of ledger each); the resume is from step 11,994. Every rank read every rank's
    whole file on the training thread before the first step (world size x run length per rank: gigabytes at 64 ranks and
    100k steps); now each file is read from its end to the checkpoint's step, past a torn line and a writer's NUL window."""
    from harness.lib.ledger import BACK_BLOCK

    steps, resume = 12_000, 11_994
    _write_ledgers(tmp_path, [(1, 0, range(2), range(1, steps + 1))], tail=b'{"attempt":1,"step":12001,"mic' + b"\0" * (3 << 16))
    size = sum(p.stat().st_size for p in (tmp_path / "ledger").glob("*.jsonl"))
    assert size > 4_000_000
    read = _counting_reads(monkeypatch)
    found = continuation(tmp_path, resume, running_here=False)
    spent = read[0]
    assert found == _continuation_read_whole(tmp_path, resume)
    assert (found.attempt, found.world_size, sorted(found.steps())) == (1, 2, list(range(resume + 1, steps + 1)))
    assert len(found.steps()[steps]) == 8  # both ranks' samples, one set
    nul_window, tail = 3 << 16, (steps - resume + 1) * 2 * len(_line(1, steps, 0))
    assert spent <= 2 * (nul_window + tail + 2 * BACK_BLOCK) < size / 5, spent


def test_the_backward_read_finds_what_a_whole_read_finds(tmp_path: Path, monkeypatch: Any) -> None:
    """The runs where the attempt that saved the checkpoint lies behind later ones: a wrong resume stopped at its first
    step, a rollback to an older checkpoint that trained on, a world that shrank and grew, no attempt that trained the
    checkpoint's step. Each read backwards gives what reading every line gives."""
    from harness.lib.ledger import BACK_BLOCK

    cases = {
        "wrong resume": [(1, 0, range(2), range(1, 16)), (2, 10, range(1), range(11, 12))],
        "rollback in between": [(1, 0, range(2), range(1, 16)), (2, 5, range(2), range(6, 9))],
        "world shrank then grew": [(1, 0, range(2), range(1, 16)), (2, 10, range(1), range(11, 21)), (3, 15, range(2), range(16, 18))],
        "no saver in the ledger": [(1, 10, range(2), range(11, 16))],
        "saver on one rank only": [(1, 0, range(1), range(1, 16)), (2, 12, range(2), range(13, 16))],
    }
    for name, attempts in cases.items():
        run_dir = tmp_path / name.replace(" ", "-")
        _write_ledgers(run_dir, attempts, tail=b"\0" * 100)
        for resume in (5, 10, 12, 15):
            want = _continuation_read_whole(run_dir, resume)
            got = continuation(run_dir, resume, running_here=False)
            assert (got.attempt, got.records) == (want.attempt, want.records), (name, resume)
            assert got.world_size == (want.world_size if want.attempt is not None else None), (name, resume)
    read = _counting_reads(monkeypatch)
    _write_ledgers(tmp_path / "long", [(1, 0, range(2), range(1, 3001)), (2, 2990, range(2), range(2991, 2993))])
    assert continuation(tmp_path / "long", 2995, running_here=False).attempt == 1  # the wrong resume's lines, then attempt 1's
    assert read[0] <= 2 * BACK_BLOCK < (tmp_path / "long" / "ledger" / "rank-0.jsonl").stat().st_size, read[0]
