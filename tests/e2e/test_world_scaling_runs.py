"""Two processes (torchrun, CPU, gloo) training heads whose loss ignores ``num_items_in_batch``, under ``harness wrap``.

With ``average_tokens_across_devices`` (transformers' default) the Trainer
multiplies every rank's loss by the number of processes, taking it as
normalised by every rank's label count; BERT's classifier and T5's
conditional generation return their own micro-batch mean instead, so the
loss the Trainer logs and every gradient are twice too large. The harness
blamed the initialisation (``INITIAL_LOSS_ANOMALY``: "first loss 2.233 is
2.03x ln(num_labels=3)") and recorded the doubled loss in steps.jsonl. Now
the cause is ``LOSS_SCALED_BY_WORLD_SIZE`` at step 1 and the record holds
each rank's own mean; the playbook's fix (``average_tokens_across_devices=False``)
is a silent run. The causal-LM runs of ``test_distributed.py`` are the clean
runs of a loss that does normalise by ``num_items_in_batch``.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import EXAMPLES, findings_of, harness_cli, read_jsonl, torchrun

pytestmark = pytest.mark.slow
LOUD = ("warning", "error", "critical")
HEADS = {  # cell -> (train_zoo arguments, the head named as the cause, the untrained level)
    "bert-classification": (["--family", "bert", "--task", "sequence_classification", "--num_labels", "3"],
                            "BertForSequenceClassification", math.log(3)),
    "t5-seq2seq": (["--family", "t5", "--task", "seq2seq"], "T5ForConditionalGeneration", None),
}


def _run(out: Path, *extra: str) -> None:
    script = [str(EXAMPLES / "train_zoo.py"), "--output_dir", str(out), "--max_steps", "4", *extra]
    result = harness_cli("wrap", "--", *torchrun(), *script, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("cell", sorted(HEADS))
def test_a_head_that_ignores_num_items_in_batch_is_loss_scaled_by_world_size(tmp_path: Path, cell: str) -> None:
    arguments, head, level = HEADS[cell]
    out = tmp_path / cell
    _run(out, *arguments)
    (finding,) = findings_of(out, "LOSS_SCALED_BY_WORLD_SIZE")
    ev = finding["evidence"]
    assert finding["step"] == 1 and finding["rank"] == 0 and finding["severity"] == "warning"
    assert ev["world_size"] == 2 and ev["loss_scale"] == 2 and 1.8 < ev["factor"] < 2.2
    assert f"{head}'s loss ignores num_items_in_batch" in finding["message"]
    assert "max_grad_norm=1 acts as 0.5" in finding["message"] and "average_tokens_across_devices=False" in finding["message"]
    # the cause is named, so nothing blames the initialisation: no other finding at warning or above
    assert [f["code"] for f in findings_of(out) if f["severity"] in LOUD] == ["LOSS_SCALED_BY_WORLD_SIZE"]
    # steps.jsonl holds rank 0's own mean (its one micro-batch's, recomputed without dropout: the tiny models have none)
    recorded = {r["step"]: r["loss"] for r in read_jsonl(out / "harness" / "steps.jsonl")}
    assert recorded[1] == pytest.approx(ev["recomputed_micro_batch_mean"], rel=0.01) == pytest.approx(ev["recorded_loss"], rel=1e-6)
    logged = {r["step"]: r["loss"] for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r}
    assert all(1.6 < logged[s] / recorded[s] < 2.4 for s in logged), (logged, recorded)  # the Trainer logs it doubled
    if level is not None:
        assert recorded[1] == pytest.approx(level, rel=0.1)  # ln 3 (2 ln 3 before)


def test_the_playbook_fix_average_tokens_across_devices_false_is_a_clean_run(tmp_path: Path) -> None:
    out = tmp_path / "fixed"
    _run(out, *HEADS["bert-classification"][0], "--average_tokens_across_devices", "false")
    assert [(f["code"], f["step"]) for f in findings_of(out) if f["severity"] in LOUD] == []
    recorded = {r["step"]: r["loss"] for r in read_jsonl(out / "harness" / "steps.jsonl")}
    logged = {r["step"]: r["loss"] for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r}
    assert recorded[1] == pytest.approx(math.log(3), rel=0.1)
    assert all(0.8 < logged[s] / recorded[s] < 1.25 for s in logged), (logged, recorded)  # ranks differ a little, no factor
