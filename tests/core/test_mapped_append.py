"""The mapped appender (harness.core.mapped_append): records survive a kill -9, the next writer cuts the NUL tail."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from harness.core import mapped_append
from harness.core.mapped_append import MappedAppender
from harness.lib.ledger import LedgerWriter, iter_records, ledger_path

KILLED_WRITER = """
import os, signal, sys
from harness.core import mapped_append
mapped_append.WINDOW = 4096
from harness.core.mapped_append import MappedAppender
out = MappedAppender(sys.argv[1])
for n in range(int(sys.argv[2])):
    out.write(b'{"n": %d}\\n' % n)
out.write(b'{"n": "torn')  # a record cut off by the kill
os.kill(os.getpid(), signal.SIGKILL)
"""


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")


def test_records_cross_windows_and_close_cuts_the_file_to_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped_append, "WINDOW", 4096)
    path = tmp_path / "a.jsonl"
    out = MappedAppender(path)
    records = [b'{"n": %d, "pad": "%s"}\n' % (n, b"x" * (n % 97)) for n in range(400)] + [b"y" * 10_000 + b"\n"]
    for record in records:
        out.write(record)
    assert path.stat().st_size > out.end  # mapped ahead: the file holds a window of zeros past the records
    out.close()
    assert path.read_bytes() == b"".join(records)
    with pytest.raises(ValueError, match="after close"):
        out.write(b"late\n")


def test_a_killed_writer_loses_no_record_and_the_next_one_starts_on_a_fresh_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path), "300"], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -9
    raw = path.read_bytes()
    assert raw.endswith(b"\0")  # the window past the last record: zeros, no newline (readers skip that last line)
    intact = [line for line in raw.split(b"\n")[:-1]]
    assert intact == [b'{"n": %d}' % n for n in range(300)]
    again = MappedAppender(path)
    again.write(b'{"n": "after"}\n')
    again.close()
    lines = _lines(path)
    assert lines[:300] == intact and lines[300:] == [b'{"n": "torn', b'{"n": "after"}', b""]  # the NULs are gone


def test_a_full_disk_falls_back_to_plain_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window that cannot be reserved is never mapped (a copy into it would be a SIGBUS): writes go through pwrite."""
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"n": 0}\n')
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    out = MappedAppender(path)
    out.write(b'{"n": 1}\n')
    assert path.stat().st_size == out.end  # nothing reserved, no zeros
    out.write(b'{"n": 2}\n')
    out.close()
    assert path.read_bytes() == b'{"n": 0}\n{"n": 1}\n{"n": 2}\n'


def test_it_never_writes_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes(b"")
    link = tmp_path / "a.jsonl"
    link.symlink_to(target)
    with pytest.raises(OSError):
        MappedAppender(link)
    assert target.read_bytes() == b""


def test_the_ledger_of_a_killed_run_keeps_every_step_and_numbers_the_next_attempt(tmp_path: Path) -> None:
    script = f"""
import os, signal
from harness.lib.ledger import LedgerWriter
writer = LedgerWriter({str(tmp_path)!r}, 0)
writer.start(0, 1, None)
for step in range(1, 51):
    writer.write_hashes(step, 0, [(0, "%016x" % step, ["%016x" % (step * 7)], None)])
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -9
    path = ledger_path(tmp_path, 0)
    assert [r["step"] for r in iter_records(path) if "event" not in r] == list(range(1, 51))
    resumed = LedgerWriter(tmp_path, 0, resume_step=40)
    resumed.start(40, 1, "checkpoint-40")
    resumed.write_hashes(41, 0, [(0, "ab", ["cd"], None)])
    resumed.close()
    records = list(iter_records(path))
    assert [(r["attempt"], r.get("event"), r["step"]) for r in records[-2:]] == [(2, "start", 40), (2, None, 41)]
    assert b"\0" not in path.read_bytes()


def test_a_writer_left_open_is_closed_at_exit_and_a_forked_child_leaves_the_file_to_its_parent(tmp_path: Path) -> None:
    """A plugin switched off mid-run never closes its ledger: at exit the file is still cut to its records. A child
    forked while it was open (a data-loader worker) exits without cutting the file its parent goes on writing."""
    path = tmp_path / "a.jsonl"
    script = f"""
import os, sys
from harness.core.mapped_append import MappedAppender
out = MappedAppender({str(path)!r})
out.write(b'{{"n": 1}}\\n')
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit: atexit runs in the child too
os.waitpid(child, 0)
out.write(b'{{"n": 2}}\\n')  # a cut file would make this copy fault (SIGBUS)
"""
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0
    assert path.read_bytes() == b'{"n": 1}\n{"n": 2}\n'
