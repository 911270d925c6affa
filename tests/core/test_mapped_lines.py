"""Lines appended through a shared mapping (harness.core.mapped_lines): readable at once, kept through kill -9, trimmed after."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import harness.core.mapped_lines as mapped_lines
from harness.core.mapped_lines import MAPPABLE_FS, MappedLines, file_system, written_end

PAGE = 4096


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """The tests of the mapped path need a file system the writer maps (elsewhere it writes plainly, tested below)."""
    if file_system(tmp_path) not in MAPPABLE_FS or not hasattr(os, "posix_fallocate"):
        pytest.skip(f"{tmp_path} is on {file_system(tmp_path)}: not mapped")
    return tmp_path


def _line(i: int, width: int = 40) -> bytes:
    return (f'{{"i":{i},"pad":"' + "x" * width + '"}\n').encode()


def test_lines_are_in_the_file_before_close_and_the_window_is_cut_off_at_close(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    writer = MappedLines(path, window=PAGE)
    assert writer.owner and writer.mapped
    expected = b"".join(_line(i) for i in range(300))  # about 17 KB: four windows of one page
    for i in range(300):
        writer.write(_line(i))
        if i == 150:
            seen = path.read_bytes()  # another reader, while the writer is open: the lines so far, then unwritten NULs
            assert seen.startswith(b"".join(_line(k) for k in range(151)))
            assert not seen[len(b"".join(_line(k) for k in range(151))):].strip(b"\0")
    writer.close()
    assert path.read_bytes() == expected


def test_a_line_longer_than_the_window_and_lines_across_its_edge(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    writer = MappedLines(path, window=PAGE)
    parts = [_line(0, 4000), _line(1, 3 * PAGE), _line(2, 10), _line(3, 5000)]
    for part in parts:
        writer.write(part)
    writer.close(sync=True)
    assert path.read_bytes() == b"".join(parts)


def test_the_common_path_makes_no_system_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = MappedLines(tmp_path / "lines.jsonl", window=1 << 16)
    writer.write(_line(0))  # maps the window

    def refuse(*args: object) -> None:
        raise AssertionError("a system call on the per-line path")

    for name in ("write", "pwrite", "lseek", "fstat", "ftruncate", "posix_fallocate"):
        monkeypatch.setattr(mapped_lines.os, name, refuse)
    for i in range(1, 100):
        writer.write(_line(i))
    monkeypatch.undo()
    writer.close()
    assert (tmp_path / "lines.jsonl").read_bytes() == b"".join(_line(i) for i in range(100))


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from harness.core.mapped_lines import MappedLines
    writer = MappedLines(sys.argv[1], window=4096)
    for i in range(int(sys.argv[2])):
        writer.write(('{"i":%d,"pad":"' % i + "x" * 40 + '"}\\n').encode())
    if len(sys.argv) > 3:
        writer.write(sys.argv[3].encode())  # a line the kill cuts short
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _killed_writer(path: Path, lines: int, torn: str | None = None) -> None:
    args = [sys.executable, "-c", KILLED_WRITER, str(path), str(lines)] + ([torn] if torn else [])
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr


def test_kill_9_keeps_every_written_line_and_the_next_writer_trims_what_it_left(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    _killed_writer(path, 120)
    raw = path.read_bytes()
    written = b"".join(_line(i) for i in range(120))
    assert raw.startswith(written) and len(raw) > len(written) and not raw[len(written):].strip(b"\0")  # the unwritten rest
    with open(path, "rb") as handle:
        assert written_end(handle.fileno()) == len(written)
    writer = MappedLines(path, window=PAGE)  # a resumed run's writer
    assert writer.end == len(written)
    writer.write(_line(120))
    writer.close()
    assert path.read_bytes() == written + _line(120)


def test_a_line_cut_by_the_kill_is_closed_before_the_next_line(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    _killed_writer(path, 3, torn='{"i":3,"pad":"cut')  # no newline: a line the kill interrupted
    writer = MappedLines(path, window=PAGE)
    writer.write(_line(4))
    writer.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[:3] == [_line(i)[:-1] for i in range(3)]
    assert lines[3] == b'{"i":3,"pad":"cut' and lines[4] == _line(4)[:-1] and lines[5] == b""


SECOND_WRITER = textwrap.dedent("""
    import sys
    from harness.core.mapped_lines import MappedLines
    line = lambda i: ('{"i":%d}\\n' % i).encode()
    first = MappedLines(sys.argv[1], window=4096)
    first.write(line(0))
    second = MappedLines(sys.argv[1], window=4096)  # the same file, still open in the first: no lock, no mapping, no cut
    assert first.owner and not second.owner and not second.mapped
    second.write(line(1))
    first.write(line(2))  # inside its window: a SIGBUS here if the second writer had cut the file
    first.close()
    second.write(line(3))
    second.close()
