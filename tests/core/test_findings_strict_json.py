"""Run-directory JSON is strict: a non-finite number is written "nan", "inf", "-inf" (any parser reads the line) and
every reader that compares numbers reads those strings back as the floats they stand for."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from harness.core.findings import Finding, FindingsFile, Severity, read_findings
from harness.core.strictjson import as_float, dumps, json_float, strict_json


def _refuse(token: str) -> Any:
    raise ValueError(f"not strict JSON: bare {token}")


def strict_loads(text: str) -> Any:
    """``json.loads`` as jq, JSON.parse, Go or serde_json read: NaN / Infinity / -Infinity are errors."""
    return json.loads(text, parse_constant=_refuse)


def _finding(**kw: Any) -> Finding:
    return Finding(code="X", severity=Severity.ERROR, plugin="p", message="m", **kw)


def test_a_finding_with_nonfinite_evidence_is_a_strict_json_line_and_reads_back_as_nonfinite_numbers(tmp_path: Path) -> None:
    import numpy as np
    import torch

    evidence = {"loss": math.nan, "grad_norm": math.inf, "lowest": -math.inf, "losses": [1.5, math.nan], "finite": 2.5,
                "tensor": torch.tensor([math.nan, 2.0]), "scalar": torch.tensor(math.inf), "numpy": np.float64(-math.inf),
                "nested": {"window": (math.inf, 0.5)}, "text": "nan is a word here", "path": tmp_path}
    path = tmp_path / "findings.jsonl"
    sink = FindingsFile(path)
    sink.append(_finding(step=4, evidence=evidence))
    sink.close()
    (line,) = path.read_text(encoding="utf-8").splitlines()
    with pytest.raises(ValueError, match="not strict JSON"):
        strict_loads('{"loss": NaN}')  # the check can fail
    record = strict_loads(line)
    assert record["evidence"] == {"loss": "nan", "grad_norm": "inf", "lowest": "-inf", "losses": [1.5, "nan"], "finite": 2.5,
                                  "tensor": ["nan", 2.0], "scalar": "inf", "numpy": "-inf", "nested": {"window": ["inf", 0.5]},
                                  "text": "nan is a word here", "path": str(tmp_path)}
    assert record["step"] == 4 and record["severity"] == "error"
    # the readers: the finding comes back whole, and its numbers are non-finite numbers again where they are compared
    (back,) = read_findings(path)
    assert back.step == 4 and back.evidence["finite"] == 2.5
    loss, norm, lowest = (as_float(back.evidence[k]) for k in ("loss", "grad_norm", "lowest"))
    assert loss is not None and math.isnan(loss) and norm == math.inf and lowest == -math.inf
    assert [as_float(v) for v in back.evidence["losses"]][0] == 1.5 and math.isnan(as_float(back.evidence["losses"][1]))  # type: ignore[arg-type]


def test_a_finite_finding_is_encoded_exactly_as_before(tmp_path: Path) -> None:
    finding = _finding(step=2, evidence={"loss": 2.5, "ids": (1, 2), "path": tmp_path, "z": None})
    data = {name: getattr(finding, name) for name in finding.__dataclass_fields__}
    data["severity"] = "error"
    old = json.dumps({**data, "evidence": {"loss": 2.5, "ids": [1, 2], "path": str(tmp_path), "z": None}}, sort_keys=True)
    assert finding.to_json() == old


def test_a_cycle_beside_a_nan_still_keeps_the_finding(tmp_path: Path) -> None:
    evidence: dict[str, Any] = {"loss": math.nan}
    evidence["self"] = evidence  # a cycle: the evidence is kept as text, as before, and the line is still strict JSON
    record = strict_loads(_finding(evidence=evidence).to_json())
    assert record["evidence"]["loss"] == "nan" and record["evidence"]["self"].startswith("{'loss': nan")


def test_dumps_is_json_dumps_when_every_float_is_finite() -> None:
    values: list[Any] = [{"b": 1, "a": [1.5, None, True, "x"]}, [], 3, "s", {"k": {"n": 1e-300}}]
    for value in values:
        assert dumps(value) == json.dumps(value)
        assert dumps(value, sort_keys=True, indent=1, separators=(",", ":")) == json.dumps(value, sort_keys=True, indent=1, separators=(",", ":"))
    assert dumps({"p": Path("/x")}, default=str) == json.dumps({"p": Path("/x")}, default=str)


def test_dumps_writes_every_nonfinite_float_as_a_string() -> None:
    value = {"a": [math.nan, (math.inf, -math.inf)], math.inf: 1, "d": Path("/x"), "ok": 1.0}
    text = dumps(value, default=lambda v: [str(v), math.nan])
    assert strict_loads(text) == {"a": ["nan", ["inf", "-inf"]], "inf": 1, "d": ["/x", "nan"], "ok": 1.0}
    assert strict_loads(dumps([math.nan], indent=1)) == ["nan"]  # the pure-Python encoder (indent) too
    with pytest.raises(ValueError, match="Circular"):  # a cycle is the caller's to handle, as with json.dumps
        cycle: list[Any] = [math.nan]
        cycle.append(cycle)
        dumps(cycle)
    with pytest.raises(TypeError):
        dumps({"o": object()})  # what JSON cannot hold, without a default: json.dumps' error


def test_as_float_reads_what_the_writers_write() -> None:
    for written, expected in ((json_float(math.nan), "nan"), (json_float(math.inf), "inf"), (json_float(-math.inf), "-inf"),
                              (json_float(1.25), 1.25), (json_float(None), None)):
        assert written == expected
    assert math.isnan(as_float("nan")) and as_float("inf") == math.inf and as_float("-inf") == -math.inf  # type: ignore[arg-type]
    assert math.isnan(as_float(math.nan))  # type: ignore[arg-type]  # an old file's bare NaN, read by Python
    assert as_float(2) == 2.0 and as_float(2.5) == 2.5
    assert as_float(True) is None and as_float(None) is None and as_float("loss") is None and as_float([1]) is None


def test_one_shared_helper_for_every_writer() -> None:
    """Captures, forward tracing, findings and metrics use the same conversion (no second copy to drift)."""
    import harness.lib.capture as capture
    import harness.lib.first_bad as first_bad

    assert capture.strict_json is strict_json and capture.json_float is json_float
    assert first_bad.strict_json is strict_json
    assert not hasattr(first_bad, "_strict")
