"""The micro-batch tap: the Trainer methods the harness wraps to see what callbacks never see.

Wrapped on the trainer instance only:

- ``training_step``: ``inspect_batch`` before every micro-batch (the batch is
  also kept in ``ctx.recent_batches``); times forward and backward;
- ``compute_loss``: ``on_loss`` with the micro-batch loss, before backward
  (under DeepSpeed the engine steps inside backward, so after is too late);
- ``_get_grad_norm``: keeps the Trainer's clipped-gradient norm for the guard;
- ``get_batch_samples``: times the data loader (the Trainer fetches a step's
  micro-batches there, before the step begins);
- ``get_train_dataloader``: records the dataset index of every row from the
  loader's batch sampler (:mod:`harness.hf.dataset_index`); ``on_loss`` gets
  them in the batch it sees under ``DATASET_INDEX_KEY``, the Trainer's own
  inputs are left as they are.

Nothing here reads a device value: losses and norms stay tensors in the
:class:`~harness.hf.step_record.StepRecord` until the guard's one read.
"""
from __future__ import annotations

import functools
import time
from collections import UserDict
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from harness.core.context import RunContext
from harness.hf.dataset_index import DatasetIndexFeed, batch_rows
from harness.hf.loss_probe import LossProbe
from harness.hf.step_record import StepRecord
from harness.lib.sample_rows import DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY
from harness.lib.sharding import replicated_local
from harness.lib.tokens import token_positions
from harness.lib.world_scaling import label_count, loss_source, own_mean_loss, world_loss_scale


