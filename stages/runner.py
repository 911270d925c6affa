"""`harness run STAGE`: build tokenizer, model, data and the (TRL) trainer from one config, attach the harness, train.

The runner also carries out ``rollback``: when the agreed action of a step
is a rollback, training stops, the runner removes the offending rows from the
(pre-shuffled, sequentially read) training data, and resumes from the last
checkpoint before the fault, a bounded number of times.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from harness.core.config import Catalog, resolve_config
from harness.core.errors import HarnessError
from harness.lib.stops import EXIT_STOPPED
from harness.stages.config import LoadedRunConfig, arguments_class, load_run_config
from harness.stages.data import DataSource, check_fields, load_source, mix_sources, resolve_path

log = logging.getLogger("harness.stages")
TEXT_FIELDS = {"sft": (("messages",), ("prompt", "completion")), "dpo": (("prompt", "chosen", "rejected"),)}


# -- tokenizer and model --------------------------------------------------------------------------


def _local_dir(loaded: LoadedRunConfig, path: str, key: str) -> Path:
    """A model/tokenizer directory of the config; one that does not exist is an error, never a Hugging Face Hub id."""
    directory = loaded.resolve(path)
    if not directory.is_dir():
        raise HarnessError(
            f"{key} '{path}' in {loaded.path}: {directory} is not a directory. "
            f"Fix: point {key} at a local model directory (relative paths resolve against {loaded.base_dir})."
        )
    return directory


def build_tokenizer(loaded: LoadedRunConfig, texts: list[str]) -> Any:
    cfg = loaded.config
    directory = cfg.tokenizer.path or cfg.model.path
    if directory:
        from transformers import AutoTokenizer

        key = "tokenizer.path" if cfg.tokenizer.path else "model.path"
        tokenizer = AutoTokenizer.from_pretrained(_local_dir(loaded, directory, key), local_files_only=True)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    from harness.lib.tiny import train_tokenizer

    return train_tokenizer(texts, vocab_size=cfg.tokenizer.vocab_size)


def build_model(loaded: LoadedRunConfig, tokenizer: Any) -> Any:
    cfg = loaded.config
    extra: dict[str, Any] = {}
    if loaded.stage in ("pretrain", "continue"):
        from harness.stages.packing import PACKING_ATTN_IMPLEMENTATION

        extra["attn_implementation"] = PACKING_ATTN_IMPLEMENTATION  # honours the packed block-diagonal mask
    if cfg.model.path:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(_local_dir(loaded, cfg.model.path, "model.path"), local_files_only=True, **extra)
    from harness.lib.tiny import build_tiny_llama

    return build_tiny_llama(tokenizer, seed=cfg.seed, **{**cfg.model.overrides, **extra})


# -- data -----------------------------------------------------------------------------------------


def _required_fields(stage: str, source: DataSource, probe: Any) -> tuple[str, ...]:
    if stage in ("pretrain", "continue"):
        return (source.text_field,)
    options = TEXT_FIELDS[stage]
    columns = set(getattr(probe, "column_names", []) or [])
    return next((fields for fields in options if set(fields) <= columns), options[-1])


def _load_all(loaded: LoadedRunConfig, sources: list[DataSource], key: str) -> list[Any]:
    """Load every source, checking the fields the stage needs; pretraining text is renamed to ``text``."""
    out = []
    for i, source in enumerate(sources):
        where = f"{key}[{i}]"
        if loaded.stage in ("pretrain", "continue"):
            dataset = load_source(source, loaded.base_dir, required_fields=(source.text_field,), index=where)
            if source.text_field != "text":
                dataset = dataset.remove_columns([c for c in dataset.column_names if c == "text"])
                dataset = dataset.rename_column(source.text_field, "text")
            out.append(dataset.select_columns(["text"]))
            continue
        dataset = load_source(source, loaded.base_dir, required_fields=(), index=where)
        # sft/dpo accept several record shapes: check the one this file has
        check_fields(dataset, resolve_path(source, loaded.base_dir), source, where, _required_fields(loaded.stage, source, dataset))
        out.append(dataset)
    return out


def load_training_data(loaded: LoadedRunConfig) -> tuple[Any, list[str]]:
    """The mixed raw dataset (before tokenisation) and texts to train a tokenizer on if needed."""
    cfg = loaded.config
    sources = list(cfg.data.sources)
    datasets = _load_all(loaded, sources, "data.sources")
    if loaded.stage == "continue" and cfg.data.old_sources:
        new_share, old_share = cfg.data.new_to_old
        old = _load_all(loaded, list(cfg.data.old_sources), "data.old_sources")
        new_total = sum(s.weight for s in sources)
        old_total = sum(s.weight for s in cfg.data.old_sources)
        sources = [s.model_copy(update={"weight": s.weight / new_total * new_share}) for s in sources] + [
            s.model_copy(update={"weight": s.weight / old_total * old_share}) for s in cfg.data.old_sources
        ]
        datasets += old
    mixed = mix_sources(datasets, sources, total=cfg.data.total_samples, seed=cfg.seed)
    texts: list[str] = []
    for column in ("text", "prompt", "completion", "chosen", "rejected"):
        if column in mixed.column_names:
            texts += [str(t) for t in mixed[column][:2000]]
    if "messages" in mixed.column_names:
        texts += [m["content"] for row in mixed["messages"][:2000] for m in row]
    return mixed, texts


def prepare_dataset(loaded: LoadedRunConfig, mixed: Any, tokenizer: Any) -> Any:
    cfg = loaded.config
    if loaded.stage in ("pretrain", "continue"):
        from harness.stages.packing import packed_lm_dataset

        return packed_lm_dataset(mixed, tokenizer, text_field="text", seq_len=cfg.data.seq_len)
    keep = [c for fields in TEXT_FIELDS[loaded.stage] for c in fields if c in mixed.column_names]
    return mixed.select_columns(keep)


# -- trainer --------------------------------------------------------------------------------------------


def training_arguments(loaded: LoadedRunConfig) -> Any:
    cfg = loaded.config
    values: dict[str, Any] = {
        "output_dir": str(loaded.resolve(cfg.output_dir)),
        "seed": cfg.seed,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
    }
    if loaded.stage in ("pretrain", "continue"):
        values["train_sampling_strategy"] = "sequential"  # the mixture is pre-shuffled; positions stay stable for rollback
    if loaded.stage in ("sft", "dpo"):
        values["max_length"] = 256
    values.update(cfg.training)
    if cfg.deepspeed is not None:
        values["deepspeed"] = str(loaded.resolve(cfg.deepspeed)) if isinstance(cfg.deepspeed, str) else cfg.deepspeed
    return arguments_class(loaded.stage)(**values)


def build_trainer(loaded: LoadedRunConfig, model: Any, tokenizer: Any, dataset: Any) -> Any:
    args = training_arguments(loaded)
    if loaded.stage in ("pretrain", "continue"):
        from transformers import Trainer

        from harness.stages.packing import packed_data_collator, prepare_model_for_packing

        # no attention_mask and no KV cache: either would switch off the packed block-diagonal mask
        prepare_model_for_packing(model)
        return Trainer(model=model, args=args, train_dataset=dataset, data_collator=packed_data_collator, processing_class=tokenizer)
    if loaded.stage == "sft":
        from trl import SFTTrainer

        if "messages" in dataset.column_names and "assistant_only_loss" not in loaded.config.training:
            args.assistant_only_loss = bool(getattr(tokenizer, "chat_template", None) and "generation" in tokenizer.chat_template)
        return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    from trl import DPOTrainer

    reference = build_model(loaded, tokenizer)  # the same starting point, frozen
    return DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset, processing_class=tokenizer)


# -- rollback -------------------------------------------------------------------------------------------


@dataclass
class Rollback:
    """The rollback handler given to ``harness.attach(..., rollback=)``: the bridge requests, the runner restarts."""

    requested_at: int | None = None
    cause: Any = None
    performed: int = 0
    lr_scale_pending: float = 1.0
    skipped: list[tuple[int, int]] = field(default_factory=list)

    def request(self, step: int, cause: Any) -> None:
        self.requested_at, self.cause = step, cause


class _ScaleLearningRate(TrainerCallback):
    """After a rollback's resume has loaded the scheduler, scale the learning rate as policy asks."""

    def __init__(self, rollback: Rollback) -> None:
        self.rollback = rollback

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> Any:
        scale = self.rollback.lr_scale_pending
        if scale != 1.0:
            if lr_scheduler is not None and hasattr(lr_scheduler, "base_lrs"):
                lr_scheduler.base_lrs = [lr * scale for lr in lr_scheduler.base_lrs]
            for group in getattr(optimizer, "param_groups", []):
                group["lr"] *= scale
            self.rollback.lr_scale_pending = 1.0
        return control


