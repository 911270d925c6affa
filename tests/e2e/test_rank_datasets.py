"""Two ranks (torchrun, gloo) under `harness wrap`: a rank whose training dataset differs from the others' is named at step 1.

The Trainer's sampler shards one dataset by index, so every rank must hold the same rows in the same order. Before,
rank 1 shuffling its rows without a seed went nearly unseen: a couple of RANK_DATA_OVERLAP findings, while over the epoch
a quarter of the samples were trained twice and as many never. data_hash now compares the ranks' dataset fingerprints,
which ride the first step's exchange.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import findings_of, torchrun, wrapped_example, write_yaml

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("shuffled", [True, False], ids=["rank1-shuffled", "clean"])
def test_a_rank_training_its_rows_in_another_order_is_named_at_the_first_step(tmp_path: Path, shuffled: bool) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults"]})
    extra = ["--shuffle_rank", "1"] if shuffled else []
    result = wrapped_example(out, config, *extra, launcher=torchrun(), steps=3, save_steps=0)
    assert result.returncode == 0, result.stderr[-4000:]
    differ = findings_of(out, "RANK_DATASETS_DIFFER")
    if not shuffled:
        assert differ == [], differ
        return
    (finding,) = differ
    assert finding["step"] == 1 and finding["rank"] == 0 and finding["severity"] == "error"
    assert finding["evidence"]["differing_ranks"] == [1] and finding["evidence"]["same_rows_other_order"] == [1]
    rows = {g["rows"] for g in finding["evidence"]["groups"]}
    assert len(rows) == 1 and len({g["digest"] for g in finding["evidence"]["groups"]}) == 2
    assert f"rank 1 holds {rows.pop()} rows" in finding["message"] and "same dataset in the same order" in finding["message"]
    assert "RANK_DATASETS_DIFFER" in result.stderr  # wrap's live line and closing summary
