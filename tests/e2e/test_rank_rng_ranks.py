"""rank_rng across two processes (torchrun, DDP over gloo): shared dropout streams and a sampler seed that differs on rank 1.

One launch covers both codes (the detectors are independent): the example
with attention dropout 0.1 and the Trainer's own seeding (every rank
``set_seed(args.seed)``: identical streams), and rank 1's train sampler
reseeded at run start (its shard then comes from another shuffled order)
while its global RNG is left as the Trainer seeded it. The clean
two-process runs under the default plugins (dropout 0, the same seeding)
are tests/e2e/test_multiprocess.py, which asserts no finding at all; a
two-process GPT-2 whose dropouts are 0 (its config still says
``summary_first_dropout=0.1``, read only by a summary head it does not have)
shares the streams too and must stay silent.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import EXAMPLES, FAULTS, findings_of, harness_cli, torchrun, wrapped_example, write_yaml

pytestmark = pytest.mark.slow


def test_identical_dropout_streams_and_rank_1s_sampler_seed_in_one_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["rank_rng", FAULTS],
                                             "fault_injector": {"sampler_seed_on_rank": 1, "sampler_seed": 1234}})
    result = wrapped_example(out, config, "--dropout", "0.1", launcher=torchrun(2), steps=3, save_steps=0)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "harness" / "sampler_seed.rank-1.txt").read_text() == "SeedableRandomSampler"  # accelerate's own sampler was hit

    assert sorted(f["code"] for f in findings_of(out)) == ["RNG_IDENTICAL_ACROSS_RANKS", "SAMPLER_SEED_MISMATCH"]
    (identical,) = findings_of(out, "RNG_IDENTICAL_ACROSS_RANKS")
    assert (identical["step"], identical["rank"], identical["severity"]) == (1, 0, "warning")
    ev = identical["evidence"]
    assert ev["ranks"] == [0, 1] and ev["dropout_stream"] == "torch" and ev["dropout"] == [
        "model.layers.*.self_attn.attention_dropout (functional, p=0.1, 2 modules)"]
    assert ev["identical_streams"] == ["torch", "python", "numpy"]  # set_seed seeds all three alike on every rank
    assert "ranks 0, 1 of 2" in identical["message"] and "set_seed(args.seed + args.process_index)" in identical["message"]

    (mismatch,) = findings_of(out, "SAMPLER_SEED_MISMATCH")
    assert (mismatch["step"], mismatch["rank"], mismatch["severity"]) == (1, 0, "error")
    assert mismatch["evidence"]["seeds"] == {"0": 0, "1": 1234} and mismatch["evidence"]["differing_ranks"] == [1]
    assert mismatch["evidence"]["kinds"] == {"0": "seedable", "1": "seedable"}
    assert "rank 0: 0, rank 1: 1234" in mismatch["message"] and "data_seed" in mismatch["message"]

    record = json.loads((out / "harness" / "rank_rng.json").read_text())
    assert record["step"] == 1 and record["world_size"] == 2 and record["sampler_mismatch"] == [0, 1]
    assert record["ranks"]["0"]["sampler"]["sharded"] and record["ranks"]["1"]["sampler"]["seed"] == 1234
    assert record["ranks"]["0"]["digests"]["torch"] == record["ranks"]["1"]["digests"]["torch"]


def test_a_gpt2_without_dropout_shares_its_streams_silently(tmp_path: Path) -> None:
    """Issue 43: config keys no module reads are no dropout (GPT-2's summary_first_dropout=0.1 made every such run warn)."""
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["rank_rng"]})
    script = [str(EXAMPLES / "train_zoo.py"), "--family", "gpt2", "--task", "causal_lm", "--output_dir", str(out), "--max_steps", "2"]
    result = harness_cli("wrap", "--config", str(config), "--", *torchrun(2), *script)
    assert result.returncode == 0, result.stderr[-4000:]
    assert findings_of(out) == []
    record = json.loads((out / "harness" / "rank_rng.json").read_text())
    assert record["world_size"] == 2 and record["dropout"] == []
    assert record["identical"] == [{"ranks": [0, 1], "streams": ["torch", "python", "numpy"]}]  # shared, as HF seeds: recorded, not reported
