"""The proof's rebuild runs on its own thread while training runs: it converts a checkpoint as transformers loads it, and
changes nothing another thread can see (``from_pretrained`` sets torch's default dtype and swaps ``PreTrainedModel.tie_weights``
and ``torch.linspace`` for every thread for the length of its load)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.lib.checkpoint_loss import rebuilt_loss, take_reference

WAIT_S = 120.0  # a bound on the hand-overs between the threads, never reached when the test passes


def _saved(model: Any, folder: Path) -> dict[str, Any]:
    """``model``'s tensors as transformers writes them (its saved format: a MoE's experts one by one)."""
    from safetensors.torch import load_file

    model.save_pretrained(folder)
    return load_file(str(folder / "model.safetensors"))


def _process_wide() -> dict[str, Any]:
    """What every thread shares and a load may change."""
    from transformers import PreTrainedModel

    return {"default dtype": torch.get_default_dtype(), "PreTrainedModel.tie_weights": PreTrainedModel.__dict__["tie_weights"],
            "torch.nn.init.normal_": torch.nn.init.normal_, "torch.linspace": torch.linspace}


def test_a_rebuild_on_its_thread_changes_nothing_another_thread_sees(tokenizer: Any, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof of a tiny MoE is held while its model is being built (where ``from_pretrained`` has everything patched);
    meanwhile this thread reads the process-wide state and loads a tied GPT-2 of its own (a GRPO reward model, say)."""
    from transformers import GPT2LMHeadModel

    from harness.lib.tiny_zoo import build_tiny_model

    moe = build_tiny_model("qwen3_moe", tokenizer, "causal_lm", seed=0, hidden_size=32)
    ids = torch.randint(5, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    reference = take_reference(moe, None, {"input_ids": ids, "labels": ids})
    assert reference is not None
    tensors = _saved(moe, tmp_path / "moe")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in tensors  # the saved format: converted back by the rebuild
    build_tiny_model("gpt2", tokenizer, seed=1, hidden_size=32).save_pretrained(tmp_path / "gpt2")

    dtype_set_by: list[str] = []  # the threads that set torch's default dtype (one global for the whole process)
    set_default_dtype = torch.set_default_dtype

    def recording(dtype: torch.dtype) -> None:
        dtype_set_by.append(threading.current_thread().name)
        set_default_dtype(dtype)

    monkeypatch.setattr(torch, "set_default_dtype", recording)
    before = _process_wide()
    building, go_on = threading.Event(), threading.Event()
    init = type(moe).__init__.__code__
    changed: set[str] = set()  # what differed at any function call of the rebuild

    def hold_while_building(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        changed.update(name for name, value in _process_wide().items() if value is not before[name])
        if frame.f_code is init and not building.is_set():
            building.set()
            go_on.wait(WAIT_S)

    result: dict[str, Any] = {}

    def proof() -> None:
        sys.setprofile(hold_while_building)  # this thread only
        try:
            result["loss"] = rebuilt_loss(reference, tensors)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            result["error"] = exc
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=proof, name="proof")
    thread.start()
    try:
        assert building.wait(WAIT_S), result
        during = _process_wide()
        users = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")  # a load of the user's own on this thread meanwhile
    finally:
        go_on.set()
        thread.join(WAIT_S)
    assert during == before and changed == set(), changed
    assert users.lm_head.weight is users.transformer.wte.weight  # tied (a no-op tie_weights would leave lm_head random)
    assert "error" not in result, result
    loss, missing = result["loss"]
    assert missing == [] and loss == pytest.approx(reference.loss, rel=1e-5)
    assert "proof" not in dtype_set_by and _process_wide() == before
    fresh = build_tiny_model("gpt2", tokenizer, seed=2, hidden_size=32)  # tie_weights still ties after the proof
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


@pytest.mark.parametrize("family, task", [("gpt2", "causal_lm"), ("t5", "seq2seq"), ("bert", "sequence_classification")])
def test_the_rebuilt_copy_is_the_saved_model_tied_as_transformers_ties_it(tokenizer: Any, tmp_path: Path, family: str,
                                                                          task: str) -> None:
    from harness.lib.checkpoint_rebuild import rebuild
    from harness.lib.tiny_zoo import build_tiny_model

    model = build_tiny_model(family, tokenizer, task, seed=0, hidden_size=32)
    buffers = {name: b for name, b in model.named_buffers() if name not in model.state_dict()}
    copy, missing = rebuild(type(model), model.config, _saved(model, tmp_path), buffers)
    assert missing == [] and copy is not None and not copy.training
    assert copy.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(copy.state_dict()[name], value) for name, value in model.state_dict().items())
    tied = [(a, b) for a, b in model.all_tied_weights_keys.items()]
    assert all(copy.get_parameter(a) is copy.get_parameter(b) for a, b in tied), tied


def test_a_file_lacking_a_tensor_leaves_it_unset_and_names_it(tokenizer: Any, tmp_path: Path) -> None:
    from harness.lib.checkpoint_rebuild import rebuild
    from harness.lib.tiny_zoo import build_tiny_model

    model = build_tiny_model("qwen3_moe", tokenizer, "causal_lm", seed=0, hidden_size=32)
    buffers = {name: b for name, b in model.named_buffers() if name not in model.state_dict()}
    tensors = _saved(model, tmp_path)
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]  # one expert's part of a fused tensor
    copy, missing = rebuild(type(model), model.config, tensors, buffers)
    assert copy is None and missing == ["model.layers.1.mlp.experts.gate_up_proj"], missing
