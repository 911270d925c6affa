"""`harness demo`: the embedded default runs end to end and names every injected fault."""
from __future__ import annotations

from pathlib import Path

from conftest import findings_of, harness_cli


def test_demo_names_each_injected_fault(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = harness_cli("demo", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout[result.stdout.index("harness demo: finished"):]
    for fault in ("makes the loss non-finite", "replaced by random tokens", "kills itself (SIGKILL)"):
        assert fault in summary
    assert "harness skipped the optimizer update at step 8 after NONFINITE_LOSS" in summary
    assert "mlflow ui --backend-store-uri sqlite:///" in summary
    assert sorted(f["evidence"]["fault"] for f in findings_of(out, "DEMO_FAULT")) == ["corrupted_batch", "crash", "nonfinite_loss"]
    assert (out / "model.safetensors").exists()  # the resumed run finished
    (nonfinite,) = findings_of(out, "NONFINITE_LOSS")  # nan_guard caught the injected NaN batch
    assert nonfinite["step"] == 8 and nonfinite["action"] == "skip_step"
