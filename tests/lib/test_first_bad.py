"""first_bad: the first non-finite gradient and module output, on tiny torch modules (milliseconds)."""
from __future__ import annotations

import json
import math

import torch
from torch import nn

from harness.lib.first_bad import clean_name, locate_forward, nonfinite_names
from harness.lib.first_bad_grads import GradScan, locate_backward, scan_gradients


class Scale(nn.Module):
    """Multiplies by a constant: inf makes an overflow on purpose."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Block(nn.Module):
    """A parent whose children are finite but whose own output is not."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) / 0.0


def _net(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), *middle, nn.Linear(4, 2))


def test_nonfinite_names_keeps_order_and_skips_what_cannot_hold_nan() -> None:
    named = [("a", torch.ones(3)), ("b", torch.tensor([1.0, float("nan")])), ("c", torch.tensor([float("-inf")])),
             ("ints", torch.tensor([1, 2])), ("empty", torch.ones(0)), ("none", None), ("d", torch.ones(2, dtype=torch.bfloat16))]
    assert nonfinite_names(named) == (["b", "c"], 4)
    assert nonfinite_names([]) == ([], 0)


def test_scan_gradients_lists_module_order_and_names_the_one_nearest_the_output() -> None:
    net = _net(nn.ReLU(), nn.Linear(4, 4))
    net(torch.ones(1, 4)).sum().backward()
    with torch.no_grad():
        net[0].weight.grad[0, 0] = float("nan")
        net[2].bias.grad[1] = float("inf")
    scan = scan_gradients(net)
    assert scan.names == ["0.weight", "2.bias"] and scan.checked == 6
    assert scan.first_backward == "2.bias"
    evidence = scan.evidence()
    assert evidence["first_nonfinite_param"] == "2.bias" and evidence["nonfinite_param_count"] == 2
    assert "2.bias" in scan.describe() and "0.weight" in scan.describe()
    json.dumps(evidence, allow_nan=False)


def test_scan_gradients_without_gradients_says_unavailable() -> None:
    scan = scan_gradients(_net())
    assert scan.unavailable and scan.evidence()["nonfinite_params"] == "unavailable" and "unavailable" in scan.describe()
    assert GradScan(names=[], checked=3).describe().startswith("no non-finite gradient")


def test_a_rerun_of_backward_finds_the_first_in_true_backward_order_and_leaves_grad_alone() -> None:
    net = _net(nn.Linear(4, 4), Scale(1.0))
    net(torch.ones(1, 4)).sum().backward()
    before = [p.grad.clone() for p in net.parameters()]
    x = torch.ones(1, 4)

    def poisoned() -> torch.Tensor:
        hidden = net[1](net[0](x))
        hidden.register_hook(lambda g: g * float("inf"))  # born in backward at layer 1's output
        return net[3](net[2](hidden)).sum()

    scan = locate_backward(net, [lambda: net(x).sum(), poisoned])  # the first micro-batch is clean, the second is not
    assert scan.reproduced is True and scan.first_backward == "1.bias"  # backward reaches the bias before the weight
    assert scan.names == ["0.weight", "0.bias", "1.weight", "1.bias"] and scan.checked == 6
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))  # the step's own gradients untouched
    assert all(not p._backward_hooks for p in net.parameters())
    assert scan.evidence()["reproduced_in_backward"] is True and scan.evidence()["grad_source"].startswith("a rerun")
    clean = locate_backward(net, [lambda: net(x).sum()])
    assert clean.reproduced is False and clean.first_backward is None and "not reproduced" in clean.describe()
    # with several ranks a clean rerun (no all-reduce) clears this rank's backward: the NaN may be another rank's
    across = clean.describe(ranks=2)
    assert "did not make the NaN" in across and "another rank" in across and "not reproduced" not in across


def test_locate_names_the_overflowing_module_with_finite_input() -> None:
    net = _net(Scale(float("inf")))
    found = locate_forward(net, {"input": torch.ones(2, 4)})
    assert found.reproduced and found.first is not None and found.first.name == "1" and found.first.kind == "Scale"
    assert found.first.input is not None and all(abs(v) < 1e3 for v in found.first.input.values())
    assert found.first.output is not None and not math.isfinite(found.first.output["abs_max"])
    assert found.last_finite is not None and found.last_finite.name == "0"
    evidence = found.evidence()
    assert evidence["first_nonfinite_module"] == "1" and evidence["last_finite_module"] == "0" and evidence["reproduced_in_forward"] is True
    json.dumps(evidence, allow_nan=False)  # strict JSON: non-finite numbers as strings
    assert "1 (Scale; input min" in found.describe() and "after 0 (finite)" in found.describe()


def test_a_child_finishes_first_so_the_parent_is_named_when_only_it_breaks() -> None:
    found = locate_forward(_net(Block()), {"input": torch.ones(1, 4)})
    assert found.first is not None and found.first.name == "1" and found.last_finite is not None and found.last_finite.name == "1.inner"


