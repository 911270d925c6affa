"""Reading documents for the contamination check: text files, JSON lines, Parquet and ``datasets`` folders.

Shared by ``harness scan`` (:mod:`harness.tools.scan`) and the
``contamination`` plugin, which read eval sets and training data the same way.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from harness.core.errors import HarnessError

TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


class ScanError(HarnessError):
    """Bad scan input: names the file, the field and the fix."""


# -- reading documents -------------------------------------------------------------------------------


def document_files(path: Path) -> list[Path]:
    if not path.exists():
        raise ScanError(f"harness scan: {path} does not exist. Fix: pass an existing file or folder.")
    if path.is_file():
        if path.suffix.lower() == ".json" and _starts_with(path, b"["):
            raise ScanError(f"harness scan: {path} holds a JSON array; {JSON_LINES_FIX}.")
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise ScanError(f"harness scan: {path} has unsupported extension '{path.suffix or '(none)'}'; scan reads "
                            f"{', '.join(TEXT_SUFFIXES)} files (any case) and `datasets` folders. "
                            "Fix: convert the file to one of these (e.g. JSON lines with a text field).")
        return [path]
    if (path / "dataset_info.json").exists() or (path / "state.json").exists():
        return [path]  # a `datasets` folder saved with save_to_disk
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    for file in found:
        if file.suffix.lower() == ".json" and _starts_with(file, b"["):
            raise ScanError(f"harness scan: {file} holds a JSON array; {JSON_LINES_FIX}.")
    if not found:
        raise ScanError(f"harness scan: {path} holds no {', '.join(TEXT_SUFFIXES)} files and is no `datasets` folder. Fix: point at the data files.")
    return found


def _starts_with(path: Path, prefix: bytes) -> bool:
    """Whether the file's first non-blank bytes are ``prefix`` (a BOM skipped)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(prefix)


def iter_documents(path: Path | str, field: str = "text", id_field: str = "id") -> Iterator[tuple[str, str]]:
    """(id, text) of every document under ``path``: .txt (one per line), .jsonl/.json, .parquet, `datasets` folders.

    Streams: .txt and .jsonl line by line, .parquet by record batch, datasets
    memory-mapped. A file that lacks ``field`` is an error naming file and field.
    """
    for file in document_files(Path(path)):
        yield from _read(file, field, id_field)


def _read(file: Path, field: str, id_field: str) -> Iterator[tuple[str, str]]:
    suffix = file.suffix.lower()
    if file.is_dir():
        yield from _read_datasets(file, field, id_field)
    elif suffix == ".txt":
        for line_number, line in _text_lines(file):
            if line.strip():
                yield f"{file.name}:{line_number}", line
    elif suffix in (".jsonl", ".json"):
        yield from _read_jsonl(file, field, id_field)
    elif suffix == ".parquet":
        yield from _read_parquet(file, field, id_field)
    else:  # _files lets only TEXT_SUFFIXES through; never read nothing in silence
        raise ScanError(f"harness scan: {file} has unsupported extension '{file.suffix}'. Fix: use {', '.join(TEXT_SUFFIXES)} files.")


def _text_lines(file: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its line break) of a UTF-8 file; a line that is not UTF-8 is an error naming it."""
    with open(file, "rb") as handle:
        for line_number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8(file, line_number, raw[exc.start], exc.start + 1) from None
            yield line_number, line.rstrip("\r\n")


def not_utf8(file: Path | str, line: int, byte: int, column: int) -> ScanError:
    return ScanError(f"harness scan: {file} line {line} is not valid UTF-8 (byte {byte:#04x} at column {column}). "
                     "Fix: convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove that line.")


JSON_LINES_FIX = ("a .json file is read as JSON lines; convert a JSON array or a pretty-printed file first, e.g. "
                  "`jq -c '.[]' data.json > data.jsonl`")


def not_json(file: Path | str, line: int, message: str) -> ScanError:
    if "BOM" in message:
        return ScanError(f"harness scan: {file} starts with a UTF-8 byte-order mark. Fix: save it without one "
                         "(e.g. `sed -i '1s/^\xEF\xBB\xBF//' FILE`).")
    fix = JSON_LINES_FIX if str(file).lower().endswith(".json") else "one JSON object per line"
    return ScanError(f"harness scan: {file} line {line} is not JSON ({message}). Fix: {fix}.")


class MissingFieldError(ScanError):
    """A record without the text field. The fix depends on who asked (``--field``, ``--eval-field``, a config key):
    the caller that knows it re-raises :meth:`with_fix`."""

    def __init__(self, file: Path | str, field: str, keys: list[str] | None, line: int | None = None,
                 fix: str = "pass --field with the name of the text field") -> None:
        self.file, self.field, self.keys, self.line = file, field, keys, line
        where = f"{file} line {line}" if line else str(file)
        has = "it is not a JSON object" if keys is None else f"it has: {', '.join(map(str, keys)) or 'nothing'}"
        super().__init__(f"harness scan: {where} has no field '{field}' ({has}). Fix: {fix}.")

    def with_fix(self, fix: str) -> "MissingFieldError":
        return MissingFieldError(self.file, self.field, self.keys, self.line, fix)


def missing_field(file: Path | str, field: str, keys: list[str] | None, line: int | None = None) -> MissingFieldError:
    """``keys``: the record's keys (None: the record is not an object); ``line``: where, in a JSON-lines file."""
    return MissingFieldError(file, field, keys, line)


