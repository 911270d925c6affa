"""Training and eval files record by record, with each record's original bytes, for writing a cleaned copy.

:mod:`harness.lib.documents` yields only (id, text) of the documents; a
cleaned copy must also write back what is not text: the other fields of a
JSON line (byte for byte when the text is unchanged), the other columns of a
Parquet row, the blank lines of a text file. The ids and the documents seen
here are those ``iter_documents`` yields, in the same order (the tests check
it), so a scan's verdict per document applies to the record read here.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from harness.lib.documents import ScanError, missing_field


@dataclass
class Record:
    """One line or row: ``text`` is None when it is no document (a blank line, a record without text)."""

    id: str
    text: str | None
    raw: Any  # bytes of the line (.txt, .jsonl) or the row as a dict (.parquet, datasets)


def output_suffix(file: Path) -> str:
    """The suffix a cleaned copy of ``file`` gets: its own, JSON lines for a `datasets` folder."""
    return ".jsonl" if file.is_dir() else file.suffix


def iter_records(file: Path, field: str, id_field: str) -> Iterator[Record]:
    """Every record of one file of ``document_files`` (a `datasets` folder: every row of every split)."""
    suffix = file.suffix.lower()
    if file.is_dir():
        yield from _datasets_records(file, field, id_field)
    elif suffix == ".txt":
        for line_number, raw, line in _raw_lines(file):
            yield Record(f"{file.name}:{line_number}", line if line.strip() else None, raw)
    elif suffix in (".jsonl", ".json"):
        for line_number, raw, line in _raw_lines(file):
            yield _jsonl_record(file, line_number, raw, line, field, id_field)
    elif suffix == ".parquet":
        yield from _parquet_records(file, field, id_field)
    else:
        raise ScanError(f"harness scan: {file} has unsupported extension '{file.suffix}'. Fix: use .txt, .jsonl, .json or .parquet files.")


def _raw_lines(file: Path) -> Iterator[tuple[int, bytes, str]]:
    with open(file, "rb") as handle:
        for line_number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ScanError(f"harness scan: {file} line {line_number} is not valid UTF-8. "
                                "Fix: convert the file to UTF-8 or remove that line.") from None
            yield line_number, raw, line.rstrip("\r\n")


def _jsonl_record(file: Path, line_number: int, raw: bytes, line: str, field: str, id_field: str) -> Record:
    if not line.strip():
        return Record(f"{file.name}:{line_number}", None, raw)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ScanError(f"harness scan: {file} line {line_number} is not JSON ({exc.msg}). Fix: one JSON object per line.") from exc
    if not isinstance(record, dict) or field not in record:
        raise missing_field(file, field, list(record) if isinstance(record, dict) else None, line_number)
    text = record[field]
    document = text if isinstance(text, str) and text.strip() else None
    return Record(str(record.get(id_field, f"{file.name}:{line_number}")), document, raw)


def _parquet_records(file: Path, field: str, id_field: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    reader = pq.ParquetFile(file)
    row = 0
    for batch in reader.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            row += 1
            text = record.get(field)
            document = text if isinstance(text, str) and text.strip() else None
            yield Record(str(record[id_field]) if id_field in record else f"{file.name}:{row}", document, record)


def _datasets_records(folder: Path, field: str, id_field: str) -> Iterator[Record]:
    for split, dataset in dataset_splits(folder):
        for start in range(0, len(dataset), 4096):
            chunk = dataset[start : start + 4096]
            names = list(chunk)
            for i in range(len(chunk[names[0]]) if names else 0):
                record = {name: chunk[name][i] for name in names}
                text = record.get(field)
                document = text if isinstance(text, str) and text.strip() else None
                default = f"{folder.name}{'/' + split if split else ''}:{start + i + 1}"
                yield Record(str(record[id_field]) if id_field in record else default, document, record)


def dataset_splits(folder: Path) -> list[tuple[str, Any]]:
    """(split name, dataset) of a `datasets` folder; one unnamed split for a plain Dataset."""
    from datasets import load_from_disk

    data = load_from_disk(str(folder))
    if hasattr(data, "keys") and not hasattr(data, "column_names"):
        return [(name, data[name]) for name in data.keys()]
    return [("", data)]


# -- writing -------------------------------------------------------------------------------------------


def replace_text(raw: bytes, field: str, text: str) -> bytes:
    """A JSON line with only ``field``'s string value replaced, every other byte kept; re-encoded when that fails."""
    line = raw.decode("utf-8")
    ending = line[len(line.rstrip("\r\n")) :]
    body = line[: len(line) - len(ending)]
    record = json.loads(body)
    wanted = dict(record, **{field: text})
    ascii_only = body.isascii()
    encoded = json.dumps(text, ensure_ascii=ascii_only)
    for match in re.finditer(r'"' + re.escape(field) + r'"\s*:\s*(?=")', body):
        start = match.end()
        try:
            _, end = json.decoder.scanstring(body, start + 1)
        except ValueError:
            continue
        candidate = body[:start] + encoded + body[end:]
        try:
            if json.loads(candidate) == wanted:  # the top-level key, not one nested or inside a string
                return (candidate + ending).encode("utf-8")
        except json.JSONDecodeError:
            continue
    return (json.dumps(wanted, ensure_ascii=ascii_only) + ending).encode("utf-8")


class RecordWriter:
    """Writes kept records in the format of the file they came from, to an open binary handle."""

    def __init__(self, handle: BinaryIO, source: Path, field: str) -> None:
        self.handle, self.source, self.field = handle, source, field
        self.kind = "datasets" if source.is_dir() else source.suffix.lower()
        self._parquet: Any = None
        self._rows: list[dict[str, Any]] = []
        if self.kind == ".parquet":
            import pyarrow.parquet as pq

            self._schema = pq.ParquetFile(source).schema_arrow
            self._parquet = pq.ParquetWriter(handle, self._schema)

    def write(self, record: Record, text: str | None = None) -> None:
        """``record`` as read, or with its text replaced by ``text``."""
        if self.kind == ".txt":
            if text is None:
                self.handle.write(record.raw)
            else:
                ending = record.raw[len(record.raw.rstrip(b"\r\n")) :]
                self.handle.write(text.encode("utf-8") + ending)
        elif self.kind in (".jsonl", ".json"):
            self.handle.write(record.raw if text is None else replace_text(record.raw, self.field, text))
        else:
            row = record.raw if text is None else dict(record.raw, **{self.field: text})
            if self._parquet is not None:
                self._rows.append(row)
                if len(self._rows) >= 4096:
                    self._flush()
            else:
                self.handle.write((json.dumps(row, ensure_ascii=False, default=str) + "\n").encode("utf-8"))

    def _flush(self) -> None:
        import pyarrow as pa

        if self._rows:
            self._parquet.write_table(pa.Table.from_pylist(self._rows, schema=self._schema))
            self._rows = []

    def close(self) -> None:
        if self._parquet is not None:
            self._flush()
            self._parquet.close()  # an empty file still gets the schema
