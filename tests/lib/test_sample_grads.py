"""Per-sample gradient norms: vmap and the loop agree, match a plain backward, leave p.grad, the RNG and the modes alone, and run no collective under DDP."""
from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, torchrun
from harness.lib.capture import lm_inputs
from harness.lib.sample_grads import blame_rows, row_loss, vmap_bytes
from harness.lib.tiny import tiny_llama_config

VOCAB = 64
PROBE = Path(__file__).with_name("ddp_blame_probe.py")


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny_llama_config(VOCAB, hidden_size=32, num_layers=2, num_heads=2))
    return m.train()


def _batch(rows: int = 4, seq: int = 16, pad_row: int | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[1, :6] = -100  # a row with fewer labelled tokens
    mask = torch.ones_like(ids)
    if pad_row is not None:
        mask[pad_row, -4:] = 0
        labels[pad_row, -4:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "harness_dataset_index": [0, 1, 2, 3][:rows]}


def _backward_norms(model: Any, batch: dict[str, Any]) -> list[float]:
    """The reference: a plain .backward() per row on a copy of the model."""
    twin = copy.deepcopy(model)
    inputs, labels = lm_inputs(batch)  # type: ignore[misc]
    out = []
    for r in range(labels.shape[0]):
        twin.zero_grad(set_to_none=True)
        row = {k: v[r : r + 1] for k, v in inputs.items()}
        row_loss(twin(**row).logits[0], labels[r]).backward()
        out.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters() if p.grad is not None]))))
    return out


def test_vmap_and_loop_agree_with_a_plain_backward(model: Any) -> None:
    batch = _batch()
    vmapped = blame_rows(model, [lm_inputs(batch)], method="vmap")
    looped = blame_rows(model, [lm_inputs(batch)], method="loop")
    assert (vmapped.method, looped.method) == ("vmap", "loop") and vmapped.vmap_error is None
    assert torch.allclose(vmapped.norms[0], looped.norms[0], atol=1e-4, rtol=1e-4)  # type: ignore[arg-type]
    assert looped.norms[0].tolist() == pytest.approx(_backward_norms(model, batch), rel=1e-4)  # type: ignore[union-attr]
    auto = blame_rows(model, [lm_inputs(batch)])
    assert auto.method == "vmap" and auto.why is None and auto.seconds > 0


def test_p_grad_rng_and_modes_are_left_as_they_were(model: Any) -> None:
    params = list(model.parameters())
    for i, p in enumerate(params):  # the step's gradients, waiting for the update (one left unset)
        p.grad = None if i == 0 else torch.full_like(p, 0.5)
    model.model.layers[1].eval()  # a part kept in eval on purpose stays in eval
    torch.manual_seed(123)
    before = torch.get_rng_state()
    try:
        for method in ("vmap", "loop", "auto"):
            blame = blame_rows(model, [lm_inputs(_batch())], rng={"cpu": torch.Generator().manual_seed(7).get_state()}, method=method)
            assert blame.method == method if method != "auto" else blame.method == "vmap"
        assert torch.equal(torch.get_rng_state(), before)
        assert params[0].grad is None and all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in params[1:])
        assert model.training and model.model.layers[0].training and not model.model.layers[1].training
    finally:
        model.train()
        for p in params:
            p.grad = None


def test_padding_falls_back_to_the_loop_with_the_same_numbers(model: Any) -> None:
    batch = _batch(pad_row=2)
    auto = blame_rows(model, [lm_inputs(batch), None])  # a micro-batch that is no causal-LM batch has no norms
    assert auto.method == "loop" and "vmap" in (auto.vmap_error or "") and auto.norms[1] is None
    assert auto.norms[0].tolist() == pytest.approx(_backward_norms(model, batch), rel=1e-4)  # type: ignore[union-attr]


def test_over_the_memory_cap_the_loop_runs_and_says_why(model: Any) -> None:
    assert vmap_bytes(model, 4) == 4 * sum(p.numel() * 4 for p in model.parameters())
    blame = blame_rows(model, [lm_inputs(_batch())], max_bytes=vmap_bytes(model, 4) - 1)
    assert blame.method == "loop" and "cap" in (blame.why or "")
    record = blame.record()
    assert set(record) == {"method", "why", "seconds", "vmap_error", "cost"} and "one backward per captured row" in record["cost"]


def test_a_frozen_model_or_a_failing_forward_is_unavailable_not_an_error(model: Any) -> None:
    frozen = copy.deepcopy(model).requires_grad_(False)
    assert blame_rows(frozen, [lm_inputs(_batch())]).method == "unavailable"
    odd = {"input_ids": torch.full((2, 8), VOCAB + 5), "labels": torch.zeros(2, 8, dtype=torch.long)}  # ids out of range
    blame = blame_rows(model, [lm_inputs(odd)])
    assert blame.method == "unavailable" and blame.norms == [None] and "IndexError" in (blame.why or "")


def test_a_row_without_labels_gets_a_nan_norm(model: Any) -> None:
    batch = _batch()
    batch["labels"][3, :] = -100  # nothing labelled: 0/0 loss, NaN gradient (the capture writes None for it)
    norms = blame_rows(model, [lm_inputs(batch)]).norms[0]
    assert norms is not None and torch.isnan(norms[3]) and torch.isfinite(norms[:3]).all()


@pytest.mark.slow  # two processes
def test_blame_on_one_ddp_rank_runs_no_collective(tmp_path: Path) -> None:
    result = subprocess.run([*torchrun(), str(PROBE), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert lines == [{"rank": 0, "methods": ["vmap", "loop"], "untouched": True, "ranks_agree": True},
                     {"rank": 1, "methods": [], "untouched": True, "ranks_agree": True}]