class MicroBatchTap:
    """Feeds every micro-batch and its loss to the plugins, and fills the current step's record."""

    def __init__(self, ctx: RunContext, trainer: Any, record: Callable[[], StepRecord]) -> None:
        self.ctx = ctx
        self.trainer = trainer
        self._record = record  # the record of the step in flight (replaced at every step begin)
        self.in_training_step = False
        self._next_data_time = 0.0  # fetched before step_begin, so it belongs to the step about to begin
        self.indices = DatasetIndexFeed(trainer)
        self._batch_indices: list[int] | None = None  # of the micro-batch in training_step now
        self._items_scale: tuple[int, bool] | None = None  # (the Trainer's loss scale across ranks, labels shifted), once known
        self._probed = False  # this train() call's micro-batch whose own mean tells the head's normalisation was taken
        self._probe: LossProbe | None = None  # that micro-batch, until the guard judged it
        self._own_mean = False  # the scaled loss is the micro-batch's own mean (the head ignores num_items_in_batch)

    def install(self, trainer: Any) -> None:
        trainer.training_step = self._wrap_training_step(trainer.training_step)
        trainer.compute_loss = self._wrap_compute_loss(trainer.compute_loss)
        if hasattr(trainer, "_get_grad_norm"):
            trainer._get_grad_norm = self._wrap_grad_norm(trainer._get_grad_norm)
        if hasattr(trainer, "get_batch_samples"):
            trainer.get_batch_samples = self._wrap_get_batch_samples(trainer.get_batch_samples)
        if hasattr(trainer, "get_train_dataloader"):
            trainer.get_train_dataloader = self._wrap_get_train_dataloader(trainer.get_train_dataloader)

    # -- data-loader time, carried into the next step's record -----------------------------------

    def add_data_time(self, seconds: float) -> None:
        self._next_data_time += seconds

    def take_data_time(self) -> float:
        """The data-loader wait measured since the last call: the data time of the step now beginning."""
        seconds, self._next_data_time = self._next_data_time, 0.0
        return seconds

    # -- the patches -------------------------------------------------------------------------------

    def _wrap_training_step(self, training_step: Callable[..., Any]) -> Callable[..., Any]:
        ctx, hooks = self.ctx, self.ctx.manager.hooks

        @functools.wraps(training_step)
        def harness_training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            ctx.step = self.trainer.state.global_step + 1
            if ctx.recent_batches.maxlen:
                ctx.recent_batches.append((ctx.step, ctx.micro_step, inputs))
            self._batch_indices = self.indices.take(batch_rows(inputs))  # one list per micro-batch, in the loader's order
            # a BatchEncoding (the HF padding collators) is a UserDict: its ``get`` of an absent key raises and catches a
            # KeyError, and plugins ask for many optional keys per micro-batch; they read the plain dict under it
            hooks.inspect_batch(ctx, inputs.data if isinstance(inputs, UserDict) else inputs, ctx.step, ctx.micro_step)
            record = self._record()
            record.tokens += token_positions(inputs)
            self.in_training_step = True
            started = time.perf_counter()
            try:
                loss = training_step(model, inputs, *args, **kwargs)
                record.add_micro_batch_loss(loss)
                return loss
            finally:
                record.model_time += time.perf_counter() - started
                self.in_training_step = False
                ctx.micro_step += 1

        return harness_training_step

    def _wrap_compute_loss(self, compute_loss: Callable[..., Any]) -> Callable[..., Any]:
        ctx, hooks = self.ctx, self.ctx.manager.hooks

        @functools.wraps(compute_loss)
        def harness_compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen = dict(inputs) if isinstance(inputs, Mapping) else inputs  # compute_loss may pop "labels"
            num_items = kwargs.get("num_items_in_batch")
            probe: LossProbe | None = None
            if isinstance(seen, dict) and self.in_training_step:
                if self._batch_indices is not None:
                    seen[DATASET_INDEX_KEY] = self._batch_indices
                elif self.indices.note:
                    seen[DATASET_INDEX_NOTE_KEY] = self.indices.note
                if num_items is not None:  # a reference, not read: the rerun plugin normalises alike
                    seen[NUM_ITEMS_KEY] = num_items
                    scale, shifts = self._items_scale if self._items_scale is not None else self._learn_items_scale()
                    if scale > 1:  # several ranks averaging tokens: what undoes the Trainer's scaling for this rank
                        probe = self._share_of_rank(seen, num_items, scale, shifts)
            result = compute_loss(model, inputs, *args, **kwargs)
            if self.in_training_step:
                loss = (result[0] if isinstance(result, tuple) else result).detach()
                if loss.dim() > 0:
                    loss = loss.mean()  # DataParallel over several GPUs: one loss per replica, as the Trainer averages
                if probe is not None:
                    probe.loss = loss
                    self._record().probe = probe
                ga_steps = self._ga_steps()  # one micro-batch per step: the part is the loss itself (x / 1 == x), no tensor op
                part = loss if ga_steps == 1 or self._loss_scaled_for_ga(num_items) else loss / ga_steps
                self._record().add_step_loss_part(part, loss)
                ctx.step_batches.append((ctx.micro_step, seen))
                hooks.on_loss(ctx, loss, seen, ctx.step, ctx.micro_step)
            return result

        return harness_compute_loss

    def begin_train(self) -> None:
        """A train() call begins: its first micro-batch asks the head's normalisation again (the model may be another)."""
        self._probed = False

    def _share_of_rank(self, seen: dict[str, Any], num_items: Any, scale: int, shifts: bool) -> LossProbe | None:
        """Record what turns this micro-batch's scaled loss back into this rank's own mean; the train() call's first
        micro-batch also recomputes its own mean (a :class:`LossProbe`, judged at the guard) and is returned."""
        probe = None
        if not self._probed:
            self._probed = True
            mean = own_mean_loss(self.trainer, seen)
            count = local_label_count(seen, shifts)
            if mean is not None and count is not None:
                probe = self._probe = LossProbe(mean, count, num_items, scale, loss_source(self.trainer))
        elif self._probe is not None and self._probe.judged is not None:  # the guard judged it: its verdict holds from now
            if self._probe.judged.own_mean is not None:
                self._own_mean = self._probe.judged.own_mean
            self._probe = None
        record = self._record()
        if self._own_mean:  # the head ignores num_items_in_batch: its loss over the scale is this rank's own mean
            record.add_own_mean_share(scale)
        if not self._own_mean or self._probe is not None:  # while a probe awaits its verdict, counted for either answer
            count = probe.local_items if probe is not None else local_label_count(seen, shifts)
            if count is not None:
                record.add_local_items(count, num_items, scale)
        return probe

    def _loss_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        """Whether the Trainer treats this loss as already normalised over the whole step (its own rule)."""
        trainer = self.trainer
        fixed = getattr(trainer, "loss_is_scaled_for_ga", None)
        if fixed is not None:
            return bool(fixed)
        accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        return (accepts and num_items_in_batch is not None) or getattr(trainer, "compute_loss_func", None) is not None

    def _learn_items_scale(self) -> tuple[int, bool]:
        """What the Trainer multiplies each rank's loss by when it averages tokens across devices (1: it does not), and
        whether it counts labels shifted by one; read once (the arguments do not change within the trainer's life).

        With ``average_tokens_across_devices`` and a loss normalised by
        ``num_items_in_batch`` (every rank's label count), transformers
        multiplies the loss by the number of processes (over the tensor-
        parallel size), so that the mean over ranks is the true loss; one
        rank's value alone is then its label sum over the global count times
        that factor, which swings with the ranks' share of labels.
        """
        trainer = self.trainer
        self._items_scale = (world_loss_scale(trainer), bool(getattr(trainer, "_loss_shifts_labels", False)))
        return self._items_scale

    def _ga_steps(self) -> int:
        trainer = self.trainer
        return int(getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps or 1)

    def _wrap_get_batch_samples(self, get_batch_samples: Callable[..., Any]) -> Callable[..., Any]:
        """Time the data loader: the Trainer fetches a step's micro-batches here, before the step begins."""

        @functools.wraps(get_batch_samples)
        def harness_get_batch_samples(epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
            return get_batch_samples(_TimedIterator(epoch_iterator, self.add_data_time), *args, **kwargs)

        return harness_get_batch_samples

    def _wrap_get_train_dataloader(self, get_train_dataloader: Callable[..., Any]) -> Callable[..., Any]:
        """Instrument the loader the Trainer trains from, so that each micro-batch's dataset indices are known."""

        @functools.wraps(get_train_dataloader)
        def harness_get_train_dataloader(*args: Any, **kwargs: Any) -> Any:
            return self.indices.instrument(get_train_dataloader(*args, **kwargs))

        return harness_get_train_dataloader

    def _wrap_grad_norm(self, get_grad_norm: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(get_grad_norm)
        def harness_get_grad_norm(*args: Any, **kwargs: Any) -> Any:
            norm = get_grad_norm(*args, **kwargs)
            self._record().grad_norm = replicated_local(norm)  # FSDP2: a replicated DTensor, read as its local tensor
            return norm

        return harness_get_grad_norm


local_label_count = label_count  # this rank's labels in one micro-batch, counted as the Trainer counts num_items_in_batch


class _TimedIterator:
    """Wraps the Trainer's epoch iterator to add the time spent in ``next()`` (waiting for data) to the tap."""

    def __init__(self, inner: Any, add_time: Callable[[float], None]) -> None:
        self._inner = inner
        self._add_time = add_time

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            return next(self._inner)
        finally:
            self._add_time(time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