def _last_checkpoint_before(output_dir: Path, step: int, world_size: int = 1) -> Path | None:
    """The last complete checkpoint (for the Trainer and, when it saves state, the harness) before ``step``, of the
    history the failed attempt trained (not a newer one of an earlier attempt that a resume went back from)."""
    from harness.lib.checkpoints import (
        abandoned_checkpoints, checkpoint_step, harness_missing, harness_tracked, list_checkpoints, trainer_missing,
    )

    tracked = harness_tracked(output_dir)
    gone_back = abandoned_checkpoints(output_dir)
    for path in list_checkpoints(output_dir):
        if path in gone_back or (checkpoint_step(path) or 0) >= step:
            continue
        if not trainer_missing(path) and not (tracked and harness_missing(path, world_size)):
            return path
    return None


def _rows_per_step(args: Any) -> int:
    return int(args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size))


def _train_with_rollback(loaded: LoadedRunConfig, trainer: Any, ctx: Any, resume: Any, rollback: Rollback) -> str:
    from harness.core.codes import ROLLBACK_EXHAUSTED, ROLLBACK_PERFORMED

    policy = loaded.config.rollback
    while True:
        rollback.requested_at = None
        trainer.train(resume_from_checkpoint=resume)
        if rollback.requested_at is None:
            return ctx.status
        step = rollback.requested_at
        output_dir = Path(trainer.args.output_dir)
        checkpoint = _last_checkpoint_before(output_dir, step, ctx.world_size)
        if rollback.performed >= policy.max_retries or checkpoint is None:
            why = "no checkpoint precedes the fault (set training.save_steps)" if checkpoint is None else f"{rollback.performed} rollbacks already"
            if ctx.is_main:
                ctx.report(ROLLBACK_EXHAUSTED.code, f"rollback asked at step {step} but not possible: {why}; training stops.", step=step, plugin="harness", evidence={"rollbacks": rollback.performed})
            raise HarnessError(f"harness run: rollback at step {step} not possible ({why}). Findings: {ctx.run_dir / 'findings.jsonl'}")
        skip = (rollback.cause.evidence.get("skip_rows") if rollback.cause is not None else None) or None
        per_step = _rows_per_step(trainer.args)
        start, stop = (skip if skip else ((step - 1) * per_step, step * per_step))
        dataset = trainer.train_dataset
        keep = [i for i in range(len(dataset)) if not start <= i < stop]
        trainer.train_dataset = dataset.select(keep)
        ctx.data_edit = f"the rollback left training rows [{start}, {stop}) out"  # the resume checks expect other data
        rollback.performed += 1
        rollback.skipped.append((start, stop))
        rollback.lr_scale_pending = policy.lr_scale
        if ctx.is_main:
            ctx.report(
                ROLLBACK_PERFORMED.code,
                f"rolled back from step {step} to {checkpoint.name}; skipped training rows [{start}, {stop}) "
                f"({stop - start} rows){f', learning rate x{policy.lr_scale}' if policy.lr_scale != 1 else ''} "
                f"(rollback {rollback.performed} of at most {policy.max_retries}).",
                step=step,
                plugin="harness",
                evidence={"checkpoint": str(checkpoint), "skipped_rows": [start, stop], "cause": getattr(rollback.cause, "id", None), "lr_scale": policy.lr_scale},
            )
        resume = str(checkpoint)


