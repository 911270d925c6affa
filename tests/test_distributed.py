"""Two processes on CPU (gloo): findings reach rank 0 exactly once; skip_step is agreed and bit-identical.

Runs the unmodified example script under `harness wrap -- torchrun --nproc_per_node 2`,
with plain DDP and with DeepSpeed ZeRO-2 (``DS_ACCELERATOR=cpu``).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import EXAMPLE, FAULTS, REPO, findings_of, harness_cli, read_jsonl, torchrun, write_yaml

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine", ["ddp", "deepspeed_zero2"])
def test_rank1_finding_lands_once_and_all_ranks_skip_together(tmp_path: Path, engine: str) -> None:
    out = tmp_path / engine
    config = write_yaml(
        tmp_path / "h.yaml",
        {
            "plugins": ["metrics_log", FAULTS],
            "fault_injector": {"report_at_step": 3, "report_on_rank": 1, "action": "skip_step", "snapshot_steps": [2, 3, 4]},
        },
    )
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "5"]
    if engine == "deepspeed_zero2":
        script += ["--deepspeed", str(REPO / "examples" / "ds_zero2.json")]
    result = harness_cli(
        "wrap", "--config", str(config), "--", *torchrun(), *script, env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-4000:]

    faults = findings_of(out, "TEST_FAULT")
    assert [(f["rank"], f["step"], f["action"]) for f in faults] == [(1, 3, "skip_step")]
    (taken,) = findings_of(out, "ACTION_TAKEN")
    assert taken["step"] == 3 and "on rank 1" in taken["message"]
    assert [f["code"] for f in read_jsonl(out / "harness" / "ranks" / "findings.rank-1.jsonl")] == ["TEST_FAULT"]

    for rank in (0, 1):
        snaps = {r["step"]: r for r in read_jsonl(out / "harness" / f"fault_injector.rank-{rank}.jsonl")}
        assert snaps[3]["skipped"], f"rank {rank} did not skip step 3"
        assert snaps[3]["params_changed"] == [] and snaps[3]["optimizer_changed"] == []
        assert snaps[3]["optimizer_tensors"] > 0
        assert snaps[2]["params_changed"] and snaps[4]["params_changed"] and snaps[4]["optimizer_changed"]
        assert snaps[3]["lr"] == snaps[2]["lr"] != snaps[4]["lr"]
