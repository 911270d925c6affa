"""Fault injection for testing the harness and plugins against real training runs.

``FaultInjector`` is an ordinary plugin (enable it with
``plugins: ["harness.testing:FaultInjector"]``) that raises, reports findings
and records exact parameter/optimizer snapshots at chosen steps and ranks, so
that tests can run unmodified scripts under ``harness wrap``, torchrun or
DeepSpeed and then read what happened from the run directory. Every option
(``FaultOptions``) is described in the README's "Fault injection" section and
listed by ``harness plugins --config-reference``; ``tests/test_docs.py`` keeps
both in step with this model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.actions import HarnessStop
from harness.core.appendfile import shared_appender
from harness.core.findings import FindingCode, Severity
from harness.core.strictjson import dumps
from harness.lib.fingerprints import optimizer_tensors, param_tensors
from harness.testing.module_faults import ModuleFaults
from harness.testing.oom_fault import OomRaiser
from harness.testing.checkpoint_fault import truncate_weights
from harness.testing.disk_fault import fill_disk, free_disk
from harness.testing.rerun_faults import NanBatch, RankNan
from harness.testing.rng_fault import reseed_sampler
from harness.testing.signal_fault import send_signal_once
from harness.testing.hang_fault import hang_train_data
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin

TEST_FAULT = FindingCode("TEST_FAULT", Severity.WARNING, "A fault injected on purpose by harness.testing.", "harness-core#test_fault")


class FaultOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    report_at_step: int | None = Field(None, description="Report a TEST_FAULT finding at this step, from the hook report_in names.")
    report_on_rank: int | None = Field(None, description="Only on this rank (default: every rank).")
    report_in: str = Field("inspect_batch", description="Hook that reports: inspect_batch (first micro-batch), on_step_end, on_log or "
                           "on_run_end (after the last step exchange: report_at_step is then the step the run ended at).")
    stop_at_step: int | None = Field(None, description="Raise harness.HarnessStop in on_loss of this step.")
    action: str = Field(
        "continue", description="Action the plugin decides for TEST_FAULT (continue, skip_step, rollback, save_and_stop, "
        "stop); the config's policy wins.",
    )
    raise_in: str | None = Field(
        None, description="Hook in which to raise RuntimeError: inspect_batch, on_loss, on_before_optimizer_step or "
        "on_step_end (an INTERNAL_PLUGIN_ERROR finding).",
    )
    raise_at_step: int | None = Field(None, description="Raise only at this step (default: every call).")
    break_methods: list[str] = Field(
        default_factory=list, description="`plugin.method` names (e.g. data_hash._read_hashes): that plugin's own helper "
        "method raises RuntimeError whenever the plugin calls it (at break_at_step, on break_on_rank), so the fault comes "
        "from inside the plugin's hooks, collectives and all. Hook methods themselves cannot be broken (bound at registration).",
    )
    break_at_step: int | None = Field(None, description="break_methods raise only at this step (default: every step).")
    break_on_rank: int | None = Field(None, description="break_methods raise only on this rank (default: every rank).")
    nonfinite_loss_at_steps: list[int] = Field(
        default_factory=list, description="Steps whose first micro-batch gets NaN input embeddings (the forward pass yields NaN)."
    )
    inf_grad_at_steps: list[int] = Field(
        default_factory=list, description="Steps whose gradients are made infinite (the loss stays finite)."
    )
    inf_grad_target: str | None = Field(
        None, description="With inf_grad_at_steps: instead of the input embedding weight's gradient (once), make infinite, in "
        "every backward of those steps, the gradient of this parameter (e.g. model.layers.1.mlp.up_proj.weight) or the one "
        "arriving at this module's output (e.g. model.layers.1.mlp: the NaN is born in backward there and flows upstream).",
    )
    overflow_module: str | None = Field(
        None, description="A module (e.g. model.layers.1.mlp) whose output is multiplied by inf in every forward pass of "
        "overflow_at_step (an activation overflow that any rerun of the step reproduces).",
    )
    overflow_at_step: int | None = Field(None, description="The step during which overflow_module overflows.")
    nan_batch_at_steps: list[int] = Field(
        default_factory=list, description="Steps whose first micro-batch gets a NaN sample in row 0 (one poison token repeated, then a tag of the step and rank, so two marks give two samples): wherever that row goes through "
        "the model again (a capture, a rerun, another rank) its embeddings are NaN (a fault in the data, reproducible).",
    )
    nan_batch_on_rank: int | None = Field(None, description="With nan_batch_on_rank_at_steps: the one rank whose batch gets the NaN sample.")
    nan_batch_on_rank_at_steps: list[int] = Field(
        default_factory=list, description="Steps at which only nan_batch_on_rank's first micro-batch gets the NaN sample of nan_batch_at_steps."
    )
    nan_forward_on_rank: int | None = Field(
        None, description="With nan_forward_at_step: the rank whose every forward pass yields NaN (default: rank 0)."
    )
    nan_forward_at_step: int | None = Field(
        None, description="The step during which every forward pass on nan_forward_on_rank yields NaN, a rerun's included (a bad device)."
    )
    corrupt_at_steps: list[int] = Field(
        default_factory=list, description="Steps whose first micro-batch gets random tokens in the rows of corrupt_rows (a loss spike); a classifier's "
        "labels of those rows become another class."
    )
    corrupt_rows: list[int] | None = Field(None, description="Rows to corrupt (default: every row).")
    lr_scale: float = Field(100.0, gt=0, description="Factor applied to the learning rate at lr_scale_at_steps / from lr_scale_from_step.")
    lr_scale_at_steps: list[int] = Field(default_factory=list, description="Steps whose update uses the LR times lr_scale.")
    lr_scale_from_step: int | None = Field(None, description="Every update from this step on uses the LR times lr_scale (divergence).")
    nan_param_at_step: int | None = Field(
        None, description="Write a NaN into the first attention output projection's weight (o_proj, GPT-2's attn.c_proj, BERT's attention.output.dense, T5's SelfAttention.o) just before this step's update (its name goes to nan_param.txt)."
    )
    nan_param_on_rank: int | None = Field(None, description="With nan_param_at_step: only this rank's weight (default: every rank).")
    hang_at_step: int | None = Field(
        None, description="Sleep 600 s (for kill -9 tests) in inspect_batch of this step, after creating hanging.rank-<r>."
    )
    kill_at_step: int | None = Field(
        None, description="SIGKILL the process in inspect_batch of this step (once per run directory: a resumed run goes on)."
    )
    fault_rank: int = Field(1, ge=0, description="Rank that perturb_param_at_step and scale_grad_at_step act on.")
    perturb_param_at_step: int | None = Field(
        None, description="After this step's update, move one element of one parameter on fault_rank by one ulp (a replica drifts)."
    )
    perturb_param: str = Field("o_proj.weight", description="Suffix of the parameter name perturb_param_at_step changes (the first match).")
    scale_grad_at_step: int | None = Field(
        None, description="On fault_rank, multiply this step's gradients by grad_scale after the all-reduce (DDP: a comm hook; "
        "DeepSpeed ZeRO-1/2: the rank's reduced partition, just before the update)."
    )
    grad_scale: float = Field(1.5, description="Factor of scale_grad_at_step.")
    sampler_seed_on_rank: int | None = Field(
        None, description="At run start, give this rank's train sampler the seed sampler_seed (the ranks then shard different "
        "shuffled orders; the global RNG is left alone).")
    sampler_seed: int = Field(1234, description="The seed sampler_seed_on_rank's train sampler gets.")
    truncate_checkpoint_at_step: int | None = Field(
        None, description="Right after the save of this step (rank 0, before the harness marks the save complete), cut the "
        "checkpoint's weights file to half its size (a truncated write).")
    fill_disk_at_step: int | None = Field(
        None, description="At the end of this step (rank 0), fill the file system under output_dir (a test's small tmpfs: one "
        "with more than 256 MB free is refused) until writes fail with ENOSPC.")
    free_disk_at_step: int | None = Field(None, description="At the end of this step (rank 0), free what fill_disk_at_step wrote.")
    fill_disk_at_run_end: bool = Field(False, description="Fill the file system under output_dir as fill_disk_at_step does, in "
                                       "the run end after every other plugin's (before the harness records how the call ended).")
    snapshot_steps: list[int] = Field(
        default_factory=list, description="Record whether params and optimizer state changed across these steps (one line per step in "
        "fault_injector.rank-<r>.jsonl)."
    )
    advance_scheduler_at_steps: list[int] = Field(
        default_factory=list,
        description="Step the Trainer's LR scheduler once more at the end of these steps when they were skipped (a training loop "
        "that advances the schedule although the update was skipped).",
    )
    oom_at_step: int | None = Field(
        None, description="Raise torch.OutOfMemoryError from the forward of the model's first decoder layer in this step's first "
        "micro-batch (an OOM inside a real forward pass).")
    signal_at_step: int | None = Field(
        None, description="Send signal_name to this process in inspect_batch of this step's first micro-batch (a preemption "
        "notice in the middle of a step; once per run directory).")
    signal_on_rank: int | None = Field(None, description="With signal_at_step: only this rank signals itself (default: every rank).")
    signal_name: str = Field("SIGTERM", description="The signal of signal_at_step (SIGTERM, SIGUSR1, ...).")
    hang_data_at_step: int | None = Field(
        None, description="The train dataset's __getitem__ blocks (on a threading.Event) when the Trainer fetches this step's "
        "batches: a stuck data source, inside the data loader's __next__.")
    hang_on_rank: int | None = Field(None, description="With hang_data_at_step: only this rank's dataset blocks (default: every rank).")
    hang_data_s: float | None = Field(None, gt=0, description="With hang_data_at_step: block this many seconds (default: forever).")


def advance_scheduler(trainer: Any) -> None:
    """One extra step of the Trainer's LR scheduler (the DeepSpeed engine's when it owns it)."""
    scheduler = trainer.lr_scheduler
    import warnings

    with warnings.catch_warnings():  # torch warns when a scheduler steps without an optimizer step: that is the fault
        warnings.simplefilter("ignore")
        scheduler.step()


class EmbeddingPoison:
    """Breaks a model's numerics on demand, through its input embeddings.

    ``arm()``: the next forward pass yields NaN (a non-finite loss).
    ``arm_gradients()``: the next backward gives the embedding weight an
    infinite gradient while the loss stays finite.
    """

    def __init__(self, model: Any) -> None:
        self.armed = False
        self.gradients_armed = False
        embeddings = model.get_input_embeddings()
        embeddings.register_forward_hook(self._forward)
        embeddings.weight.register_hook(self._backward)

    def arm(self) -> None:
        self.armed = True

    def arm_gradients(self) -> None:
        self.gradients_armed = True

    def _forward(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.armed:
            self.armed = False
            return output * float("nan")
        return None

    def _backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.gradients_armed:
            self.gradients_armed = False
            return grad * float("inf")
        return None


def corrupt_batch(batch: dict[str, Any], rows: list[int] | None, seed: int) -> list[int]:
    """Replace the tokens of ``rows`` (all rows when None) with uniform random ids, in place; labels follow.

    Random tokens after a repetitive corpus are the classic bad batch: the
    model has never seen them, so their loss is near ln(vocab) while the rest
    of the batch sits far lower. Returns the rows corrupted.
    """
    ids = batch["input_ids"]
    chosen = list(range(ids.shape[0])) if rows is None else [r for r in rows if r < ids.shape[0]]
    generator = torch.Generator().manual_seed(seed)
    high = int(ids.max()) + 1
    for r in chosen:
        noise = torch.randint(0, high, ids[r].shape, generator=generator).to(ids.device, ids.dtype)
        ids[r].copy_(noise)
        labels = batch.get("labels")
        if torch.is_tensor(labels) and labels.shape == ids.shape:
            labels[r].copy_(torch.where(labels[r] == -100, labels[r], noise))
        elif torch.is_tensor(labels) and labels.dim() == 1 and not labels.is_floating_point():  # a classifier's: a wrong class
            labels[r] = (labels[r] + 1) % max(2, int(labels.max()) + 1)
    return chosen


# the attention output projection as each family names it: Llama/Qwen/Gemma, GPT-2, BERT, T5
ATTENTION_OUTPUT_SUFFIXES = ("o_proj.weight", "attn.c_proj.weight", "attention.output.dense.weight", "SelfAttention.o.weight")


def attention_output_weight(model: Any) -> tuple[str, Any]:
    """The first attention output projection's weight of any family (else the first floating-point matrix), by name."""
    named = list(model.named_parameters())
    for suffix in ATTENTION_OUTPUT_SUFFIXES:
        found = next(((n, p) for n, p in named if n.endswith(suffix)), None)
        if found is not None:
            return found
    found = next(((n, p) for n, p in named if p.dim() == 2 and p.is_floating_point()), None)
    if found is None:
        raise ValueError(f"{type(model).__name__} has no floating-point weight matrix to poison")
    return found


