"""stages/data.py: every supported file kind loads, every user mistake gets a message naming file, field and fix,
and the weighted mixture keeps its ratio, its caps and its seed."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict
from pydantic import ValidationError

from harness.stages.data import DataError, DataSource, load_source, load_sources, mix_sources, mixture_counts

ROWS = [{"text": f"document number {i}", "id": i} for i in range(6)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def files_in(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*")}


# --------------------------------------------------------------------------- loading


def test_txt_blank_line_documents(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first doc line one\nline two\n\n\nsecond doc\n\nthird\n", encoding="utf-8")
    ds = load_source(DataSource(path="a.txt"), tmp_path, ["text"])
    assert ds["text"] == ["first doc line one\nline two", "second doc", "third"]


def test_txt_one_document_per_line_and_custom_field(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("\nalpha\nbeta  \ngamma\n\n", encoding="utf-8")
    ds = load_source(DataSource(path="b.txt", text_field="content"), tmp_path, ["content"])
    assert ds.column_names == ["content"]
    assert ds["content"] == ["alpha", "beta", "gamma"]


def test_jsonl_relative_to_base_dir_and_no_cache_next_to_data(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "train.jsonl", ROWS)
    before = files_in(tmp_path)
    ds = load_source(DataSource(path="sub/train.jsonl"), tmp_path, ["text", "id"])
    assert ds["text"] == [r["text"] for r in ROWS] and ds["id"] == list(range(6))
    ds.map(lambda r: {"n": len(r["text"])})  # later transformations must not write caches either
    assert files_in(tmp_path) == before


def test_parquet(tmp_path: Path) -> None:
    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
    ds = load_source(DataSource(path=str(tmp_path / "d.parquet")), Path("/nonexistent"), ["text"])
    assert len(ds) == 6 and set(ds.column_names) == {"text", "id"}


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    DatasetDict({"train": Dataset.from_list(ROWS[:4]), "test": Dataset.from_list(ROWS[4:])}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert len(load_source(DataSource(path="plain"), tmp_path, ["text"])) == 6
    assert load_source(DataSource(path="dict"), tmp_path, ["text"])["id"] == [0, 1, 2, 3]


def test_dataset_dict_without_train_split(tmp_path: Path) -> None:
    DatasetDict({"validation": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"without a 'train' split \(splits: 'validation'\)"):
        load_source(DataSource(path="dict"), tmp_path, ["text"], index=0)


def test_missing_file_names_absolute_path_key_and_fix(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(DataError) as info:
        load_sources([DataSource(path="train.jsonl"), DataSource(path="trian.jsonl")], tmp_path, ["text"])
    message = str(info.value)
    assert f"data file '{tmp_path.resolve() / 'trian.jsonl'}' (data[1].path) does not exist" in message
    assert "Did you mean 'train.jsonl'?" in message and "Fix:" in message


def test_missing_field_did_you_mean(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"txt": "hello", "id": 1}])
    with pytest.raises(DataError) as info:
        load_source(DataSource(path="t.jsonl"), tmp_path, ["text"], index=2)
    message = str(info.value)
    assert str(path) in message and "(data[2]) has no field 'text'" in message
    assert "'txt', 'id'" in message and "Did you mean 'txt'?" in message
    assert "set data[2].text_field" in message


def test_empty_and_unsupported(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n\n  \n", encoding="utf-8")
    (tmp_path / "data.csv").write_text("text\nhi\n", encoding="utf-8")
    with pytest.raises(DataError, match="contains no records"):
        load_source(DataSource(path="empty.txt"), tmp_path, ["text"])
    with pytest.raises(DataError, match=r"unsupported extension '\.csv'.*\.jsonl.*\.parquet.*save_to_disk"):
        load_source(DataSource(path="data.csv"), tmp_path, ["text"])
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="not a dataset saved with save_to_disk"):
        load_source(DataSource(path="folder"), tmp_path, ["text"])


def test_datasource_validation() -> None:
    assert DataSource(path="x/web.jsonl").display_name == "web"
    for bad in ({"path": "a", "weight": 0}, {"path": "a", "max_repeats": 0}, {"path": "a", "wieght": 2}):
        with pytest.raises(ValidationError):
            DataSource(**bad)
    assert all(f.description for f in DataSource.model_fields.values())


# --------------------------------------------------------------------------- mixing


def corpus(name: str, n: int, extra: bool = False) -> Dataset:
    rows = [{"text": f"{name} {i}", "n": i} for i in range(n)]
    if extra:
        rows = [{**r, "only_here": 1} for r in rows]
    return Dataset.from_list(rows)


def test_mixture_proportions_1_to_4() -> None:
    parts = [corpus("a", 100), corpus("b", 100, extra=True)]
    sources = [DataSource(path="a.jsonl", weight=1), DataSource(path="b.jsonl", weight=4)]
    mixed = mix_sources(parts, sources, total=97, seed=0)
    counts = Counter(mixed["source"])
    assert len(mixed) == 97
    assert abs(counts["a"] - 97 / 5) <= 1 and abs(counts["b"] - 97 * 4 / 5) <= 1
    assert mixed.column_names == ["text", "n", "source", "sample_id"]  # 'only_here' is not common: dropped
    for row in mixed.select(range(10)):
        name, index = row["sample_id"].split(":")
        assert row["source"] == name and row["text"] == f"{name} {index}"


def test_mixture_default_total_is_largest_the_caps_allow() -> None:
    sources = [DataSource(path="a.jsonl", weight=1), DataSource(path="b.jsonl", weight=4, max_repeats=2)]
    assert mixture_counts([50, 30], sources) == [15, 60]  # b's cap 60 binds; a gives 15 without repeats
    mixed = mix_sources([corpus("a", 50), corpus("b", 30)], sources, seed=1)
    per_id = Counter(mixed["sample_id"])
    assert len(mixed) == 75
    assert max(c for s, c in per_id.items() if s.startswith("a:")) == 1
    assert max(c for s, c in per_id.items() if s.startswith("b:")) == 2


def test_max_repeats_one_never_repeats_and_cap_error() -> None:
    parts = [corpus("a", 10), corpus("b", 1000)]
    sources = [DataSource(path="a.jsonl", weight=1), DataSource(path="b.jsonl", weight=9)]
    mixed = mix_sources(parts, sources, total=100, seed=0)
    a_ids = [s for s in mixed["sample_id"] if s.startswith("a:")]
    assert len(a_ids) == 10 and len(set(a_ids)) == 10
    with pytest.raises(DataError) as info:
        mix_sources(parts, sources, total=200, seed=0)
    message = str(info.value)
    assert "data source 'a' (data[0]) would need 20 samples" in message
    assert "it has 10 samples and max_repeats=1, so it can give at most 10" in message
    assert "raise data[0].max_repeats to 2" in message and "at most 100 samples" in message


def test_mixture_is_deterministic_by_seed() -> None:
    parts = [corpus("a", 40), corpus("b", 40)]
    sources = [DataSource(path="a.jsonl", weight=2, max_repeats=3), DataSource(path="b.jsonl", weight=1)]
    first = mix_sources(parts, sources, total=60, seed=7)["sample_id"]
    assert first == mix_sources(parts, sources, total=60, seed=7)["sample_id"]
    assert first != mix_sources(parts, sources, total=60, seed=8)["sample_id"]


def test_duplicate_source_names_rejected() -> None:
    sources = [DataSource(path="x/train.jsonl"), DataSource(path="y/train.jsonl")]
    with pytest.raises(DataError, match=r"data\[0\] and data\[1\] are both named 'train'.*data\[1\]\.name"):
        mix_sources([corpus("a", 3), corpus("b", 3)], sources)


def test_records_missing_a_required_field_are_named(tmp_path: Path) -> None:
    """A field present in some records only: the column exists (null elsewhere), so the field check alone passes."""
    from harness.stages.data import check_fields

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(6)]
    rows[3] = {"prompt": "q3", "answer": "a3"}
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]) + "\n", encoding="utf-8")
    source = DataSource(path="sft.jsonl")
    dataset = load_source(source, tmp_path, [], index=1)  # loads: the file is fine as data
    with pytest.raises(DataError) as info:
        check_fields(dataset, path, source, "data[1]", ["prompt", "completion"])
    message = str(info.value)
    assert str(path) in message and "(data[1])" in message and "1 of 6 records have no value for field 'completion'" in message
    assert "first: line 5." in message  # a blank line holds no record: line numbers, not row indices
    assert "'prompt', 'answer'" in message and "Fix:" in message
    (tmp_path / "n.jsonl").write_text("".join(json.dumps({"text": i}) + "\n" for i in range(3)), encoding="utf-8")
    with pytest.raises(DataError, match=r"field 'text' holds int64 values, not text.*data\[0\].text_field"):
        load_source(DataSource(path="n.jsonl"), tmp_path, ["text"], index=0)
