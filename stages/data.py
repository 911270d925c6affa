"""Training data for the stage runners: load files, check fields, mix sources.

Every failure a user can cause (wrong path, wrong field name, empty file,
impossible mixture) raises :class:`DataError` with one paragraph that names the
file, the config key and the fix, so the CLI can print it without a traceback.

Loaded datasets are kept in memory (``keep_in_memory=True``) and any builder
cache lives in a throwaway temp dir: nothing is ever written next to user data,
and later ``map``/``select`` calls never create cache files beside it. This
suits the data sizes the harness targets (up to a few GB).
"""

from __future__ import annotations

import contextlib
import math
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets as hfds
import numpy as np
from datasets import Dataset, DatasetDict, Features, Value
from pydantic import BaseModel, Field

from harness.core.errors import HarnessError, did_you_mean

__all__ = [
    "DataError",
    "DataSource",
    "SUPPORTED_KINDS",
    "describe_mixture",
    "load_source",
    "load_sources",
    "mix_sources",
    "mixture_counts",
    "resolve_path",
    "split_documents",
]

SUPPORTED_KINDS = (
    ".txt (documents separated by blank lines, or one per line)",
    ".jsonl / .json (JSON lines or a JSON array of objects)",
    ".parquet",
    "a folder written by Dataset.save_to_disk / DatasetDict.save_to_disk",
)
_JSON_SUFFIXES = (".jsonl", ".json")
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


class DataError(HarnessError):
    """Training data cannot be loaded or mixed; the message names the file, the field and the fix."""


class DataSource(BaseModel, extra="forbid"):
    """One entry of the ``data:`` list of a stage config."""

    path: str = Field(
        description="Data file or save_to_disk folder; a relative path resolves against the config file's folder."
    )
    weight: float = Field(
        default=1.0, gt=0, description="Mixture weight: this source's share of samples is weight / sum of weights."
    )
    max_repeats: int = Field(
        default=1,
        ge=1,
        description="How many times one sample of this source may appear in the mixture at most (1 = never repeated).",
    )
    text_field: str = Field(default="text", description="Field (column) holding the text; .txt files get this column.")
    name: str | None = Field(
        default=None, description="Name used in the 'source' column and in sample ids; defaults to the file stem."
    )

    @property
    def display_name(self) -> str:
        """The explicit name, else the file (or folder) stem."""
        return self.name or Path(self.path).stem


# --------------------------------------------------------------------------- loading


def _where(index: int | str | None) -> str:
    """The config key of a source: ``data[i]``, or the full key when the caller names it (``data.sources[0]``)."""
    if isinstance(index, str):
        return index
    return f"data[{index}]" if index is not None else "data[?]"


def resolve_path(source: DataSource, base_dir: Path | str) -> Path:
    """Absolute path of ``source.path``; relative paths are relative to ``base_dir`` (the config's folder)."""
    path = Path(source.path).expanduser()
    return (path if path.is_absolute() else Path(base_dir) / path).resolve()


def load_source(
    source: DataSource,
    base_dir: Path | str,
    required_fields: Sequence[str],
    index: int | str | None = None,
) -> Dataset:
    """Load one source as an in-memory Dataset and check it has ``required_fields``.

    ``index`` is the source's position in the config's ``data:`` list, used only
    to name the config key in error messages.
    """
    where = _where(index)
    path = resolve_path(source, base_dir)
    if not path.exists():
        raise DataError(_missing_path_message(path, where, Path(base_dir)))
    dataset = _read(path, source, where)
    if len(dataset) == 0:
        raise DataError(
            f"data file '{path}' ({where}.path) contains no records. "
            "Fix: point the path at a file with data, or remove this entry from data."
        )
    check_fields(dataset, path, source, where, required_fields)
    return dataset


def load_sources(
    sources: Sequence[DataSource], base_dir: Path | str, required_fields: Sequence[str]
) -> list[Dataset]:
    """``load_source`` for every entry, with the entry's index in error messages."""
    return [load_source(s, base_dir, required_fields, index=i) for i, s in enumerate(sources)]