def poison_parameter(model: Any) -> str:
    """Write a NaN into the first attention output projection (a weight gone bad); returns its name."""
    name, param = attention_output_weight(model)
    with torch.no_grad():
        getattr(param, "ds_tensor", param).view(-1)[0] = float("nan")
    return name


def scale_lr(optimizer: Any, factor: float) -> None:
    """Multiply every param group's LR; the scheduler writes its own value back at its next step."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor


def perturb_one_ulp(model: Any, suffix: str) -> str:
    """Move element 0 of the first parameter whose name ends with ``suffix`` up by one ulp; returns its name."""
    name, param = next((n, p) for n, p in getattr(model, "module", model).named_parameters() if n.endswith(suffix))
    with torch.no_grad():
        flat = param.data.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype, device=flat.device))
    return name


def scale_reduced_gradients(trainer: Any, step: int, factor: float) -> None:
    """Make this rank's reduced gradients of ``step`` ``factor`` times too large, after the all-reduce.

    DDP: a communication hook that runs the normal all-reduce and scales its
    result (a buggy custom comm hook). DeepSpeed ZeRO-1/2: the rank's own
    reduced partition is scaled just before the optimizer steps.
    """
    wrapped = trainer.model_wrapped
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def scaling_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects any annotation but GradBucket
            def scale(fut: Any) -> torch.Tensor:
                value = fut.value()
                tensor = value[0] if isinstance(value, list) else value
                if trainer.state.global_step + 1 == step:
                    tensor.mul_(factor)
                return tensor

            return default_hooks.allreduce_hook(None, bucket).then(scale)

        wrapped.register_comm_hook(None, scaling_hook)
        return
    optimizer = wrapped.optimizer
    original = optimizer.step

    def scaled_step(*args: Any, **kwargs: Any) -> Any:
        if trainer.state.global_step + 1 == step:
            for param in wrapped.module.parameters():
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None:
                    mapping.get_lp_grad_fragment(param._index_in_param_group).mul_(factor)
        return original(*args, **kwargs)

    optimizer.step = scaled_step


def _diff(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    changed = [k for k in before if k not in after or not torch.equal(before[k], after[k])]
    return changed + [k for k in after if k not in before]


class FaultInjector(Plugin):
    """Injects faults and records snapshots for tests (not for production runs)."""

    name = "fault_injector"
    Options = FaultOptions
    CODES = (TEST_FAULT,)

    def __init__(self) -> None:
        self.options = FaultOptions()
        self._poison: EmbeddingPoison | None = None
        self._module_faults: ModuleFaults | None = None
        self._nan_batch: NanBatch | None = None
        self._oom: OomRaiser | None = None
        self._model: Any = None
        self._optimizer: Any = None
        self._before: dict[str, dict[str, torch.Tensor]] = {}
        self.snapshots: list[dict[str, Any]] = []

    def _maybe_raise(self, hook: str, step: int) -> None:
        o = self.options
        if o.raise_in == hook and (o.raise_at_step is None or o.raise_at_step == step):
            raise RuntimeError(f"injected fault in {hook} at step {step}")

    def _maybe_report(self, ctx: Any, hook: str, step: int) -> None:
        o = self.options
        if o.report_in == hook and o.report_at_step == step and o.report_on_rank in (None, ctx.rank):
            self.report(TEST_FAULT.code, f"injected fault at step {step} on rank {ctx.rank} in {hook}", evidence={"injected": True})

    def _break_methods(self, ctx: Any) -> None:
        """Shadow each named plugin method with one that raises where and when the options say (an instance attribute)."""
        from harness.core.hookspecs import PROJECT

        o = self.options
        for target in o.break_methods:
            plugin_name, _, method = target.rpartition(".")
            plugin = ctx.manager.plugin(plugin_name)
            original = getattr(plugin, method, None) if plugin is not None else None
            if not callable(original) or hasattr(original, f"{PROJECT}_impl"):
                raise ValueError(f"fault_injector.break_methods: '{target}' is not a helper method of an enabled plugin "
                                 "(hook methods cannot be broken).")
            if o.break_on_rank not in (None, ctx.rank) or getattr(original, "_fault_broken", False):
                continue

            def broken(*args: Any, _original: Any = original, _target: str = target, **kwargs: Any) -> Any:
                if o.break_at_step is None or o.break_at_step == ctx.step:
                    raise RuntimeError(f"injected fault in {_target} at step {ctx.step} on rank {ctx.rank}")
                return _original(*args, **kwargs)

            broken._fault_broken = True  # type: ignore[attr-defined]
            setattr(plugin, method, broken)

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        o = self.options
        self._break_methods(ctx)
        if o.sampler_seed_on_rank == ctx.rank:
            ctx.path(f"sampler_seed.rank-{ctx.rank}.txt").write_text(reseed_sampler(trainer, o.sampler_seed), encoding="utf-8")
        if o.scale_grad_at_step is not None and ctx.rank == o.fault_rank:
            scale_reduced_gradients(trainer, o.scale_grad_at_step, o.grad_scale)
        if o.overflow_module or o.inf_grad_target:
            self._module_faults = ModuleFaults(trainer.model, o.overflow_module, o.inf_grad_target)
        if o.hang_data_at_step is not None and o.hang_on_rank in (None, ctx.rank):
            hang_train_data(trainer, o.hang_data_at_step, o.hang_data_s, ctx.run_dir / f"hanging-data.rank-{ctx.rank}")
        if o.oom_at_step is not None:
            self._oom = OomRaiser(trainer.model)
        if o.nan_batch_at_steps or o.nan_batch_on_rank_at_steps:
            self._nan_batch = NanBatch(trainer.model)
        if o.nan_forward_at_step is not None and ctx.rank == (o.nan_forward_on_rank or 0):
            RankNan(trainer.model, lambda: ctx.step == o.nan_forward_at_step)
        if not (o.nonfinite_loss_at_steps or o.inf_grad_at_steps):
            return
        self._poison = EmbeddingPoison(trainer.model)

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: dict[str, Any], step: int, micro_step: int) -> None:
        self._maybe_raise("inspect_batch", step)
        if micro_step == 0 and self._oom is not None and step == self.options.oom_at_step:
            self._oom.arm()
        if micro_step == 0 and self._poison is not None:
            if step in self.options.nonfinite_loss_at_steps:
                self._poison.arm()
            if step in self.options.inf_grad_at_steps:
                if not self.options.inf_grad_target:
                    self._poison.arm_gradients()
        if micro_step == 0 and self._nan_batch is not None and (
            step in self.options.nan_batch_at_steps
            or (step in self.options.nan_batch_on_rank_at_steps and ctx.rank == self.options.nan_batch_on_rank)
        ):
            self._nan_batch.mark(batch, salt=step * 64 + ctx.rank)  # a sample of its own per step and rank
        if self._module_faults is not None:
            self._module_faults.overflowing = step == self.options.overflow_at_step
            self._module_faults.inf_grads = step in self.options.inf_grad_at_steps
        if micro_step == 0:
            self._maybe_report(ctx, "inspect_batch", step)
        if micro_step == 0 and step in self.options.corrupt_at_steps:
            corrupt_batch(batch, self.options.corrupt_rows, seed=step)
        if micro_step == 0 and step == self.options.signal_at_step and self.options.signal_on_rank in (None, ctx.rank):
            send_signal_once(ctx.run_dir, ctx.rank, self.options.signal_name)
        marker = ctx.run_dir / f"killed.rank-{ctx.rank}"
        if self.options.kill_at_step == step and not marker.exists():
            import os
            import signal

            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.options.hang_at_step == step:
            import time

            (ctx.run_dir / f"hanging.rank-{ctx.rank}").touch()
            time.sleep(600)

    @hookimpl
    def on_loss(self, ctx: Any, step: int) -> None:
        self._maybe_raise("on_loss", step)
        if self.options.stop_at_step == step:
            raise HarnessStop(f"injected stop at step {step}")

    @hookimpl
    def on_log(self, ctx: Any, step: int) -> None:
        self._maybe_report(ctx, "on_log", step)

    @hookimpl
    def on_checkpoint_save(self, ctx: Any, step: int, checkpoint_dir: Any) -> None:
        if self.options.truncate_checkpoint_at_step == step and ctx.is_main:
            cut = truncate_weights(checkpoint_dir)
            ctx.path("truncated.txt").write_text(str(cut), encoding="utf-8")

    @hookimpl
    def decide_action(self, ctx: Any, finding: Any) -> str | None:
        return self.options.action if finding.code == TEST_FAULT.code else None

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, model: Any, optimizer: Any) -> None:
        self._maybe_raise("on_before_optimizer_step", step)
        self._model, self._optimizer = model, optimizer
        o = self.options
        if o.nan_param_at_step == step and o.nan_param_on_rank in (None, ctx.rank):
            (ctx.run_dir / "nan_param.txt").write_text(poison_parameter(model), encoding="utf-8")
        if step in o.lr_scale_at_steps or (o.lr_scale_from_step is not None and step >= o.lr_scale_from_step):
            scale_lr(optimizer, o.lr_scale)
        if step in self.options.snapshot_steps:
            self._before = {"params": param_tensors(model), "optimizer": optimizer_tensors(optimizer)}

    @hookimpl(trylast=True)  # after the other plugins' run ends (the ledger frees its unwritten window in its own)
    def on_run_end(self, ctx: Any) -> None:
        self._maybe_report(ctx, "on_run_end", ctx.step)
        if ctx.is_main and self.options.fill_disk_at_run_end:
            fill_disk(Path(ctx.trainer.args.output_dir))

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        self._maybe_raise("on_step_end", step)
        if ctx.is_main and step in (self.options.fill_disk_at_step, self.options.free_disk_at_step):
            out = Path(ctx.trainer.args.output_dir)
            fill_disk(out) if step == self.options.fill_disk_at_step else free_disk(out)
        self._maybe_report(ctx, "on_step_end", step)
        if step in self.options.advance_scheduler_at_steps and metrics.get("skipped"):
            advance_scheduler(ctx.trainer)
        if self.options.perturb_param_at_step == step and ctx.rank == self.options.fault_rank:
            name = perturb_one_ulp(ctx.trainer.model_wrapped, self.options.perturb_param)
            ctx.path(f"perturbed.rank-{ctx.rank}.txt").write_text(name, encoding="utf-8")
        if step not in self.options.snapshot_steps or not self._before:
            return
        after = {"params": param_tensors(self._model), "optimizer": optimizer_tensors(self._optimizer)}
        record = {
            "step": step,
            "rank": ctx.rank,
            "skipped": bool(metrics.get("skipped")),
            "params_changed": _diff(self._before["params"], after["params"]),
            "optimizer_changed": _diff(self._before["optimizer"], after["optimizer"]),
            "optimizer_tensors": len(after["optimizer"]),
            "lr": metrics.get("lr"),
        }
        self.snapshots.append(record)
        self._before = {}
        shared_appender(ctx.path(f"fault_injector.rank-{ctx.rank}.jsonl")).write(dumps(record) + "\n")