def not_text(file: Path | str, line: int, field: str, kind: str, shown: str) -> ScanError:
    """A record whose text field holds a ``kind`` (a number, a list, an object): never skipped in silence (null is no
    text); ``shown``: the value's start."""
    return ScanError(f"harness scan: {file} line {line}: field '{field}' holds a {kind} ({shown!r}), not text. "
                     "Fix: make it a string (or null for a record without text).")


def unique_names(stems: list[str]) -> list[str]:
    """``stems`` made distinct in order: a repeated one gets -2, -3 ... (two eval sets both named eval.jsonl)."""
    used: dict[str, int] = {}
    names = []
    for stem in stems:
        used[stem] = used.get(stem, 0) + 1
        names.append(stem if used[stem] == 1 else f"{stem}-{used[stem]}")
    return names


def _read_jsonl(file: Path, field: str, id_field: str) -> Iterator[tuple[str, str]]:
    for line_number, line in _text_lines(file):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise not_json(file, line_number, exc.msg) from exc
        if not isinstance(record, dict) or field not in record:
            raise missing_field(file, field, list(record) if isinstance(record, dict) else None, line_number)
        text = record[field]
        if text is not None and not isinstance(text, str):
            raise not_text(file, line_number, field, type(text).__name__, str(text)[:40])
        if isinstance(text, str) and text.strip():
            yield str(record.get(id_field, f"{file.name}:{line_number}")), text


def _read_parquet(file: Path, field: str, id_field: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(file)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors carry the detail
        raise ScanError(f"harness scan: {file} cannot be read as parquet ({exc}). Fix: check the file is a valid parquet table.") from None
    names = reader.schema_arrow.names
    if field not in names:
        raise missing_field(file, field, names)
    row = 0
    columns = [field] + ([id_field] if id_field in names else [])
    for batch in reader.iter_batches(columns=columns, batch_size=4096):
        data = batch.to_pydict()
        for i, text in enumerate(data[field]):
            row += 1
            if isinstance(text, str) and text.strip():
                yield (str(data[id_field][i]) if id_field in data else f"{file.name}:{row}"), text


def _read_datasets(folder: Path, field: str, id_field: str) -> Iterator[tuple[str, str]]:
    from datasets import load_from_disk

    try:
        data = load_from_disk(str(folder))
    except Exception as exc:  # noqa: BLE001 - datasets' errors carry the detail
        raise ScanError(f"harness scan: {folder} cannot be read as a `datasets` folder ({exc}). "
                        "Fix: point at a folder written by save_to_disk, or at the data files.") from None
    if hasattr(data, "keys") and not hasattr(data, "column_names"):  # a DatasetDict: every split
        splits = [(name, data[name]) for name in data.keys()]
    else:
        splits = [("", data)]
    for name, split in splits:
        if field not in split.column_names:
            raise missing_field(folder, field, split.column_names)
        for start in range(0, len(split), 4096):
            chunk = split[start : start + 4096]
            for i, text in enumerate(chunk[field]):
                if isinstance(text, str) and text.strip():
                    default = f"{folder.name}{'/' + name if name else ''}:{start + i + 1}"
                    yield (str(chunk[id_field][i]) if id_field in chunk else default), text