def _missing_path_message(path: Path, where: str, base_dir: Path) -> str:
    hint = ""
    if path.parent.is_dir():
        hint = did_you_mean(path.name, [p.name for p in path.parent.iterdir()])
    return (
        f"data file '{path}' ({where}.path) does not exist.{hint} "
        f"Fix: correct {where}.path; relative paths resolve against '{base_dir.resolve()}' (the config's folder)."
    )


def _read(path: Path, source: DataSource, where: str) -> Dataset:
    """Dispatch on the kind of file; wrap parser failures in a DataError naming the file."""
    if path.is_dir():
        return _read_saved_folder(path, where)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _read_txt(path, source.text_field)
    if suffix in _JSON_SUFFIXES or suffix == ".parquet":
        builder = "parquet" if suffix == ".parquet" else "json"
        try:
            return _load_packaged(builder, path)
        except Exception as exc:  # pyarrow / json errors carry the detail
            raise DataError(
                f"data file '{path}' ({where}.path) could not be read as {builder}: {exc}. "
                f"Fix: check the file is valid {builder} ({'one JSON object per line' if builder == 'json' else 'a parquet table'})."
            ) from exc
    raise DataError(
        f"data file '{path}' ({where}.path) has unsupported extension '{path.suffix or '(none)'}'. "
        f"Supported kinds: {'; '.join(SUPPORTED_KINDS)}. Fix: convert the file to one of these."
    )


def split_documents(text: str) -> list[str]:
    """Documents of a .txt file: blank-line separated blocks, or one per non-empty line if there are no blank lines.

    Why two conventions: prose corpora separate multi-line documents by blank
    lines; line-per-document corpora have none, and treating them as one huge
    document would merge everything.
    """
    lines = text.splitlines()
    if not _BLANK_LINE.search(text.strip()):
        return [line.strip() for line in lines if line.strip()]
    docs: list[str] = []
    block: list[str] = []
    for line in [*lines, ""]:
        if line.strip():
            block.append(line.rstrip())
        elif block:
            docs.append("\n".join(block).strip())
            block = []
    return docs


def _read_txt(path: Path, text_field: str) -> Dataset:
    docs = split_documents(path.read_text(encoding="utf-8"))
    return Dataset.from_dict({text_field: docs})


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Silence datasets' progress bars for small local loads, restoring the previous setting."""
    was_disabled = hfds.are_progress_bars_disabled()
    hfds.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            hfds.enable_progress_bars()


