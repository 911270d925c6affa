"""harness estimate: the field notes' worked examples, memory per ZeRO stage, and a stage config as input."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from harness.cli import main as harness_main
from harness.tools.estimate import SECONDS_PER_DAY, estimate, memory_per_device, peak_for, plan_from_config


def test_seven_billion_parameters_on_a_trillion_tokens_is_4_2e22_flops() -> None:
    assert estimate(7e9, 1e12).flops == pytest.approx(4.2e22)


def test_seventy_billion_on_100b_tokens_at_300_tflops_half_used_on_512_devices_takes_about_six_days() -> None:
    result = estimate(70e9, 100e9, devices=512, peak_tflops=300, mfu=0.5)
    assert result.flops == pytest.approx(4.2e22)
    assert result.seconds / SECONDS_PER_DAY == pytest.approx(6.33, abs=0.01)
    assert result.device_days == pytest.approx(3240, rel=0.01)  # one device alone: about 3,240 days


def test_memory_per_device_follows_precision_and_zero_stage() -> None:
    assert memory_per_device(7e9, "bf16", 0).total == pytest.approx(16 * 7e9)  # 2 + 2 + 12 bytes per parameter
    assert memory_per_device(7e9, "bf16", 1, 8).total == pytest.approx(7e9 * (4 + 12 / 8))
    assert memory_per_device(7e9, "bf16", 2, 8).total == pytest.approx(7e9 * (2 + 14 / 8))
    assert memory_per_device(7e9, "bf16", 3, 8).total == pytest.approx(7e9 * 16 / 8)
    assert memory_per_device(1e9, "fp32", 0).total == pytest.approx(16e9)  # 4 + 4 + 8
    with pytest.raises(ValueError, match="ZeRO stage"):
        memory_per_device(1e9, "bf16", 4)


def test_device_peaks_by_name() -> None:
    assert peak_for("NVIDIA H100 80GB HBM3") == 989 and peak_for("NVIDIA A100-SXM4-40GB") == 312
    assert peak_for("NVIDIA GH200 480GB") == 989 and peak_for("cpu") is None
    # a whole name, not a piece of one: an L40 is not an L4, the PCIe H100 is not the SXM one
    assert peak_for("NVIDIA L40") is None and peak_for("L40S") == 362 and peak_for("NVIDIA L4") == 121
    assert peak_for("NVIDIA H100 PCIe") == 756 and peak_for("H100") == 989 and peak_for("NVIDIA A100-PCIE-40GB") == 312


@pytest.mark.parametrize(("args", "said"), [
    (["--params", "0", "--tokens", "1e12"], "--params 0 is not a positive number"),
    (["--params", "nan", "--tokens", "1e12"], "--params nan is not a positive number"),
    (["--params", "7e9", "--tokens", "inf"], "--tokens inf is not a positive number"),
    (["--params", "7e9", "--tokens", "1e12", "--peak-tflops", "-5"], "--peak-tflops -5 is not a positive number"),
    (["--params", "7e9", "--tokens", "1e12", "--peak-tflops", "500", "--device", "H100"], "both give the peak"),
])
def test_cli_refuses_numbers_that_are_no_plan(capsys: Any, args: list[str], said: str) -> None:
    assert harness_main(["estimate", *args]) == 2
    err = capsys.readouterr().err
    assert said in err and "Fix:" in err, err


def test_cli_notes_the_16_bit_peak_of_an_fp32_plan_and_reads_no_hub_model(capsys: Any, tmp_path: Path) -> None:
    assert harness_main(["estimate", "--params", "1e9", "--tokens", "1e10", "--device", "H100", "--precision", "fp32",
                         "--mfu", "0.004"]) == 0
    out = capsys.readouterr().out
    assert "note: --device H100 gives its dense 16-bit peak" in out and "x 0.4%" in out and ", 1 device)" in out, out
    config = tmp_path / "run.yaml"
    config.write_text((REPO / "examples" / "pretrain.yaml").read_text(encoding="utf-8") + "\n", encoding="utf-8")
    import yaml

    data = yaml.safe_load(config.read_text(encoding="utf-8"))
    data["model"] = {"path": "../nothere"}
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert harness_main(["estimate", "--from-config", str(config)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model.path ../nothere" in err and "holds no config.json" in err and "Traceback" not in err, err
    (tmp_path / "adir").mkdir()
    assert harness_main(["estimate", "--from-config", str(tmp_path / "adir")]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_cli_prints_the_worked_example_and_reads_a_stage_config(capsys: Any) -> None:
    assert harness_main(["estimate", "--params", "70e9", "--tokens", "100e9", "--devices", "512", "--peak-tflops", "300",
                         "--mfu", "0.5", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "4.2e+22 FLOPs" in out and "6.33 days" in out and "ZeRO-3, 512 devices)  2.19 GB" in out
    plan = plan_from_config(str(REPO / "examples" / "pretrain.yaml"), devices=2)
    assert plan.tokens == 40 * 8 * 1 * 2 * 128 and plan.precision == "fp32" and plan.zero == 0 and 1e5 < plan.params < 1e6
    assert harness_main(["estimate", "--from-config", str(REPO / "examples" / "pretrain.yaml"), "--device", "A100"]) == 0
    assert "312 TFLOPS" in capsys.readouterr().out
    assert harness_main(["estimate", "--params", "7e9"]) == 2
    assert "needs --params and --tokens" in capsys.readouterr().err
    assert harness_main(["estimate", "--params", "7e9", "--tokens", "1e12", "--device", "TPU9"]) == 2
    assert "no peak known for device 'TPU9'" in capsys.readouterr().err
