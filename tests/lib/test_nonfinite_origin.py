"""Where a non-finite step started, from every rank's findings of that step (the report's 'Non-finite steps')."""
from __future__ import annotations

from typing import Any

from harness.core.findings import Finding, Severity
from harness.lib.nonfinite_origin import nonfinite_steps


def _finding(code: str, step: int, rank: int, **evidence: Any) -> Finding:
    return Finding(code=code, severity=Severity.ERROR, plugin="nan_guard", message="", step=step, rank=rank, evidence=evidence)


def test_the_rank_whose_loss_was_non_finite_is_where_the_step_started() -> None:
    steps = nonfinite_steps([
        _finding("NONFINITE_GRAD", 3, 0, reproduced_in_backward=False, world_size=2),  # rank 0 got rank 1's NaN
        _finding("NONFINITE_LOSS", 3, 1),
        _finding("LOSS_SPIKE", 3, 0),  # not a non-finite finding
    ])
    (step,) = steps
    assert (step.step, step.loss_ranks, step.grad_ranks, step.started_on, step.several_ranks) == (3, [1], [0], [1], True)
    assert step.origin().startswith("rank 1: its own loss")


def test_without_a_non_finite_loss_a_rank_whose_own_backward_reproduces_it_is_the_origin() -> None:
    (step,) = nonfinite_steps([
        _finding("NONFINITE_GRAD", 5, 1, reproduced_in_backward=True, world_size=2),
        _finding("NONFINITE_GRAD", 5, 0, reproduced_in_backward=False, world_size=2),
    ])
    assert step.started_on == [1] and step.origin().startswith("rank 1: its own backward reproduces")


def test_every_rank_rerunning_clean_is_no_rank_and_a_missing_rerun_is_not_determined() -> None:
    clean, unknown = nonfinite_steps([
        _finding("NONFINITE_GRAD", 7, 0, reproduced_in_backward=False, world_size=2),
        _finding("NONFINITE_GRAD", 7, 1, reproduced_in_backward=False, world_size=2),
        _finding("NONFINITE_GRAD", 9, 1, reproduced_in_backward=False, world_size=2),
        _finding("NONFINITE_GRAD", 9, 0, grad_source="the step's gradients", world_size=2),  # no rerun: cannot tell
    ])
    assert (clean.step, clean.started_on) == (7, []) and clean.origin().startswith("no rank:")
    assert (unknown.step, unknown.grad_ranks, unknown.started_on) == (9, [0, 1], []) and unknown.origin().startswith("not determined")


def test_one_process_is_marked_as_such_and_odd_records_are_skipped() -> None:
    steps = nonfinite_steps([
        _finding("NONFINITE_LOSS", 2, 0),
        Finding(code="NONFINITE_LOSS", severity=Severity.ERROR, plugin="p", message="", step=None, rank=0),  # run-level: no step
        _finding("NONFINITE_GRAD", 4, 0, world_size=True),  # a bool is not a world size
    ])
    assert [(s.step, s.several_ranks) for s in steps] == [(2, False), (4, False)]


def test_a_rank_whose_weights_are_already_nonfinite_is_named_with_them() -> None:
    weight = {"param": "model.layers.0.mlp.down_proj.weight", "rank": 1, "nonfinite_elements": 3, "elements": 4096}
    (step,) = nonfinite_steps([
        _finding("NONFINITE_GRAD", 13, 0, reproduced_in_backward=False, world_size=2),
        _finding("NONFINITE_LOSS", 13, 1, nonfinite_params_of_module=[weight]),
    ])
    assert step.started_on == [1] and step.nonfinite_weights == {1: ["model.layers.0.mlp.down_proj.weight"]}
    assert step.origin().startswith("rank 1: its own loss; weights already NaN/Inf (rank 1's model.layers.0.mlp.down_proj.weight)")
    assert "not the batch or the device" in step.origin()
