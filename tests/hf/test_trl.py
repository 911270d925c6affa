"""attach() works unchanged on TRL's SFTTrainer and DPOTrainer (real TRL, tiny Llama, local data)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
from conftest import FAULTS, findings_of, read_jsonl


def _rows(n: int = 24) -> list[tuple[str, str, str]]:
    from harness.lib.tiny import corpus_lines

    lines = [line for line in corpus_lines() if line.count(".") >= 2][: 2 * n]
    return [(f"Continue: {a.split('.')[0]}.", " " + a.split(".")[1].strip() + ".", " " + b.split(".")[1].strip() + ".") for a, b in zip(lines[::2], lines[1::2])]


COMMON: dict[str, Any] = dict(
    max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3, report_to="none", logging_steps=1,
    use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
)
SKIP_AT_3 = {"plugins": [FAULTS], "fault_injector": {"report_at_step": 3, "action": "skip_step", "snapshot_steps": [2, 3]}}


def _assert_step_3_skipped_bit_identically(ctx: Any) -> None:
    snaps = {r["step"]: r for r in read_jsonl(ctx.run_dir / "fault_injector.rank-0.jsonl")}
    assert snaps[3]["skipped"] and snaps[3]["params_changed"] == [] and snaps[3]["optimizer_changed"] == []
    assert snaps[2]["params_changed"] and snaps[3]["optimizer_tensors"] > 0


def test_sft_trainer(tmp_path: Path, tokenizer: Any) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from harness.lib.tiny import build_tiny_llama

    data = Dataset.from_list([{"prompt": p, "completion": c} for p, c, _ in _rows()])
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_length=48, **COMMON)
    trainer = SFTTrainer(model=build_tiny_llama(tokenizer), args=args, train_dataset=data, processing_class=tokenizer)
    ctx = harness.attach(trainer, config=SKIP_AT_3)
    trainer.train()
    assert trainer.state.global_step == 4
    _assert_step_3_skipped_bit_identically(ctx)
    assert [f["code"] for f in findings_of(args.output_dir)] == ["TEST_FAULT", "ACTION_TAKEN"]


def test_dpo_trainer(tmp_path: Path, tokenizer: Any) -> None:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from harness.lib.tiny import build_tiny_llama

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in _rows()])
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=64, **COMMON)
    model, reference = build_tiny_llama(tokenizer), build_tiny_llama(tokenizer)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer)
    ctx = harness.attach(trainer, config=SKIP_AT_3)
    trainer.train()
    assert trainer.state.global_step == 4
    _assert_step_3_skipped_bit_identically(ctx)
    assert [f["code"] for f in findings_of(args.output_dir)] == ["TEST_FAULT", "ACTION_TAKEN"]
