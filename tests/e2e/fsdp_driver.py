"""A plain FSDP2 training loop shaped like ``Trainer._inner_training_loop``, with the harness attached as to a Trainer.

Run under ``torchrun --nproc_per_node 2`` on CPU (gloo). accelerate refuses
FSDP on CPU, so this loop stands in for the Trainer: ``harness.attach`` wraps
it exactly as it wraps a ``transformers.Trainer`` (``training_step``,
``compute_loss``, ``_get_grad_norm``, the optimizer's ``step``, ``train``,
the callback's events), and the plugins see what they would see under
``accelerate``'s FSDP2: a tiny Llama whose decoder layers and root are
``fully_shard``-ed (DTensor parameters, gradients and Adam moments), a plain
torch optimizer, checkpoints written with ``torch.distributed.checkpoint``.

Faults (each on one rank, at one step) are the ones the tests look for: one
ulp added to one weight's local shard, one gradient shard scaled by 1.5 after
the reduction, a NaN loss, a weight shard changed after a checkpoint was
loaded. Every rank appends one line per step to ``driver.rank-<r>.jsonl``:
whether that step's update changed this rank's parameter and optimizer shards.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM, TrainerControl, TrainerState, get_linear_schedule_with_warmup

import harness
from harness.lib.fingerprints import optimizer_tensors, param_tensors, tensor_sums
from harness.lib.sharding import local_tensor, replicated_local
from harness.lib.tiny import tiny_llama_config

VOCAB, SEQ, BATCH = 128, 16, 2
PERTURBED = "model.layers.0.self_attn.o_proj.weight"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--config", required=True, help="harness config (YAML or JSON file)")
    p.add_argument("--mesh", choices=["shard", "hsdp"], default="shard", help="shard: 1-D mesh (FSDP); hsdp: 2 replicas x 1 shard")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None, help="a checkpoint folder written by this driver")
    p.add_argument("--fault_rank", type=int, default=1)
    p.add_argument("--perturb_step", type=int, default=0, help="one ulp into one weight shard before this step's forward")
    p.add_argument("--scale_grad_step", type=int, default=0, help="one reduced gradient shard times 1.5 before the guard")
    p.add_argument("--nan_step", type=int, default=0, help="a NaN loss in this step's first micro-batch")
    p.add_argument("--perturb_after_load", action="store_true", help="change one weight shard element after loading --resume")
    return p.parse_args()


class Args:
    """The TrainingArguments fields the bridge and plugins read."""

    def __init__(self, out: str, steps: int, grad_accum: int, save_steps: int) -> None:
        self.output_dir = out
        self.process_index, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_process_index = int(os.environ.get("LOCAL_RANK", 0))
        self.max_steps, self.gradient_accumulation_steps, self.save_steps = steps, grad_accum, save_steps
        self.per_device_train_batch_size, self.learning_rate, self.max_grad_norm = BATCH, 1e-3, 1.0
        self.num_train_epochs, self.seed, self.weight_decay, self.warmup_steps = 1.0, 0, 0.0, 0
        self.lr_scheduler_type, self.optim, self.lr_scheduler_kwargs = "linear", "adamw_torch", {}
        self.logging_nan_inf_filter = self.fp16 = self.bf16 = False
        self.device = torch.device("cpu")
        self.parallelism_config = None

    def get_warmup_steps(self, num_training_steps: int) -> int:
        return self.warmup_steps


def build_model(mesh_kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(VOCAB, hidden_size=32, num_layers=2))
    shape, names = ((2,), ("shard",)) if mesh_kind == "shard" else ((2, 1), ("replicate", "shard"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch_for(step: int, micro: int) -> dict[str, torch.Tensor]:
    """Rows that depend on the step, micro-batch and rank only (the same after a resume)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def one_ulp(tensor: torch.Tensor) -> None:
    flat = local_tensor(tensor).data.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))


