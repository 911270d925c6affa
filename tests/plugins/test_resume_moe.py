"""resume_check on a Qwen3-MoE: a mismatch after a resume names its true cause (issue 43 item 3).

transformers 5 saves a Qwen3-MoE's fused experts per expert
(``experts.<i>.down_proj.weight``), and its ``Trainer._load_from_checkpoint``
loads the file with ``load_state_dict(strict=False)`` by those raw names,
without the conversion ``from_pretrained`` applies: a plain
``train(resume_from_checkpoint=...)`` on a freshly built model leaves the
fused experts as built. ``RESUME_MODEL_MISMATCH`` must say that (the tensors
the Trainer's load left, and the fix), not blame a changed file. A weight
truly changed in the file keeps that cause, and the workaround (the model
built with ``from_pretrained(<checkpoint>)`` before the resume) is clean.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import harness
from conftest import findings_of

ROWS, LENGTH = 32, 32
EXPERTS = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
           "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
CHANGED_CAUSE = "the checkpoint's model file was changed, or another model was loaded"


def _moe(tokenizer: Any) -> Any:
    from harness.lib.tiny_zoo import build_tiny_model

    return build_tiny_model("qwen3_moe", tokenizer, "causal_lm", seed=0, hidden_size=32)


def _trainer(model: Any, tokenizer: Any, out: Path) -> Any:
    """Four steps of a real Trainer saving at 2, the default plugins attached."""
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny import lm_dataset

    args = TrainingArguments(output_dir=str(out), max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to="none", logging_steps=1, use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(tokenizer, seq_len=LENGTH, n_rows=ROWS))
    harness.attach(trainer, config={"plugins": ["defaults"]})
    return trainer


@pytest.fixture(scope="module")
def interrupted(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MoE run that saved checkpoint-2 and went on to step 4 (shared, read only: each test resumes a copy)."""
    out = tmp_path_factory.mktemp("moe") / "out"
    _trainer(_moe(tokenizer), tokenizer, out).train()
    return out


def _copy(interrupted: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(interrupted, out)
    return out


def _resumed(model: Any, tokenizer: Any, out: Path) -> Any:
    trainer = _trainer(model, tokenizer, out)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    return trainer


def _new_findings(out: Path, before: int) -> list[dict[str, Any]]:
    return findings_of(out)[before:]


def test_a_plain_resume_of_a_moe_names_the_trainers_raw_name_load(tokenizer: Any, interrupted: Path, tmp_path: Path) -> None:
    out = _copy(interrupted, tmp_path)
    before = len(findings_of(out))
    trainer = _resumed(_moe(tokenizer), tokenizer, out)
    (finding,) = [f for f in _new_findings(out, before) if f["code"] == "RESUME_MODEL_MISMATCH"]
    message = finding["message"]
    assert finding["action"] == "stop" and trainer.state.global_step == 3, finding
    assert CHANGED_CAUSE not in message, message
    assert "4 of 25 weight tensors differ from those saved at step 2" in message, message
    assert "(first: model.layers.0.mlp.experts.gate_up_proj, model.layers.0.mlp.experts.down_proj, " in message, message
    assert "): all 4 kept the values they had before the resume: " in message, message
    assert ("the Trainer's own resume loads checkpoint-2's tensors by their saved names (load_state_dict, strict=False), without "
            "the key conversion from_pretrained applies (transformers 5 saves MoE experts per expert)") in message, message
    assert "model.safetensors holds these under other names only" in message, message
    assert ("Fix: build the model with from_pretrained(<the checkpoint-2 folder>) before train(resume_from_checkpoint=...), "
            "or use a transformers whose Trainer converts the keys on resume.") in message, message
    evidence = finding["evidence"]
    assert sorted(evidence["not_loaded"]) == sorted(EXPERTS) and evidence["not_loaded_count"] == 4, evidence
    assert evidence["cause"] == "raw_name_resume" and evidence["count"] == 4 and evidence["weights_file"] == "model.safetensors"


def test_a_moe_weight_changed_in_the_file_keeps_the_changed_file_cause(tokenizer: Any, interrupted: Path, tmp_path: Path) -> None:
    """The workaround's load, but one attention weight of the file changed: a real mismatch, told as before."""
    from transformers import AutoModelForCausalLM

    out = _copy(interrupted, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    path = out / "checkpoint-2" / "model.safetensors"
    weights = load_file(str(path))
    weights[name] = weights[name] * 1.5
    save_file(weights, str(path), metadata={"format": "pt"})
    before = len(findings_of(out))
    _resumed(AutoModelForCausalLM.from_pretrained(str(out / "checkpoint-2"), dtype=torch.float32), tokenizer, out)
    (finding,) = [f for f in _new_findings(out, before) if f["code"] == "RESUME_MODEL_MISMATCH"]
    assert finding["evidence"]["tensors"] == [name], finding
    assert CHANGED_CAUSE in finding["message"] and "from_pretrained" not in finding["message"], finding
    assert "cause" not in finding["evidence"], finding


def test_the_workaround_from_pretrained_then_resume_is_clean(tokenizer: Any, interrupted: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = _copy(interrupted, tmp_path)
    before = len(findings_of(out))
    trainer = _resumed(AutoModelForCausalLM.from_pretrained(str(out / "checkpoint-2"), dtype=torch.float32), tokenizer, out)
    loud = [f for f in _new_findings(out, before) if f["severity"] in ("warning", "error", "critical")]
    assert loud == [] and trainer.state.global_step == 4, loud
