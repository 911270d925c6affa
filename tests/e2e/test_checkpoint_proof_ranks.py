"""checkpoint_proof on two processes (torchrun, DDP over gloo), one launch: checkpoint-5 is proven with both ranks' files,
the weights of checkpoint-10 are truncated after its save, and with ``save_total_limit: 1`` checkpoint-5 is still there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAULTS, findings_of, harness_cli, torchrun, write_yaml
from harness.lib.proven import MARKER

pytestmark = pytest.mark.slow
DRIVER = Path(__file__).with_name("checkpoint_driver.py")


def test_two_ranks_truncated_newest_and_the_proven_one_kept(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults", FAULTS], "fault_injector": {"truncate_checkpoint_at_step": 10}})
    result = harness_cli("wrap", "--config", str(config), "--", *torchrun(2), str(DRIVER), "--output_dir", str(out),
                         "--max_steps", "10", "--save_steps", "5", "--save_total_limit", "1", env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-4000:]
    (corrupt,) = findings_of(out, "CHECKPOINT_CORRUPT")
    assert corrupt["rank"] == 0 and corrupt["step"] == 10 and corrupt["evidence"]["files"] == ["model.safetensors"]
    assert corrupt["evidence"]["last_proven"] == str(out / "checkpoint-5")
    assert [f["code"] for f in findings_of(out) if f["severity"] != "info"] == ["CHECKPOINT_CORRUPT"]  # checkpoint-5: silent
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
    record = json.loads((out / "checkpoint-5" / MARKER).read_text())
    assert record["checks"] == ["complete", "weights_finite", "shapes", "reference_loss"]
    assert (out / "checkpoint-5" / "rng_state_0.pth").is_file() and (out / "checkpoint-5" / "rng_state_1.pth").is_file()
    point = harness_cli("resume-point", str(out))
    assert point.returncode == 0 and point.stdout.strip() == str(out / "checkpoint-5")
