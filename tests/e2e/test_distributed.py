"""Two processes on CPU (gloo): findings reach rank 0 exactly once; skip_step is agreed and bit-identical.

Runs the unmodified example script under `harness wrap`, through each launcher users
have (torchrun, accelerate launch, the deepspeed launcher), with plain DDP and with
DeepSpeed ZeRO-2 (``DS_ACCELERATOR=cpu``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLE, FAULTS, REPO, findings_of, free_port, harness_cli, read_jsonl, torchrun, write_yaml

pytestmark = pytest.mark.slow
ZERO2 = ["--deepspeed", str(REPO / "examples" / "ds_zero2.json")]
BIN = Path(sys.executable).parent


def _launch(launcher: str) -> tuple[list[str], list[str]]:
    """(launcher command, extra script arguments)."""
    if launcher == "torchrun-ddp":
        return torchrun(), []
    if launcher == "torchrun-zero2":
        return torchrun(), ZERO2
    if launcher == "torchrun-zero3":
        return torchrun(), ["--deepspeed", str(REPO / "examples" / "ds_zero3.json")]
    if launcher == "accelerate-ddp":
        return [
            str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        ], []
    assert launcher == "deepspeed-zero2"
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())], ZERO2


@pytest.mark.parametrize("launcher", ["torchrun-ddp", "torchrun-zero2", "torchrun-zero3", "accelerate-ddp", "deepspeed-zero2"])
def test_rank1_finding_lands_once_and_all_ranks_skip_together(tmp_path: Path, launcher: str) -> None:
    out = tmp_path / launcher
    config = write_yaml(
        tmp_path / "h.yaml",
        {
            "plugins": ["metrics_log", "grad_sync", FAULTS],
            "fault_injector": {"report_at_step": 3, "report_on_rank": 1, "action": "skip_step", "snapshot_steps": [2, 3, 4]},
        },
    )
    command, extra = _launch(launcher)
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "5", *extra]
    result = harness_cli("wrap", "--config", str(config), "--", *command, *script, env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-4000:]

    faults = findings_of(out, "TEST_FAULT")
    assert [(f["rank"], f["step"], f["action"]) for f in faults] == [(1, 3, "skip_step")]
    (taken,) = findings_of(out, "ACTION_TAKEN")
    assert taken["step"] == 3 and "on rank 1" in taken["message"]
    assert [f["code"] for f in read_jsonl(out / "harness" / "ranks" / "findings.rank-1.jsonl")] == ["TEST_FAULT"]
    # one report, by rank 0, after every rank ended; rank 1's finding is in it
    report = (out / "harness" / "report.md").read_text(encoding="utf-8")
    assert "| [TEST_FAULT](report/playbooks/harness-core.md#test_fault) | 1 | 3 | 1 |" in report
    assert (out / "harness" / "ranks" / "attempt.rank-1").read_text() == "ended"
    assert "| world size | 2 |" in report
    # grad_sync: under ZeRO-3 it says plainly that there are no replicas to compare; elsewhere it compares them
    unsupported = findings_of(out, "GRAD_SYNC_UNSUPPORTED")
    if launcher == "torchrun-zero3":
        assert len(unsupported) == 1 and unsupported[0]["evidence"]["parallelism"] == "DeepSpeed ZeRO-3 shards weights and gradients"
        assert not (out / "harness" / "grad_sync.jsonl").exists()
    else:
        assert unsupported == [] and (out / "harness" / "grad_sync.jsonl").exists()

    for rank in (0, 1):
        snaps = {r["step"]: r for r in read_jsonl(out / "harness" / f"fault_injector.rank-{rank}.jsonl")}
        assert snaps[3]["skipped"], f"rank {rank} did not skip step 3"
        assert snaps[3]["params_changed"] == [] and snaps[3]["optimizer_changed"] == []
        assert snaps[3]["optimizer_tensors"] > 0
        assert snaps[2]["params_changed"] and snaps[4]["params_changed"] and snaps[4]["optimizer_changed"]
        assert snaps[2]["lr"] != snaps[3]["lr"] == snaps[4]["lr"]  # the LR schedule held still


def test_uneven_label_counts_across_ranks_are_a_clean_run(tmp_path: Path) -> None:
    """SFT-like rows (a masked 'prompt' of random length) on two ranks: with transformers' default
    ``average_tokens_across_devices`` each rank's loss is its label sum over both ranks' label count times two, which
    swings with the ranks' share of labels. The harness judged that value: a clean run got LOSS_SPIKE (and then
    FAULT_REPRODUCED) and steps.jsonl a loss up to 45% off. It now judges and records this rank's own mean loss, which
    stays within 1% of the Trainer's logged loss (the mean over ranks) here."""
    out = tmp_path / "run"
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "40", "--prompt_masking"]
    result = harness_cli("wrap", "--", *torchrun(), *script)
    assert result.returncode == 0, result.stderr[-4000:]
    serious = [(f["code"], f["step"], f["rank"]) for f in findings_of(out) if f["severity"] in ("warning", "error", "critical")]
    assert serious == [], serious
    recorded = {r["step"]: r["loss"] for r in read_jsonl(out / "harness" / "steps.jsonl")}
    logged = {r["step"]: r["loss"] for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r}
    ratios = sorted(recorded[s] / logged[s] for s in logged)
    assert len(ratios) == 40 and 0.9 < ratios[0] and ratios[-1] < 1.1, ratios  # before: 0.48 to 1.42


def test_a_rank_that_runs_out_of_data_first_ends_the_job_as_fast_as_without_the_harness(tmp_path: Path) -> None:
    """Rank 1 loads a shorter training set (uneven shards): it ends its epoch 15 steps before rank 0. Without the
    harness rank 1 exits and rank 0's next gradient all-reduce fails within seconds; the harness's train-end collective
    held rank 1 back while rank 0 waited in that all-reduce, and the job hung until the process group's 30-minute
    timeout. The train end has no collective now: the job ends quickly, the weights of the ranks drifted apart (their
    LR schedules differ) and their shards overlapped, and each is found."""
    import time

    out = tmp_path / "run"
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "-1", "--num_train_epochs", "1", "--short_data_rank", "1"]
    began = time.monotonic()
    result = harness_cli("wrap", "--", *torchrun(), *script, timeout=240)
    assert result.returncode != 0, "rank 0 trains on alone: its next collective fails"
    assert time.monotonic() - began < 200, "the job waited for a timeout instead of ending when rank 1 left"
    codes = {f["code"] for f in findings_of(out)}
    assert "RANK_DATA_OVERLAP" in codes, codes
    run = json.loads((out / "harness" / "run.json").read_text(encoding="utf-8"))
    assert run["attempts"][-1]["status"] == "crashed", run["attempts"]