# -- entry point -----------------------------------------------------------------------------------------


def run_stage(stage: str, config_path: str | Path, resume: str | bool | None = None) -> int:
    """Validate everything, build, attach the harness, train (with rollback); 0 on success."""
    from harness.hf.attach import attach

    loaded = load_run_config(config_path, stage)
    if isinstance(resume, str) and not Path(resume).is_dir():  # before anything is built: not a traceback from train()
        raise HarnessError(f"harness run --resume {resume}: no such checkpoint folder. Fix: name an existing "
                           "checkpoint-<N> folder of the run, or pass --resume alone to resume from its last complete one.")
    for key, directory in (("model.path", loaded.config.model.path), ("tokenizer.path", loaded.config.tokenizer.path)):
        if directory:
            _local_dir(loaded, directory, key)  # a wrong folder said now, not after the data is read and tokenised
    harness_config = dict(loaded.config.harness)
    data = loaded.config.data
    if any(s.max_repeats > 1 for s in [*data.sources, *(data.old_sources or [])]):
        # upsampling a source (max_repeats) is repetition the config asked for: duplicates are information here
        harness_config["severity"] = {"DUPLICATE_SAMPLES": "info", **dict(harness_config.get("severity") or {})}
    card = dict(harness_config.get("run_card") or {})
    card.setdefault("data_sources", {s.path: s.weight for s in data.sources})  # the card names the mixture it trains on
    harness_config["run_card"] = card
    catalog = Catalog.build()
    resolved = resolve_config(harness_config, catalog, source=f"{loaded.path}, section 'harness'", extra_plugins=["mlflow"])
    if "run_card" not in resolved.enabled and "run_card" not in loaded.config.harness:
        del harness_config["run_card"]  # the runner's own addition: no note about a section the user never wrote
    mixed, texts = load_training_data(loaded)
    from transformers import set_seed

    set_seed(loaded.config.seed)
    tokenizer = build_tokenizer(loaded, texts)
    model = build_model(loaded, tokenizer)
    dataset = prepare_dataset(loaded, mixed, tokenizer)
    trainer = build_trainer(loaded, model, tokenizer, dataset)
    rollback = Rollback()
    trainer.add_callback(_ScaleLearningRate(rollback))
    ctx = attach(trainer, config=harness_config, plugins=["mlflow"], rollback=rollback)
    ctx.stage = stage
    if resume is True:
        from harness.lib.checkpoints import list_checkpoints

        if not list_checkpoints(Path(trainer.args.output_dir)):
            raise HarnessError(f"harness run --resume: no checkpoint in {trainer.args.output_dir}. Fix: run without --resume, or name a checkpoint.")
        # stays True: the bridge resumes from the last COMPLETE checkpoint and reports the incomplete ones it passes over
    status = _train_with_rollback(loaded, trainer, ctx, resume, rollback)
    if ctx.is_main:
        log.info("harness run %s: %s; findings in %s", stage, status, ctx.run_dir / "findings.jsonl")
    if status == "completed":
        trainer.save_model()  # the final model, loadable by a later stage (continue, sft, dpo)
    if ctx.is_main:
        _print_outcome(stage, ctx.run_dir)
    return EXIT_STOPPED if status == "stopped" else 0  # a harness stop is not a success (harness wrap says 75 too)


def _print_outcome(stage: str, run_dir: Path) -> None:
    """The run's verdict, report and next command on stderr: the last lines on screen (never fails the run)."""
    from harness.core.console import quiet_from_env
    from harness.report.record import RunRecord
    from harness.report.verdict import verdict_of

    if quiet_from_env():  # --quiet / HARNESS_QUIET=1
        return
    try:
        verdict = verdict_of(RunRecord.load(run_dir)).line()
        sys.stderr.write(f"harness run {stage}: {verdict}\n  report: {run_dir / 'report.html'}\n"
                         f"  next: harness explain {run_dir.parent}\n")
    except Exception:  # noqa: BLE001 - a summary line is never worth the run's exit status
        log.debug("harness run: no closing summary", exc_info=True)