""")


def _in_a_process(script: str, path: Path, *args: str) -> None:
    """Run ``script`` in its own interpreter: a mapping cut short is a SIGBUS, which must fail this test, not end the session."""
    result = subprocess.run([sys.executable, "-c", script, str(path), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"


def test_a_second_live_writer_appends_plainly_and_cuts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    _in_a_process(SECOND_WRITER, path)
    records = [line for line in path.read_bytes().split(b"\n") if line.strip(b"\0")]
    assert sorted(records) == sorted(f'{{"i":{i}}}'.encode() for i in range(4))


def _plain_lines(path: Path) -> None:
    writer = MappedLines(path, window=PAGE)
    for i in range(50):
        writer.write(_line(i))
        assert path.stat().st_size == writer.end  # no unwritten window at any moment
    assert not writer.mapped
    writer.close()
    assert path.read_bytes() == b"".join(_line(i) for i in range(50))


def test_where_no_window_can_be_allocated_every_line_is_written_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mapped_lines.os, "posix_fallocate", disk_full, raising=False)
    _plain_lines(tmp_path / "lines.jsonl")


def test_a_file_system_that_may_fault_on_a_mapped_write_is_written_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped_lines, "file_system", lambda path: "btrfs")  # space reserved at the fault: a SIGBUS when full
    _plain_lines(tmp_path / "lines.jsonl")


@pytest.mark.skipif(not os.path.exists("/proc/self/mountinfo"), reason="Linux's mount table")
def test_the_file_system_is_the_one_of_the_longest_mount_point_holding_the_path() -> None:
    assert file_system("/proc/self/status") == "proc"
    assert file_system("/") not in (None, "proc")


FORKED_CHILD = textwrap.dedent("""
    import ctypes, os, sys
    from harness.core.mapped_lines import MappedLines
    line = lambda i: ('{"i":%d}\\n' % i).encode()
    writer = MappedLines(sys.argv[1], window=4096)
    writer.write(line(0))
    fork = os.fork if sys.argv[2] == "os" else ctypes.CDLL(None).fork  # libc's own fork: Python's fork handlers do not run
    pid = fork()
    if pid == 0:  # a DataLoader worker, or a C library's child running Python: it drops its copy
        writer.close()
        os._exit(0)
    os.waitpid(pid, 0)
    for i in range(1, 200):  # the parent's mapping must still reach its file's end: a SIGBUS after a cut
        writer.write(line(i))
    writer.close()
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
@pytest.mark.parametrize("fork", ["os", "libc"])
def test_a_forked_child_never_cuts_its_parents_file(tmp_path: Path, fork: str) -> None:
    path = tmp_path / "lines.jsonl"
    _in_a_process(FORKED_CHILD, path, fork)
    assert path.read_bytes() == b"".join(f'{{"i":{i}}}\n'.encode() for i in range(200))


def test_the_page_the_file_already_had_is_written_not_mapped(tmp_path: Path) -> None:
    """A reflink copy may share the file's last block with another file: a mapped write there could need new space at the
    fault (SIGBUS when the disk is full). Only pages this writer allocated are mapped."""
    path = tmp_path / "lines.jsonl"
    path.write_bytes(_line(0))  # an earlier run's lines: a partly filled first page
    writer = MappedLines(path, window=PAGE)
    for i in range(1, 200):
        writer.write(_line(i))
        if writer._map is not None:
            assert writer._base >= PAGE  # the mapping starts past the page that held the earlier lines
    writer.close()
    assert path.read_bytes() == b"".join(_line(i) for i in range(200))


GROWN_BY_ANOTHER = textwrap.dedent("""
    import sys
    from harness.core.mapped_lines import MappedLines
    line = lambda i: ('{"i":%d,"pad":"%s"}\\n' % (i, "x" * 60)).encode()
    owner = MappedLines(sys.argv[1], window=4096)
    owner.write(line(0))
    other = MappedLines(sys.argv[1], window=4096)  # not the lock holder: appends at the file's end, after the owner's window
    other.write(line(1))
    for i in range(2, 200):  # past the owner's window: it must see the file grown and append after the other's line
        owner.write(line(i))
    assert not owner.mapped
    other.close()
    owner.close()
""")


def test_an_owner_whose_file_another_writer_grew_stops_mapping_and_overwrites_nothing(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    _in_a_process(GROWN_BY_ANOTHER, path)
    records = [line for line in path.read_bytes().split(b"\n") if line.strip(b"\0")]
    assert sorted(records) == sorted(('{"i":%d,"pad":"%s"}' % (i, "x" * 60)).encode() for i in range(200))


KILLED_WITH_A_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from harness.core.mapped_lines import MappedLines
    writer = MappedLines(sys.argv[1], window=4096)
    for i in range(10):
        writer.write(('{"i":%d}\\n' % i).encode())
    if os.fork() == 0:  # a DataLoader worker outliving its killed parent for a while
        quiet = os.open(os.devnull, os.O_RDWR)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)  # the test's pipes close with the parent: the test goes on while this process still lives
        time.sleep(10)
        os._exit(0)
    print("forked", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_forked_worker_that_outlives_its_killed_parent_does_not_keep_the_file_locked(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    result = subprocess.run([sys.executable, "-c", KILLED_WITH_A_WORKER, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL and "forked" in result.stdout, result.stderr
    writer = MappedLines(path, window=PAGE)  # the resumed run, while the old worker still sleeps
    assert writer.owner and writer.mapped
    writer.write(b'{"i":10}\n')
    writer.close()
    assert path.read_bytes() == b"".join(f'{{"i":{i}}}\n'.encode() for i in range(11))
