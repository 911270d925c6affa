"""raw_resume: which weights transformers' Trainer resume leaves unset, told from the checkpoint's safetensors headers.

No training: a tiny Qwen3-MoE written by ``save_pretrained`` (its experts per
expert, as the Trainer's save writes them) or by its own names, and a real
``Trainer`` holding the model the resume would load into.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.lib.raw_resume import RAW_LOAD, fix, header_shapes, raw_load_gap, resumes_by_saved_names

EXPERTS = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
CHANGED = "the checkpoint's model file was changed, or another model was loaded."


@pytest.fixture(scope="module")
def moe(tokenizer: Any) -> Any:
    from harness.lib.tiny_zoo import build_tiny_model

    return build_tiny_model("qwen3_moe", tokenizer, "causal_lm", seed=0, hidden_size=32)


def _trainer(model: Any, tmp_path: Path, trainer_class: Any = None) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, disable_tqdm=True)
    return (trainer_class or Trainer)(model=model, args=args)


def _saved(model: Any, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(folder), **kwargs)
    return folder


def test_a_saved_format_file_leaves_the_fused_experts_unset_and_the_cause_names_them_and_the_fix(moe: Any, tmp_path: Path) -> None:
    folder = _saved(moe, tmp_path / "checkpoint-2")
    shapes = header_shapes(folder)
    assert shapes is not None and shapes["model.layers.0.mlp.experts.3.down_proj.weight"] == (32, 32)
    gap = raw_load_gap(folder, _trainer(moe, tmp_path), [*EXPERTS, "model.norm.weight"])
    assert gap is not None and gap.not_loaded == EXPERTS and gap.file == "model.safetensors"
    cause = gap.cause("checkpoint-2", [*EXPERTS, "model.norm.weight"], CHANGED)
    assert cause.startswith("2 of them (e.g. model.layers.0.mlp.experts.gate_up_proj, model.layers.0.mlp.experts.down_proj) kept "
                            "the values they had before the resume: the Trainer's own resume loads checkpoint-2's tensors " + RAW_LOAD)
    assert f"Fix: {fix('checkpoint-2')}." in cause
    assert cause.endswith("1 more tensor(s) differ though model.safetensors holds them by name (first: model.norm.weight): " + CHANGED)
    assert gap.evidence() == {"cause": "raw_name_resume", "not_loaded": EXPERTS, "not_loaded_count": 2, "weights_file": "model.safetensors"}


def test_sharded_weights_are_read_from_every_shards_header(moe: Any, tmp_path: Path) -> None:
    folder = _saved(moe, tmp_path / "checkpoint-2", max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    gap = raw_load_gap(folder, _trainer(moe, tmp_path), EXPERTS)
    assert gap is not None and gap.not_loaded == EXPERTS and gap.file == "model.safetensors.index.json"


def test_no_raw_load_cause_where_the_file_holds_the_names_lacks_a_tensor_or_is_another_model(moe: Any, tokenizer: Any,
                                                                                            tmp_path: Path) -> None:
    from harness.lib.tiny import build_tiny_llama

    trainer = _trainer(moe, tmp_path)
    own = tmp_path / "own"
    own.mkdir()
    save_file({k: v.clone().contiguous() for k, v in moe.state_dict().items()}, str(own / "model.safetensors"))
    assert raw_load_gap(own, trainer, EXPERTS) is None  # the model's own names: the raw load set them, the file changed

    damaged = _saved(moe, tmp_path / "damaged")
    weights = load_file(str(damaged / "model.safetensors"))
    del weights["model.layers.0.mlp.experts.1.up_proj.weight"]
    save_file(weights, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    assert raw_load_gap(damaged, trainer, EXPERTS) is None  # a tensor gone from its layout: a changed file, as before

    other = _saved(build_tiny_llama(tokenizer), tmp_path / "other")
    assert raw_load_gap(other, trainer, EXPERTS) is None  # another model's names: another model was loaded

    saved = _saved(moe, tmp_path / "saved")
    assert raw_load_gap(saved, trainer, ["model.layers.0.self_attn.q_proj.weight"]) is None  # held by name: loaded, then differs
    torch.save(moe.state_dict(), str(tmp_path / "saved" / "pytorch_model.bin"))
    (saved / "model.safetensors").unlink()
    assert header_shapes(saved) is None and raw_load_gap(saved, trainer, EXPERTS) is None  # a pickle: its names are not read


def test_only_transformers_trainers_own_loader_loads_by_raw_names(moe: Any, tmp_path: Path) -> None:
    from transformers import Trainer

    class OwnLoader(Trainer):
        def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
            pass

    folder = _saved(moe, tmp_path / "checkpoint-2")
    assert resumes_by_saved_names(_trainer(moe, tmp_path))
    own = _trainer(moe, tmp_path, OwnLoader)
    assert not resumes_by_saved_names(own) and raw_load_gap(folder, own, EXPERTS) is None