def _load_packaged(builder: str, path: Path) -> Dataset:
    """``load_dataset(builder)`` fully in memory, its arrow cache in a temp dir deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="harness-data-") as cache_dir, _quiet_progress():
        return hfds.load_dataset(
            builder, data_files=str(path), split="train", cache_dir=cache_dir, keep_in_memory=True
        )


def _read_saved_folder(path: Path, where: str) -> Dataset:
    """A ``save_to_disk`` folder: a Dataset, or a DatasetDict from which split 'train' is taken."""
    is_dict = (path / "dataset_dict.json").is_file()
    is_dataset = (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    if not (is_dict or is_dataset):
        raise DataError(
            f"data folder '{path}' ({where}.path) is not a dataset saved with save_to_disk "
            "(no dataset_dict.json, or state.json + dataset_info.json, inside). "
            f"Fix: point {where}.path at a data file ({'; '.join(SUPPORTED_KINDS[:3])}) "
            "or at a folder written by Dataset.save_to_disk."
        )
    loaded = hfds.load_from_disk(str(path), keep_in_memory=True)
    if isinstance(loaded, DatasetDict):
        if "train" not in loaded:
            splits = ", ".join(f"'{s}'" for s in loaded) or "none"
            raise DataError(
                f"data folder '{path}' ({where}.path) is a DatasetDict without a 'train' split (splits: {splits}). "
                f"Fix: save the training split as 'train', or point {where}.path at the split's own folder "
                f"(e.g. '{path / next(iter(loaded), 'train')}')."
            )
        loaded = loaded["train"]
    return loaded


def check_fields(
    dataset: Dataset, path: Path, source: DataSource, where: str, required_fields: Sequence[str]
) -> None:
    """Every required field must exist; the message lists what does exist and the closest name."""
    present = list(dataset.column_names)
    for field in required_fields:
        if field in present:
            continue
        if field == source.text_field:
            fix = f"set {where}.text_field to the field that holds the text, or rename the field in the file"
        else:
            fix = f"add field '{field}' to every record, or rename the field in the file"
        raise DataError(
            f"data file '{path}' ({where}) has no field '{field}'; its fields are: "
            f"{', '.join(repr(p) for p in present) or 'none'}.{did_you_mean(field, present)} Fix: {fix}."
        )
    for field in required_fields:
        check_records(dataset, path, source, where, field)


def check_records(dataset: Dataset, path: Path, source: DataSource, where: str, field: str) -> None:
    """Every record must hold a value in ``field`` (a JSON-lines file with mixed records has the column, with nulls).

    A record without it would be dropped, or trained on as the string 'None'; the message names the records
    (line numbers of JSON-lines files, else row indices), how many there are and what those records hold instead.
    """
    column = dataset.with_format("arrow")[field]
    feature = dataset.features.get(field)
    if field == source.text_field and isinstance(feature, Value) and feature.dtype not in ("string", "large_string"):
        raise DataError(
            f"data file '{path}' ({where}) field '{field}' holds {feature.dtype} values, not text. "
            f"Fix: set {where}.text_field to the field that holds the text, or store the text as strings."
        )
    missing = column.null_count
    if not missing:
        return
    rows = [int(i) for i in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))]
    named = ", ".join(_record_names(path, rows[:5]))
    others = [k for k, v in dataset[rows[0]].items() if v is not None and k != field]
    hint = did_you_mean(field, others)
    if field == source.text_field:
        fix = f"give every record a '{field}' value or remove those records; if the text is under another name, set {where}.text_field"
    else:
        fix = f"give every record a '{field}' value or remove those records"
    raise DataError(
        f"data file '{path}' ({where}): {missing} of {len(dataset)} records have no value for field '{field}' "
        f"(missing or null), first: {named}{', ...' if missing > 5 else ''}. "
        f"The first of them has the fields: {', '.join(repr(k) for k in others) or 'none'}.{hint} Fix: {fix}."
    )


def _record_names(path: Path, rows: Sequence[int]) -> list[str]:
    """'line N' of each row of a JSON-lines file (blank lines hold no record), else 'record i' (0-based row index)."""
    if path.is_file() and path.suffix.lower() in _JSON_SUFFIXES:
        with open(path, "rb") as handle:
            head = handle.read(4096).lstrip()
        if not head.startswith(b"["):  # JSON lines, not a JSON array
            wanted, found = set(rows), {}
            with open(path, "rb") as handle:
                record = -1
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        record += 1
                        if record in wanted:
                            found[record] = number
                            if len(found) == len(wanted):
                                break
            return [f"line {found[r]}" if r in found else f"record {r}" for r in rows]
    return [f"record {r}" for r in rows]


# --------------------------------------------------------------------------- mixing


def _largest_remainder(total: int, shares: Sequence[float]) -> list[int]:
    """Integer counts summing to ``total``, each within 1 of ``total * share`` (Hamilton apportionment)."""
    exact = [total * s for s in shares]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_counts(sizes: Sequence[int], sources: Sequence[DataSource], total: int | None = None) -> list[int]:
    """How many samples each source contributes; ``total=None`` takes the largest total the caps allow.

    The weight ratio is always kept (to within one sample); only ``total`` moves.
    """
    weights = [s.weight for s in sources]
    shares = [w / sum(weights) for w in weights]
    caps = [n * s.max_repeats for n, s in zip(sizes, sources)]
    if total is None:
        total = min(math.floor(cap / share) for cap, share in zip(caps, shares))
        counts = _largest_remainder(total, shares)
        while any(c > cap for c, cap in zip(counts, caps)):  # float rounding at the boundary
            total -= 1
            counts = _largest_remainder(total, shares)
        return counts
    if total < 1:
        raise DataError(f"mixture total must be at least 1, got {total}. Fix: set a positive total or leave it unset.")
    counts = _largest_remainder(total, shares)
    for i, (count, cap, size, source) in enumerate(zip(counts, caps, sizes, sources)):
        if count > cap:
            largest = mixture_counts(sizes, sources, None)
            raise DataError(
                f"data source '{source.display_name}' (data[{i}]) would need {count} samples for a mixture of "
                f"{total} (weight {source.weight:g}, share {shares[i]:.1%}), but it has {size} samples and "
                f"max_repeats={source.max_repeats}, so it can give at most {cap}. Fix: raise data[{i}].max_repeats "
                f"to {math.ceil(count / size)}, lower its weight, or ask for at most {sum(largest)} samples."
            )
    return counts


def _sample_indices(size: int, count: int, rng: np.random.Generator) -> list[int]:
    """``count`` row indices: whole shuffled passes over the source, then part of one more.

    No index repeats within a pass, so an index appears at most ``ceil(count / size)`` times.
    """
    full, rest = divmod(count, size)
    picks = [rng.permutation(size) for _ in range(full)]
    if rest:
        picks.append(rng.permutation(size)[:rest])
    return [int(i) for part in picks for i in part]


def _unique_names(sources: Sequence[DataSource]) -> list[str]:
    names = [s.display_name for s in sources]
    for i, name in enumerate(names):
        if name in names[:i]:
            first = names.index(name)
            raise DataError(
                f"data[{first}] and data[{i}] are both named '{name}', so their sample ids would collide. "
                f"Fix: set a distinct data[{i}].name."
            )
    return names


def _common_columns(parts: Sequence[Dataset]) -> list[str]:
    reserved = {"source", "sample_id"}
    shared = set.intersection(*(set(p.column_names) for p in parts))
    return [c for c in parts[0].column_names if c in shared and c not in reserved]


def _align_features(part: Dataset, reference: Features, name: str) -> Dataset:
    """Cast a source's columns to the first source's types so they concatenate (e.g. int32 vs int64)."""
    if part.features == reference:
        return part
    try:
        return part.cast(reference)
    except Exception as exc:
        raise DataError(
            f"data source '{name}' has columns whose types differ from the first source's and cannot be cast "
            f"({exc}). Fix: make the shared fields hold the same kind of value in every source."
        ) from exc


def mix_sources(
    datasets: Sequence[Dataset],
    sources: Sequence[DataSource],
    total: int | None = None,
    seed: int = 0,
) -> Dataset:
    """A weighted mixture of the sources, shuffled deterministically by ``seed``.

    Source i contributes about ``total * w_i / sum(w)`` samples (see
    :func:`mixture_counts`), drawn without replacement within each pass and
    repeated at most ``max_repeats`` times. The result holds the columns common
    to all sources (columns only some sources have are dropped, since a
    mixture row must have every column) plus ``source`` (the source name) and
    ``sample_id`` (``"<source name>:<row index>"``, for the data ledger); any
    existing ``source``/``sample_id`` columns are replaced.
    """
    if len(datasets) != len(sources) or not sources:
        raise ValueError(f"mix_sources needs one dataset per source, got {len(datasets)} and {len(sources)}")
    names = _unique_names(sources)
    for i, (part, name) in enumerate(zip(datasets, names)):
        if len(part) == 0:
            raise DataError(f"data source '{name}' (data[{i}]) is empty. Fix: remove it from data or add records.")
    counts = mixture_counts([len(p) for p in datasets], sources, total)
    columns = _common_columns(datasets)
    reference = datasets[0].select_columns(columns).features
    parts = []
    for i, (part, name, count) in enumerate(zip(datasets, names, counts)):
        if count == 0:
            continue
        rows = _sample_indices(len(part), count, np.random.default_rng([seed, i]))
        picked = _align_features(part.select_columns(columns), reference, name)
        picked = picked.select(rows, keep_in_memory=True).flatten_indices(keep_in_memory=True)
        picked = picked.add_column("source", [name] * count)
        picked = picked.add_column("sample_id", [f"{name}:{r}" for r in rows])
        parts.append(picked)
    mixed = hfds.concatenate_datasets(parts)
    return mixed.shuffle(seed=seed, keep_in_memory=True).flatten_indices(keep_in_memory=True)


def describe_mixture(mixed: Dataset) -> dict[str, Any]:
    """Per-source sample counts of a mixture (for logs and the run summary)."""
    counts: dict[str, int] = {}
    for name in mixed["source"]:
        counts[name] = counts.get(name, 0) + 1
    return {"total": len(mixed), "per_source": counts}


