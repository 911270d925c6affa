"""The stage-runner config: one YAML file for pretrain, continue, sft and dpo.

Sections: ``model``, ``tokenizer``, ``data``, ``training`` (passed to
``TrainingArguments`` / ``SFTConfig`` / ``DPOConfig``), ``deepspeed``,
``rollback`` and ``harness`` (the harness config). Every error names the
file, the key and the fix; ``training`` keys are checked against the
arguments class of the stage, so a typo fails before anything is built.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harness.core.config import read_yaml
from harness.core.errors import ConfigError, did_you_mean
from harness.stages.data import DataSource

Stage = Literal["pretrain", "continue", "sft", "dpo"]
STAGES: tuple[str, ...] = ("pretrain", "continue", "sft", "dpo")


class ModelSection(BaseModel):
    """Which model to train."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="A local Hugging Face model directory (required for continue, usual for sft/dpo).")
    preset: Literal["tiny-llama"] | None = Field(
        None, description="Build a model from a config instead: 'tiny-llama' (a small Llama; see `overrides`)."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Preset settings: hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings, ...",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if (self.path is None) == (self.preset is None):
            raise ValueError("set exactly one of model.path (a local model directory) or model.preset ('tiny-llama')")
        return self


class TokenizerSection(BaseModel):
    """Which tokenizer to use."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="A local tokenizer directory. Default: the model directory, else trained on the fly.")
    vocab_size: int = Field(512, ge=64, description="Vocabulary size when the tokenizer is trained on the fly from the training text.")


class DataSection(BaseModel):
    """Training data: one or more local sources mixed by weight."""

    model_config = ConfigDict(extra="forbid")

    sources: list[DataSource] = Field(min_length=1, description="Data sources (.txt, .jsonl, .parquet or a save_to_disk folder) with mixture weights.")
    old_sources: list[DataSource] = Field(
        default_factory=list, description="continue only: the original pretraining data replayed against forgetting."
    )
    new_to_old: tuple[float, float] = Field((1.0, 4.0), description="continue only: mixture ratio of new to old data (default 1:4).")
    total_samples: int | None = Field(None, ge=1, description="Samples in the mixture (default: as many as the repeat caps allow).")
    seq_len: int = Field(128, ge=8, description="pretrain/continue: packed row length in tokens.")


class RollbackSection(BaseModel):
    """What the runner does when a finding asks for a rollback."""

    model_config = ConfigDict(extra="forbid")

    max_retries: int = Field(2, ge=0, description="Rollbacks allowed per run; then the run stops with ROLLBACK_EXHAUSTED.")
    lr_scale: float = Field(1.0, gt=0, le=1, description="Multiply the learning rate by this after each rollback.")


class RunConfig(BaseModel):
    """A whole stage run."""

    model_config = ConfigDict(extra="forbid")

    stage: Stage | None = Field(None, description="The stage; the command line's stage must match when both are given.")
    output_dir: str = Field(description="Where checkpoints, the harness run directory and the MLflow store go.")
    seed: int = Field(0, description="Seed for model init, data mixing and the Trainer.")
    model: ModelSection
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    data: DataSection
    training: dict[str, Any] = Field(default_factory=dict, description="Arguments for TrainingArguments / SFTConfig / DPOConfig.")
    deepspeed: str | dict[str, Any] | None = Field(None, description="A DeepSpeed config: a JSON path or an inline mapping.")
    rollback: RollbackSection = Field(default_factory=RollbackSection)
    harness: dict[str, Any] = Field(default_factory=dict, description="The harness config (see `harness plugins --config-reference`).")


@dataclasses.dataclass
class LoadedRunConfig:
    config: RunConfig
    path: Path
    stage: str

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def resolve(self, path: str) -> Path:
        candidate = Path(path).expanduser()
        return candidate if candidate.is_absolute() else (self.base_dir / candidate).resolve()


def arguments_class(stage: str) -> type:
    if stage == "sft":
        from trl import SFTConfig

        return SFTConfig
    if stage == "dpo":
        from trl import DPOConfig

        return DPOConfig
    from transformers import TrainingArguments

    return TrainingArguments


def check_and_coerce_training(training: dict[str, Any], stage: str, source: str) -> None:
    """Unknown ``training`` keys are errors that name the key, the class and a did-you-mean; a value of a numeric or
    boolean argument that plainly is one ('1e-3', '3', 'true') becomes it in place, any other value is an error."""
    cls = arguments_class(stage)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    problems = [
        f"run config error in {source}, key 'training.{key}': not an argument of {cls.__name__} (stage '{stage}')."
        f"{did_you_mean(key, known)} Fix: rename or remove it."
        for key in training
        if key not in known
    ]
    if "output_dir" in training:
        problems.append(f"run config error in {source}, key 'training.output_dir': set the top-level 'output_dir' instead.")
    fields = {f.name: f.type for f in dataclasses.fields(cls) if f.init}
    for key, value in list(training.items()):
        kind = _scalar_kind(fields.get(key))
        if kind is None or value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
            continue
        fixed = _as_kind(value, kind)
        if fixed is None:
            hint = " (YAML reads 1e-3 as text: write 1.0e-3 or 0.001)" if isinstance(value, str) and "e" in value.lower() else ""
            problems.append(f"run config error in {source}, key 'training.{key}': expected {_KIND_WORDS[kind]}, got "
                            f"{value!r}{hint}. Fix: give {_KIND_WORDS[kind]}.")
        else:
            training[key] = fixed  # '1e-3' (YAML 1.1 text) is the number it reads as; TrainingArguments would keep a str
    if problems:
        raise ConfigError(problems)


_KIND_WORDS = {int: "a whole number", float: "a number", bool: "true or false"}


def _scalar_kind(annotation: Any) -> type | None:
    """int, float or bool when a TrainingArguments field is one of them (``float | None`` too); else None."""
    text = str(annotation).replace("typing.", "").replace("Optional[", "").replace("]", "")
    parts = {p.strip() for p in text.replace("|", ",").split(",")} - {"None", "NoneType", "<class 'NoneType'>"}
    names = {p.replace("<class '", "").replace("'>", "") for p in parts}
    if len(names) != 1:
        return None
    return {"int": int, "float": float, "bool": bool}.get(names.pop())


def _as_kind(value: str | int | float, kind: type) -> Any:
    """``value`` as ``kind`` when it plainly is one (an int is a float, '3' an int, '1e-3' a float); else None."""
    if kind is bool:
        return value if isinstance(value, bool) else {"true": True, "false": False}.get(str(value).strip().lower())
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number):
        return None
    if kind is int:
        return int(number) if number == int(number) else None
    return number if isinstance(value, str) else value


TOKENIZER_SET = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")  # the preset takes these from the tokenizer


def preset_override_keys() -> list[str]:
    """What ``model.overrides`` of the tiny-llama preset may set: the preset's own arguments and LlamaConfig's real ones."""
    import inspect

    from transformers import LlamaConfig

    from harness.lib.tiny import tiny_llama_config

    known = [p for p in inspect.signature(tiny_llama_config).parameters if p != "overrides"]
    known += [k for k in LlamaConfig().to_dict() if not k.startswith("_")]
    known += [p for p in inspect.signature(LlamaConfig.__init__).parameters if p not in ("self", "kwargs")]
    known.append("attn_implementation")  # a PretrainedConfig keyword (the runner sets it for packed pretraining)
    return sorted(set(known) - set(TOKENIZER_SET))


def check_model_overrides(model: ModelSection, source: str) -> None:
    """Every ``model.overrides`` key must be something the preset's config has: a typo fails before anything is built."""
    if not model.overrides:
        return
    if model.preset is None:
        raise ConfigError([
            f"run config error in {source}, key 'model.overrides': overrides apply only to model.preset (a model built "
            f"from a config); model.path loads '{model.path}' as saved. Fix: remove model.overrides, or use model.preset."
        ])
    known = preset_override_keys()
    problems = []
    for key in model.overrides:
        if key in TOKENIZER_SET:
            problems.append(
                f"run config error in {source}, key 'model.overrides.{key}': the {model.preset} preset takes {key} from "
                "the tokenizer, so the ids always agree. Fix: remove it (set tokenizer.vocab_size, or tokenizer.path, instead)."
            )
        elif key not in known:
            problems.append(
                f"run config error in {source}, key 'model.overrides.{key}': not a setting of the {model.preset} preset "
                f"(LlamaConfig).{did_you_mean(key, known)} Valid keys: {', '.join(known)}. Fix: rename or remove it."
            )
    if problems:
        raise ConfigError(problems)


def _explain(error: dict[str, Any], source: str) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ())) or "(top level)"
    if error.get("type") == "extra_forbidden":
        parent = error["loc"][:-1]
        allowed = _allowed_keys(parent)
        return (
            f"run config error in {source}, key '{loc}': unknown key.{did_you_mean(error['loc'][-1], allowed)} "
            f"Valid keys here: {', '.join(allowed)}. Fix: rename or remove it."
        )
    if error.get("type") == "missing":
        return f"run config error in {source}, key '{loc}': required but missing. Fix: add it."
    return f"run config error in {source}, key '{loc}': {error.get('msg')}; got {error.get('input')!r}. Fix: correct the value."


def _allowed_keys(path: tuple[Any, ...]) -> list[str]:
    model: Any = RunConfig
    for part in path:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return []
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        model = next((a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


def load_run_config(path: str | Path, stage: str) -> LoadedRunConfig:
    """Read and validate a run config for ``stage``; every problem is reported before anything is built."""
    path = Path(path).resolve()
    data = read_yaml(path)
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_explain(e, str(path)) for e in exc.errors()]) from None
    if config.stage is not None and config.stage != stage:
        raise ConfigError([f"run config error in {path}, key 'stage': the file is for '{config.stage}' but the command runs '{stage}'. Fix: run `harness run {config.stage}` or change 'stage'."])
    check_and_coerce_training(config.training, stage, str(path))
    check_model_overrides(config.model, str(path))
    if stage == "continue" and config.model.path is None:
        raise ConfigError([f"run config error in {path}, key 'model.path': continued pretraining starts from an existing model directory. Fix: set model.path."])
    return LoadedRunConfig(config=config, path=path, stage=stage)