def test_a_finite_rerun_is_not_reproduced() -> None:
    found = locate_forward(_net(nn.ReLU()), {"input": torch.ones(1, 4)})
    assert not found.reproduced and found.first is None and found.calls == 4  # three children and the model itself
    assert found.evidence()["first_nonfinite_module"] is None and found.evidence()["reproduced_in_forward"] is False
    assert "not reproduced" in found.describe()


def test_the_rng_is_restored_and_hooks_removed() -> None:
    net = _net(nn.Dropout(0.5))
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    locate_forward(net, {"input": torch.ones(1, 4)})
    assert torch.equal(torch.rand(3), expected)
    assert all(not m._forward_hooks for m in net.modules())


def test_clean_name_strips_wrappers() -> None:
    assert clean_name("module._fsdp_wrapped_module.model.layers.1._checkpoint_wrapped_module.mlp.weight") == "model.layers.1.mlp.weight"
    assert clean_name("_orig_mod.lm_head.weight") == "lm_head.weight"


def test_a_nonfinite_weight_of_the_first_bad_module_is_counted_with_the_rank() -> None:
    net = _net(nn.ReLU(), nn.Linear(4, 4))
    with torch.no_grad():
        net[2].weight[1, :2] = float("nan")
        net[2].bias[0] = float("inf")
    found = locate_forward(net, {"input": torch.ones(2, 4)}, rank=1)
    assert found.first is not None and found.first.name == "2"
    assert [(p.name, p.nonfinite, p.elements, p.rank) for p in found.nonfinite_params] == [("2.weight", 2, 16, 1), ("2.bias", 1, 4, 1)]
    evidence = found.evidence()
    assert evidence["nonfinite_params_of_module"] == [{"param": "2.weight", "rank": 1, "nonfinite_elements": 2, "elements": 16},
                                                      {"param": "2.bias", "rank": 1, "nonfinite_elements": 1, "elements": 4}]
    assert evidence["params_of_module_checked"] == 2
    json.dumps(evidence, allow_nan=False)
    text = found.describe()
    assert "its weight holds NaN/Inf on rank 1 (2 of 16 elements); its bias holds NaN/Inf on rank 1 (1 of 4 elements)" in text
    assert "not the device" in text


def test_own_parameters_only_and_not_when_the_input_is_already_nonfinite() -> None:
    # an embedding's input is token ids (not floating): its own weight is checked
    emb = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))
    with torch.no_grad():
        emb[0].weight[2, 0] = float("nan")
    found = locate_forward(emb, {"input": torch.tensor([[1, 2]])})
    assert found.first is not None and found.first.name == "0" and [p.name for p in found.nonfinite_params] == ["0.weight"]
    assert "its weight holds NaN/Inf (1 of 15 elements)" in found.describe()  # no rank given: none named
    # a parent whose children are finite: its own parameters (none) are checked, not its children's
    parent = locate_forward(_net(Block()), {"input": torch.ones(1, 4)})
    assert parent.own_params == [] and parent.evidence()["nonfinite_params_of_module"] == []
    # a non-finite input: the module did not make the NaN, its weights are not read
    fed = locate_forward(_net(), {"input": torch.full((1, 4), float("nan"))})
    assert fed.first is not None and fed.first.name == "0" and fed.own_params is None
    assert fed.evidence()["nonfinite_params_of_module"] is None and "holds NaN/Inf" not in fed.describe()


class Experts(nn.Module):
    """Like a Qwen3-MoE experts module: applies its own weight inline (no child module), then calls its activation."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x @ self.weight)


def test_a_nan_made_by_a_parents_own_code_names_the_parent_and_its_weight() -> None:
    """The first non-finite output is the activation's, but its input was already NaN: the experts' inline matmul made it."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Experts()), nn.Linear(4, 2))
    with torch.no_grad():
        net[1][0].weight[0, 0] = float("nan")
    found = locate_forward(net, {"input": torch.ones(2, 4)}, rank=0)
    assert found.first is not None and found.first.name == "1.0.act" and not found.first.inputs_finite
    assert found.made_in is not None and found.made_in.name == "1.0"  # not "1": the outer wrapper received the NaN from it
    assert [(p.name, p.nonfinite) for p in found.nonfinite_params] == [("1.0.weight", 1)]
    evidence = found.evidence()
    assert evidence["nonfinite_made_in"] == "1.0" and evidence["first_nonfinite_module"] == "1.0.act"
    assert "1.0 (Experts) made it with its own code before calling 1.0.act" in found.describe()
    assert "its weight holds NaN/Inf on rank 0 (1 of 16 elements)" in found.describe()


def test_a_nan_that_came_in_with_the_models_input_is_made_by_no_module() -> None:
    found = locate_forward(nn.Sequential(Experts()), {"input": torch.full((1, 4), float("nan"))})
    assert found.first is not None and found.first.name == "0.act" and found.made_in is None and found.fed_nonfinite
    assert found.own_params is None and "already non-finite when the model received it" in found.describe()