class LoopTrainer:
    """The parts of ``transformers.Trainer`` that ``harness.attach`` wraps and reads, around an FSDP2 model."""

    is_fsdp_enabled = True
    is_deepspeed_enabled = False
    train_dataset = eval_dataset = None
    model_accepts_loss_kwargs = False

    def __init__(self, options: argparse.Namespace) -> None:
        self.o = options
        self.args = Args(options.out, options.steps, options.grad_accum, options.save_steps)
        self.model = self.model_wrapped = build_model(options.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.args.learning_rate)
        self.lr_scheduler = get_linear_schedule_with_warmup(self.optimizer, 0, options.steps)  # the Trainer's "linear"
        self.state, self.control = TrainerState(max_steps=options.steps), TrainerControl()
        self.callbacks: list[Any] = []
        self.rank = dist.get_rank()
        self.journal = Path(options.out) / f"driver.rank-{self.rank}.jsonl"

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def _event(self, name: str) -> None:
        for callback in self.callbacks:
            result = getattr(callback, name)(self.args, self.state, self.control)
            self.control = result if result is not None else self.control

    # -- the methods the bridge wraps -------------------------------------------------------------

    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        loss = model(**inputs).loss
        if self.o.nan_step and self.state.global_step + 1 == self.o.nan_step and self.rank == self.o.fault_rank and self._micro == 0:
            loss = loss * float("nan")
        return loss

    def training_step(self, model: Any, inputs: dict[str, torch.Tensor], num_items_in_batch: Any = None) -> torch.Tensor:
        loss = self.compute_loss(model, inputs) / self.args.gradient_accumulation_steps
        loss.backward()
        return loss.detach()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # Under FSDP2, HF's norm (accelerate's clip_grad_norm_) is a Replicate DTensor, which the guard's one read cannot
        # pack: the bridge's tap must keep ``replicated_local(norm)`` (reported to the lead, issue 18 item 8); done here.
        return replicated_local(grad_norm)

    # -- the loop -----------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | None = None) -> None:
        if resume_from_checkpoint:
            self._load(Path(resume_from_checkpoint))
        self._event("on_train_begin")
        while self.state.global_step < self.state.max_steps and not self.control.should_training_stop:
            self._step()
            if self.control.should_save or (self.args.save_steps and self.state.global_step % self.args.save_steps == 0):
                self._save()
                self.control.should_save = False
        self._event("on_train_end")

    def _step(self) -> None:
        step = self.state.global_step + 1
        self._event("on_step_begin")
        if self.o.perturb_step == step and self.rank == self.o.fault_rank:
            one_ulp(dict(self.model.named_parameters())[PERTURBED])
        before = self._fingerprints()
        for micro in range(self.args.gradient_accumulation_steps):
            self._micro = micro
            last = micro == self.args.gradient_accumulation_steps - 1
            self.model.set_requires_gradient_sync(last)  # accelerate's no_sync for FSDP2: reduce once per step
            self.training_step(self.model, batch_for(step, micro))
        if self.o.scale_grad_step == step and self.rank == self.o.fault_rank:
            local_tensor(dict(self.model.named_parameters())[PERTURBED].grad).mul_(1.5)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        self._get_grad_norm(self.model, grad_norm=norm)
        self.optimizer.step()  # guarded by the harness: a skip leaves weights and moments alone
        skipped = bool(getattr(self.optimizer, "_is_overflow", False))
        if not skipped:
            self.lr_scheduler.step()
        self.model.zero_grad(set_to_none=True)
        self.state.global_step = step
        self.state.epoch = step / self.state.max_steps
        after = self._fingerprints()
        with self.journal.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "skipped": skipped, "params_changed": before[0] != after[0],
                                     "optimizer_changed": before[1] != after[1], "lr": self.lr_scheduler.get_last_lr()[0]}) + "\n")
        self._event("on_step_end")

    def _fingerprints(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return tensor_sums(param_tensors(self.model, clone=False)), tensor_sums(optimizer_tensors(self.optimizer, clone=False))

    # -- checkpoints: what accelerate's FSDP2 SHARDED_STATE_DICT save does, in small -------------------

    def _save(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / "fsdp"))
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
        torch.save(rng, folder / f"rng_state_{self.rank}.pth")
        if self.rank == 0:
            torch.save(self.lr_scheduler.state_dict(), folder / "scheduler.pt")
            self.state.save_to_json(str(folder / "trainer_state.json"))
        dist.barrier()
        self._event("on_save")

    def _load(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        target = {"model": model_state, "optimizer": optim_state}
        dcp.load(target, checkpoint_id=str(folder / "fsdp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
        self.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
        saved = TrainerState.load_from_json(str(folder / "trainer_state.json"))
        self.state.global_step, self.state.epoch = saved.global_step, saved.epoch
        rng = torch.load(folder / f"rng_state_{self.rank}.pth", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["cpu"])
        if self.o.perturb_after_load and self.rank == self.o.fault_rank:
            one_ulp(dict(self.model.named_parameters())[PERTURBED])


def main() -> None:
    options = parse()
    dist.init_process_group("gloo")
    Path(options.out).mkdir(parents=True, exist_ok=True)
    trainer = LoopTrainer(options)
    harness.attach(trainer, config=options.config)
    trainer.train(resume_from_checkpoint=options.resume)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
