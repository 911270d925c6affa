"""data_hash: a ledger of every micro-batch every rank trains on, and the data faults it reveals.

Per micro-batch it hashes each row where the batch lives (a random linear
hash over the token ids, no per-token Python, no host sync) and queues the
hashes for the step guard's one device read (``defer``); the step's hashes
ride the guard's one cross-rank exchange (``ctx.share``) and are appended to
``ledger/rank-<r>.jsonl`` (at once: a shared mapping, no system call). It
checks them against the epoch's seen samples every ``CHECK_EVERY``
micro-batches, in one call. From the ledger it finds samples repeated
within an epoch (the classic broken resume: the loader restarted at the
epoch's beginning), samples the interrupted run would have trained next but
the resumed one never did, duplicate content, and data-parallel ranks that
train on the same samples. The training dataset gets a content fingerprint,
stored with each checkpoint and compared on resume, and, with several ranks,
compared across the ranks at the first step (its digest rides that step's
exchange): the sampler shards one dataset by index, so every rank must hold
the same rows in the same order.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from harness.core.actions import Action
from harness.lib.capture import sample_ids
from harness.core.findings import FindingCode, Severity, read_run_findings
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.hashing import combine_row_hashes, dataset_hashes, dataset_rows, batch_row_hashes, from_hex64, hash_token_rows, hex64, hex64_all, wrap64
from harness.lib.ledger import LedgerWriter, around_resume, continuation, iter_records, ledger_path
from harness.lib.sampler_padding import EpochPadding, epoch_padding, is_padding
from harness.lib.seentable import SeenTable, key64

DATA_REPEATED = FindingCode(
    "DATA_REPEATED", Severity.WARNING, "Samples were trained on again within the same epoch.", "data#data_repeated"
)
DATA_SKIPPED = FindingCode(
    "DATA_SKIPPED",
    Severity.WARNING,
    "After a resume, samples the interrupted run trained next were never trained by the resumed run.",
    "data#data_skipped",
)
DUPLICATE_SAMPLES = FindingCode(
    "DUPLICATE_SAMPLES", Severity.WARNING, "The same sample content appears more than once in the training data.", "data#duplicate_samples"
)
RANK_DATA_OVERLAP = FindingCode(
    "RANK_DATA_OVERLAP",
    Severity.ERROR,
    "Two data-parallel ranks trained on the same samples in the same step (the data is not sharded).",
    "data#rank_data_overlap",
)
RESUME_DATA_CHANGED = FindingCode(
    "RESUME_DATA_CHANGED",
    Severity.ERROR,
    "The training data's content fingerprint differs from the one stored with the checkpoint.",
    "data#resume_data_changed",
)
DATA_SKIPPED_UNCHECKED = FindingCode(
    "DATA_SKIPPED_UNCHECKED",
    Severity.INFO,
    "After a resume, DATA_SKIPPED was not judged: not every rank's samples of the steps after the checkpoint were known.",
    "data#data_skipped_unchecked",
)
RANK_DATASETS_DIFFER = FindingCode(
    "RANK_DATASETS_DIFFER",
    Severity.ERROR,
    "Data-parallel ranks hold different training datasets (other rows, or the same rows in another order): the sampler's "
    "shards of them overlap and leave samples out.",
    "data#rank_datasets_differ",
)
HASH_KEYS = ("input_ids", "chosen_input_ids")  # what a batch's samples are made of (LM / SFT, then DPO pairs)
MASK_KEYS = {"input_ids": "attention_mask", "chosen_input_ids": "chosen_attention_mask"}
CHECK_EVERY = 16  # micro-batches checked for repeats and duplicates at once (a finding comes at most this many later)
DATASET_SLOT, DATASET_WIDTH = "dataset", 3  # the exchange's slot of the first step: rows, digest, order-free content sum
CHECKED_CODES = ("DATA_REPEATED", "DUPLICATE_SAMPLES")  # the findings of those checks: with a policy action, checked every step
log = logging.getLogger(__name__)


class DataHashOptions(BaseModel):
    """Options of the ``data_hash`` plugin."""

    model_config = ConfigDict(extra="forbid")

    index_max_rows: int = Field(
        200_000, ge=0, description="Map-style datasets up to this many rows are hashed whole at run start: duplicates are "
        "found before training and a sample present k times may appear k times per epoch."
    )
    fingerprint_rows: int = Field(1000, ge=1, description="Rows (evenly spaced) that make the fingerprint of a dataset too big to index.")
    max_duplicates: int = Field(0, ge=0, description="DUPLICATE_SAMPLES once more than this many samples have a content twin.")
    check_rank_overlap: bool = Field(True, description="Compare the ranks' samples every step (they ride the step's one exchange).")
    check_rank_datasets: bool = Field(
        True, description="Compare the ranks' training dataset fingerprints (row count, digest) at the first step (they ride "
        "that step's exchange): RANK_DATASETS_DIFFER when the ranks hold other rows or the same rows in another order. Only "
        "where the Trainer's own loader shards the dataset (a subclass with its own get_train_dataloader is not compared).",
    )
    fsync_every: int = Field(
        1000, ge=1, description="fsync the ledger every this many steps; it is flushed every step (a killed process loses "
        "nothing) and fsynced at every checkpoint (a machine crash loses nothing a resume needs).",
    )
    max_reports: int = Field(10, ge=1, description="Findings per code per run at most (the evidence counts the rest).")
    seen_capacity: int = Field(
        2_000_000, ge=1, description="Distinct samples per epoch (and distinct contents per run) remembered per rank, in a "
        "fixed-size exact table of 64-bit keys (at most 64 bytes per sample of capacity: 128 MiB for both tables at the "
        "default; 16 KiB for a small run). Exact until full: a repeat is never invented (a false DATA_REPEATED needs two "
        "different samples on one 64-bit key: about n^2/2^65, below 3e-7 for 10 million samples); once full, newer "
        "samples go unchecked (counted in the log) rather than memory growing.",
    )


def _trainer_shards_the_dataset(trainer: Any) -> bool:
    """Whether the training loader is the Trainer's own (its sampler splits one dataset across the ranks by index), not a
    subclass's ``get_train_dataloader``; the method is looked up on the class (the harness wraps the instance's)."""
    method = getattr(type(trainer), "get_train_dataloader", None)
    return method is not None and getattr(method, "__module__", "").startswith(("transformers.", "trl."))


def rank_datasets_finding(
    step: int, gathered: list[list[int] | None], fingerprint: Mapping[str, Any] | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The message and evidence of RANK_DATASETS_DIFFER from every rank's ``[rows, digest, content sum]``, or None.

    ``gathered`` is the exchange's slot per rank: None or ``[]`` for a rank
    without a fingerprint (a dataset that cannot be hashed), left out of the
    comparison. The content sum (0: not indexed) is order-free: two ranks with
    the same rows, sum and another digest hold the same rows in another order.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    sums: dict[tuple[int, int], int] = {}
    missing = []
    for rank, values in enumerate(gathered):
        if not values or len(values) < 2:
            missing.append(rank)
            continue
        key = (int(values[0]), int(values[1]))
        groups.setdefault(key, []).append(rank)
        sums[key] = int(values[2]) if len(values) > 2 else 0
    if len(groups) < 2:
        return None
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))  # the largest group first, then rank 0's
    reference_key, reference_ranks = ordered[0]

    def ranks_text(ranks: list[int]) -> str:
        return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))

    def holds(ranks: list[int]) -> str:
        return "holds" if len(ranks) == 1 else "hold"

    parts = [f"{ranks_text(ranks)} {holds(ranks)} {rows} rows (digest {hex64(digest)})" for (rows, digest), ranks in ordered]
    reordered = [ranks for key, ranks in ordered[1:]
                 if key[0] == reference_key[0] and sums[key] != 0 and sums[key] == sums[reference_key]]
    differing = sorted(r for _, ranks in ordered[1:] for r in ranks)
    how = ""
    if reordered:
        same = sorted(r for ranks in reordered for r in ranks)
        how = (f": {ranks_text(same)} {holds(same)} the same rows as {ranks_text(reference_ranks)} in another order "
               "(an unseeded or per-rank shuffle)")
    message = (
        f"the data-parallel ranks train different datasets at step {step}: " + "; ".join(parts) + how + "."
        + " The Trainer's sampler shards one dataset by index, so with other rows or another order on some ranks, samples "
        "are trained on several ranks and others on none every epoch. Fix: every rank must load the same dataset in the "
        "same order (the Trainer's sampler shards it); shuffle with a seed (dataset.shuffle(seed=...)), the same on every rank."
    )
    evidence: dict[str, Any] = {
        "groups": [{"ranks": ranks, "rows": rows, "digest": hex64(digest)} for (rows, digest), ranks in ordered],
        "differing_ranks": differing,
        "reference_ranks": reference_ranks,
        "same_rows_other_order": sorted(r for ranks in reordered for r in ranks),
    }
    if missing:
        evidence["ranks_not_compared"] = missing
    if fingerprint is not None:
        evidence["column"], evidence["indexed"] = fingerprint.get("column"), fingerprint.get("indexed")
    return message, evidence


def unsharded_workers_cause(same_run: int, num_workers: int, dataset_class: str | None) -> str | None:
    """The classic cause of repeats that come in runs of the loader's worker count, in words; None when they do not.

    ``same_run``: how many micro-batches right before the repeated one held
    exactly its samples, in order. A torch ``IterableDataset`` whose
    ``__iter__`` ignores ``get_worker_info()`` is read whole by each of the
    loader's N workers, and the loader takes one batch from each worker in
    turn: every batch comes N times in a row (runs of 1 to N-1 before it).
    """
    if dataset_class is None or num_workers < 2 or not 1 <= same_run < num_workers:
        return None
    return (
        f"it holds exactly the samples of the micro-batch before it ({same_run + 1} in a row so far, with "
        f"dataloader_num_workers={num_workers}): the classic cause is an IterableDataset ({dataset_class}) read by "
        f"{num_workers} DataLoader workers without torch.utils.data.get_worker_info() sharding, so every worker yields the "
        f"same rows and each sample comes {num_workers} times in a row. Fix: in __iter__, yield only every num_workers-th "
        "row starting at get_worker_info().id (or use a datasets IterableDataset with n_shards >= the workers), or set "
        "dataloader_num_workers=0."
    )


def _hash_key(batch: Mapping[str, Any]) -> str | None:
    for key in HASH_KEYS:
        if torch.is_tensor(batch.get(key)) and batch[key].dim() == 2:
            return key
    return None


class DataHash(Plugin):
    """Writes the data ledger and reports repeated, skipped, duplicated and rank-overlapping samples."""

    name = "data_hash"
    Options = DataHashOptions
    CODES = (DATA_REPEATED, DATA_SKIPPED, DATA_SKIPPED_UNCHECKED, DUPLICATE_SAMPLES, RANK_DATA_OVERLAP, RESUME_DATA_CHANGED,
             RANK_DATASETS_DIFFER)

    def __init__(self) -> None:
        self.options = DataHashOptions()
        self._writer: LedgerWriter | None = None
        self._pending: list[tuple[int, int, list[Any] | None, int]] = []  # (micro-batch, rows, sample ids, position), hashes deferred
        # (step, epoch, hashes, ids, position), checked in groups
        self._unchecked: list[tuple[int, int, list[int], list[Any] | None, int]] = []
        self._check_every = CHECK_EVERY
        self._read: list[list[int]] | None = None  # the step's hashes per micro-batch, read at the guard
        self._capacity = 0  # hashes per rank and step in the exchange (0: no overlap check)
        self._shared_step: int | None = None  # the step whose hashes were shared (ctx.shared is that step's)
        self._cut = False  # this rank had more hashes than the slot holds at the last share
        self._multiplicity: Counter[int] | None = None
        self.fingerprint: dict[str, Any] | None = None
        self._content_sum: int | None = None  # order-free sum of the indexed dataset's row hashes (int64, wrapped)
        self._datasets_due = False  # the ranks' dataset fingerprints are still to be compared (at the first step)
        self._datasets_step: int | None = None  # the step whose exchange carries this rank's fingerprint
        self._epoch = 0
        self._step_epoch = 0
        self._seen = SeenTable(self.options.seen_capacity)  # key64(sample id, else content hash) -> times trained this epoch
        self._content_ids = SeenTable(self.options.seen_capacity)  # content hash -> key64 of the first sample id it came with
        self._twins = 0
        self._repeats_total = 0
        self._padding_repeats = 0  # repeats that were the sampler's end-of-epoch padding (not reported)
        # samples this rank has trained in the current epoch, counted as batches arrive (before anything that may fail): a
        # micro-batch whose hashes are lost to an error still holds its place, so the epoch's padded end is still known
        self._position = 0
        self._padding: EpochPadding | None = None
        self._resume_step: int | None = None
        self._interrupted: dict[tuple[int, int], int] = {}  # (epoch, hash) -> step the interrupted attempt trained it at
        self._since_resume: set[tuple[int, int]] = set()  # the keys of _interrupted trained again (bounded by it)
        # rank 0 of several: the resumed run's samples of every rank reach it in the step's exchange, so it alone judges
        # DATA_SKIPPED, with the interrupted run's samples of every rank (a step is one set, whatever the world size)
        self._skips_of_all_ranks = False
        # steps after the resume, up to the interrupted run's last, whose exchange did not carry every rank's samples: a
        # count (a run whose micro-batches hold more rows than the slot has one at every step), and the ranks cut or absent
        self._unseen_steps = 0
        self._unseen_cut: set[int] = set()
        self._unseen_absent: set[int] = set()
        self._skip_note: str | None = None  # why DATA_SKIPPED is not judged for this resume (said once, at the run end)
        self._interrupted_epoch = 0  # the last epoch of _interrupted
        self._interrupted_last = 0  # the last step of _interrupted
        self._num_workers = 0  # the training loader's worker processes (dataloader_num_workers)
        self._iterable: str | None = None  # the training dataset's class when it is an IterableDataset
        self._previous: list[int] | None = None  # the hashes of the micro-batch checked last
        self._same_run = 0  # micro-batches before this one in a row with exactly its samples
        self._calls = 0  # train() calls this plugin has started (a second one from step 0 is a new series)

    def setup(self, ctx: Any) -> None:
        self._seen = SeenTable(self.options.seen_capacity)
        self._content_ids = SeenTable(self.options.seen_capacity)

    # -- run start: the ledger, the dataset's index and fingerprint ----------------------------------

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._capacity = 0
        if ctx.world_size > 1 and self.options.check_rank_overlap:
            # first, before anything that may fail on one rank only: one slot of the step's exchange, the same on every
            # rank (the same arguments), reserved in the same order
            args = getattr(trainer, "args", None)
            self._capacity = max(1, int(getattr(args, "per_device_train_batch_size", 1) or 1)) * max(
                1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
            ctx.reserve("hashes", self._capacity, owner=self.name)
        # only where the Trainer's own loader shards one dataset by index: a subclass that builds its own loader may give
        # each rank its own shard on purpose (the same class on every rank: the reservation below is alike everywhere)
        self._datasets_due = ctx.world_size > 1 and self.options.check_rank_datasets and _trainer_shards_the_dataset(trainer)
        self._datasets_step = None
        if self._datasets_due:  # the same on every rank too: the dataset's fingerprint, at the first step only
            ctx.reserve(DATASET_SLOT, DATASET_WIDTH, owner=self.name)
        resumed = str(ctx.resumed_from) if ctx.resumed_from is not None else None
        resume_step = trainer.state.global_step if resumed is not None else None  # one ledger pass serves the whole resume
        # another train() call of this process from the start, on the weights the earlier one trained: a new series (its
        # samples are no repeats of the earlier call's, and it supersedes none of its steps), said once
        new_series = self._calls > 0 and resumed is None and trainer.state.global_step == 0
        self._calls += 1
        if new_series and ctx.is_main:
            log.info("data_hash: train() was called again from step 0 on the trained weights; the ledger counts it as a new "
                     "series (attempt numbers go on), not as a resume.")
        self._seen, self._content_ids = self._seen.clear(), self._content_ids.clear()  # per call, as in a new process
        if self._writer is not None:  # a writer an earlier call left open would hold the ledger's lock
            self._writer.close()
        self._writer = LedgerWriter(ctx.run_dir, ctx.rank, self.options.fsync_every, resume_step=resume_step)
        self._writer.start(trainer.state.global_step, ctx.world_size, resumed, new_series=new_series)
        self._epoch = self._step_epoch = self._current_epoch(trainer)
        self._pending, self._read, self._shared_step, self._unchecked = [], None, None, []
        policy = getattr(getattr(ctx, "options", None), "policy", None) or {}
        acted = any(Action(policy.get(code, Action.CONTINUE)) is not Action.CONTINUE for code in CHECKED_CODES)
        self._check_every = 1 if acted else CHECK_EVERY  # an action the user tied to these findings comes at their step
        # one process: the step end reads the hashes; several without the overlap check: the first step's fingerprint only
        self.idle_hooks("on_before_optimizer_step", idle=not (self._capacity or self._datasets_due))
        self._position, self._padding = 0, self._epoch_padding(ctx, trainer)
        self._resume_step, self._interrupted, self._since_resume = None, {}, set()
        self._skips_of_all_ranks = ctx.world_size > 1 and bool(self._capacity) and ctx.is_main
        self._unseen_steps, self._unseen_cut, self._unseen_absent, self._skip_note = 0, set(), set(), None
        args = getattr(trainer, "args", None)
        self._num_workers = int(getattr(args, "dataloader_num_workers", 0) or 0)
        dataset = getattr(trainer, "train_dataset", None)
        self._iterable = type(dataset).__name__ if isinstance(dataset, torch.utils.data.IterableDataset) else None
        self._previous, self._same_run = None, 0

    @hookimpl
    def inspect_dataset(self, ctx: Any, dataset: Any, split: str) -> None:
        if split != "train" or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            return
        size = len(dataset)
        key = next((k for k in HASH_KEYS if dataset_rows(dataset, k, range(min(1, size))) is not None), None)
        if key is None or size == 0:
            self.fingerprint = self._content_sum = None
            return
        indexed = size <= self.options.index_max_rows
        if indexed:
            hashes = dataset_hashes(dataset, key, size) or []
            self._multiplicity = Counter(hashes)
        else:
            step = size / self.options.fingerprint_rows
            hashes = hash_token_rows(dataset_rows(dataset, key, sorted({int(i * step) for i in range(self.options.fingerprint_rows)})) or [])
        digest = xxhash.xxh3_64()
        digest.update(str(size).encode())
        for value in hashes:
            digest.update(value.to_bytes(8, "little", signed=True))
        self.fingerprint = {"rows": size, "column": key, "indexed": indexed, "digest": digest.hexdigest()}
        self._content_sum = wrap64(sum(hashes)) if indexed else None
        if self._multiplicity is not None and ctx.is_main:
            twins = {h: n for h, n in self._multiplicity.items() if n > 1}
            extra = sum(n - 1 for n in twins.values())
            if extra > self.options.max_duplicates and not self._dataset_reported_before(ctx, self.fingerprint["digest"]):
                self.report(
                    DUPLICATE_SAMPLES.code,
                    f"{extra} of the {size} training rows repeat another row's content ({len(twins)} distinct samples "
                    f"appear more than once, the most frequent {max(twins.values())} times); each is trained that many times per epoch.",
                    evidence={"rows": size, "extra_copies": extra, "distinct_duplicated": len(twins), "source": "dataset index",
                              "dataset_digest": self.fingerprint["digest"]},
                    limit=self.options.max_reports,
                )

    def _dataset_reported_before(self, ctx: Any, digest: str) -> bool:
        """An earlier attempt in this run directory (a resume, a rollback) reported this very dataset's duplicates."""
        try:
            return any(f.code == DUPLICATE_SAMPLES.code and f.evidence.get("dataset_digest") == digest
                       for f in read_run_findings(ctx.run_dir))
        except Exception:  # noqa: BLE001 - unreadable findings: report again rather than lose the finding
            return False

    # -- per micro-batch: hashes stay on the device ----------------------------------------------------

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: Any, step: int, micro_step: int) -> None:
        if not isinstance(batch, Mapping):
            return
        key = _hash_key(batch)
        if key is None:
            return
        if micro_step == 0:
            epoch = self._current_epoch(ctx.trainer)  # before the Trainer advances state.epoch at step end
            if epoch != self._step_epoch:
                self._step_epoch, self._position = epoch, 0
        tokens = batch[key]
        count = int(tokens.shape[0]) if tokens.dim() > 1 else 1  # rows, as batch_row_hashes hashes them
        position, self._position = self._position, self._position + count
        rows = batch_row_hashes(batch, key, MASK_KEYS[key], ctx.masked_lm)  # a masked-LM row: its original tokens
        ids = sample_ids(batch)
        self.defer("hashes", rows)  # read with every plugin's tensors in the guard's one transfer
        self._pending.append((micro_step, count, ids, position))

    # -- per optimizer step: the guard's read and exchange, the ledger, the checks -------------------------

    def _read_hashes(self, count: int) -> list[list[int]]:
        """The step's row hashes per micro-batch, from the step's one read (one list per queued micro-batch)."""
        read = self.deferred("hashes")
        if len(read) != count:
            raise RuntimeError(f"data_hash: {count} micro-batches were hashed this step but {len(read)} were read back")
        return read  # fresh lists from the read: nobody else holds them

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int) -> None:
        if self._datasets_due:  # first: a failing hash read below must not keep the fingerprint from the exchange
            self._datasets_step = step
            ctx.share(DATASET_SLOT, self._dataset_values(), owner=self.name)
        self._shared_step = step if self._capacity else None
        self._read = self._read_hashes(len(self._pending))
        if self._capacity:
            flat = [h for hashes in self._read for h in hashes]  # signed int64 already (wrapped sums): fit the exchange
            self._cut = len(flat) > self._capacity
            ctx.share("hashes", flat, owner=self.name)

    @hookimpl
    def on_step_end(self, ctx: Any, step: int) -> None:
        pending, self._pending, read, self._read = self._pending, [], self._read, None
        if read is None:
            read = self._read_hashes(len(pending))  # no guard ran this step: the values of the step end's read
        if self._datasets_step is not None:
            self._compare_datasets(ctx, step, self._datasets_step == step)
        shared_step, self._shared_step = self._shared_step, None
        gathered = ctx.shared("hashes", owner=self.name) if shared_step == step and ctx.is_main else None
        if gathered is not None:
            self._check_overlap(ctx, step, gathered)
        if self._skips_of_all_ranks and self._interrupted and len(self._since_resume) < len(self._interrupted):
            self._note_resumed_samples(ctx, step, gathered)
        if not pending:
            return
        epoch = self._step_epoch
        records = []
        unchecked = self._unchecked
        for (micro, _, ids, position), hashes in zip(pending, read):
            records.append((micro, hex64(combine_row_hashes(hashes)), hex64_all(hashes), ids))
            unchecked.append((step, epoch, hashes, ids, position))
        if self._writer is not None:
            self._writer.write_hashes(step, epoch, records)
        if len(unchecked) >= self._check_every:
            self._check_unchecked(ctx)

    def _note_resumed_samples(self, ctx: Any, step: int, gathered: list[list[int] | None] | None) -> None:
        """Rank 0 of several: the samples every rank trained at ``step`` that the interrupted run trained after the checkpoint."""
        cut = ctx.shared_cut("hashes", owner=self.name) if gathered is not None else []
        if gathered is None or any(g is None for g in gathered) or cut or self._cut:
            if step <= self._interrupted_last:  # later steps hold none of the interrupted run's steps: nothing to count
                self._unseen_steps += 1  # not every rank's samples of this step are known here
                self._unseen_cut.update(cut or ([ctx.rank] if self._cut else []))
                self._unseen_absent.update(r for r, g in enumerate(gathered or [None] * ctx.world_size) if g is None)
            return
        epoch = self._step_epoch
        if epoch > self._interrupted_epoch:
            return  # past every epoch the interrupted run trained after the checkpoint: nothing more to find
        for hashes in gathered:
            for h in hashes or []:
                if (epoch, h) in self._interrupted:
                    self._since_resume.add((epoch, h))

    def _check_unchecked(self, ctx: Any) -> None:
        """The repeat and duplicate checks of the micro-batches written since the last call, in training order.

        Checked in groups of ``CHECK_EVERY`` micro-batches (and at checkpoints
        and the run end): one call walks them all while its code is warm,
        where a call per step ran cold between two steps at several times the
        cost. A finding comes up to that many micro-batches later, with the
        step it happened at (every step when the config's ``policy`` ties an
        action to one of ``CHECKED_CODES``); the ledger line of every step is
        written at once.
        """
        unchecked = self._unchecked
        while unchecked:  # one at a time: a check that raises costs its own micro-batch, the rest wait for the next call
            step, epoch, hashes, ids, position = unchecked.pop(0)
            if epoch != self._epoch:
                self._epoch, self._seen = epoch, self._seen.clear()
            self._check_samples(ctx, step, hashes, ids, position)

    def _epoch_padding(self, ctx: Any, trainer: Any) -> EpochPadding | None:
        """How the distributed sampler pads this run's epochs (None: one process, or a dataset without a length)."""
        dataset, args = getattr(trainer, "train_dataset", None), getattr(trainer, "args", None)
        if ctx.world_size <= 1 or dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            return None
        accelerator = getattr(trainer, "accelerator", None)
        return epoch_padding(len(dataset), int(getattr(args, "per_device_train_batch_size", 1) or 1), ctx.world_size,
                             drop_last=bool(getattr(args, "dataloader_drop_last", False)),
                             even_batches=bool(getattr(accelerator, "even_batches", True)))

    def _current_epoch(self, trainer: Any) -> int:
        epoch = getattr(getattr(trainer, "state", None), "epoch", None) or 0.0
        return int(math.floor(float(epoch) + 1e-6))

    def _check_samples(self, ctx: Any, step: int, hashes: list[int], ids: list[Any] | None, position: int = 0) -> None:
        """``position``: how many samples this rank trained in the epoch before this micro-batch (read only where the
        distributed sampler pads the epoch)."""
        repeated = []
        untracked = self._seen.untracked
        self._same_run = self._same_run + 1 if hashes and hashes == self._previous else 0
        self._previous = hashes
        for i, h in enumerate(hashes):
            if self._interrupted and (self._epoch, h) in self._interrupted:
                self._since_resume.add((self._epoch, h))
            key = ids[i] if ids is not None and i < len(ids) else h
            id_key = key64(key)
            allowed = 1 if ids is not None or self._multiplicity is None else self._multiplicity.get(h, 1)
            if self._seen.add(id_key) > allowed:
                repeated.append(i)
            if ids is not None:
                first_key = self._content_ids.setdefault(key64(h), id_key)
                if first_key is not None and first_key != id_key:
                    self._twins += 1
                    if self._twins == self.options.max_duplicates + 1:
                        first = self._first_id(ctx, h, first_key, hashes, ids)
                        self.report(
                            DUPLICATE_SAMPLES.code,
                            f"sample id {key} at step {step} on rank {ctx.rank} has the same content as sample id {first}: "
                            f"{self._twins} content duplicates under different ids so far.",
                            step=step, evidence={"sample_id": key, "same_as": first, "hash": hex64(h), "source": "training"},
                            limit=self.options.max_reports,
                        )
        if repeated and is_padding(self._padding, position, len(repeated)):
            self._padding_repeats += len(repeated)
            log.info(
                "data_hash: %d sample(s) of the last batch of epoch %d on rank %d were trained earlier in the epoch: the distributed "
                "sampler completes the last round of batches from the epoch's start (accelerate's even_batches), not a lost data "
                "position; not reported.", len(repeated), self._epoch, ctx.rank,
            )
            repeated = []
        if repeated:
            self._repeats_total += len(repeated)
            workers = unsharded_workers_cause(self._same_run, self._num_workers, self._iterable)
            evidence: dict[str, Any] = {
                "rows": repeated, "hashes": [hex64(hashes[i]) for i in repeated], "epoch": self._epoch,
                "sample_ids": [ids[i] for i in repeated] if ids else None, "repeats_so_far": self._repeats_total,
            }
            if workers is not None:
                evidence.update({"same_as_previous_micro_batches": self._same_run, "dataloader_num_workers": self._num_workers,
                                 "dataset_class": self._iterable, "cause": "unsharded_iterable_workers"})
            why = workers or ("this follows a resume: the data position was not restored." if self._resume_step is not None
                              else "the loader is not covering its epoch once.")
            self.report(
                DATA_REPEATED.code,
                f"{len(repeated)} of {len(hashes)} samples of a micro-batch at step {step} on rank {ctx.rank} were already trained "
                f"on in epoch {self._epoch} ({self._repeats_total} repeats so far); " + why,
                step=step, evidence=evidence, limit=self.options.max_reports,
            )
        if self._seen.untracked and not untracked:
            log.warning(
                "data_hash: epoch %d on rank %d trained more than seen_capacity=%d distinct samples; later ones are not checked "
                "for repeats (raise data_hash.seen_capacity to check them: 64 bytes per sample at most).",
                self._epoch, ctx.rank, self.options.seen_capacity,
            )

    def _first_id(self, ctx: Any, h: int, first_key: int, hashes: list[int], ids: list[Any]) -> Any:
        """The sample id that content ``h`` came with first (the table keeps its 64-bit key only): from this rank's ledger, once."""
        if self._writer is not None:
            self._writer.sync()
        for record in iter_records(ledger_path(ctx.run_dir, ctx.rank)):
            for value, sample_id in zip(record.get("sample_hashes") or [], record.get("sample_ids") or []):
                if key64(sample_id) == first_key and from_hex64(value) == h:
                    return sample_id
        return next((s for s, v in zip(ids, hashes) if v == h and key64(s) == first_key), f"key:{first_key:016x}")

    def _check_overlap(self, ctx: Any, step: int, gathered: list[list[int] | None]) -> None:
        """Rank 0, after the exchange: samples that more than one rank trained this step (a rank that shared nothing is left out)."""
        owner: dict[int, int] = {}
        shared: dict[int, set[int]] = {}
        for rank, rank_hashes in enumerate(gathered):
            for h in set(rank_hashes or []):
                if h in owner and owner[h] != rank:
                    shared.setdefault(h, {owner[h]}).add(rank)
                owner.setdefault(h, rank)
        if self._multiplicity is not None:
            shared = {h: r for h, r in shared.items() if self._multiplicity.get(h, 1) == 1}  # twins may meet by chance
        if shared:
            ranks = sorted({r for rs in shared.values() for r in rs})
            evidence: dict[str, Any] = {
                "shared_samples": len(shared), "ranks": ranks, "per_rank_samples": [len(g or []) for g in gathered],
                "hashes": [hex64(h) for h in list(shared)[:10]],
            }
            cut = ctx.shared_cut("hashes", owner=self.name)
            if cut or self._cut:  # more rows than the exchange's slot: the first ``capacity`` of those ranks compared
                evidence["compared_per_rank_at_most"] = self._capacity
                evidence["ranks_cut"] = cut
            if any(g is None for g in gathered):
                evidence["ranks_not_compared"] = [r for r, g in enumerate(gathered) if g is None]
            self.report(
                RANK_DATA_OVERLAP.code,
                f"{len(shared)} samples were trained at step {step} by more than one data-parallel rank (ranks {ranks}): "
                "the ranks are not reading disjoint shards, so the effective batch is smaller than configured.",
                step=step, evidence=evidence, limit=self.options.max_reports,
            )

    def _dataset_values(self) -> list[int]:
        """This rank's share of the fingerprint comparison: [rows, digest, order-free sum or 0], or [] without one."""
        fp = self.fingerprint
        if fp is None:
            return []  # an empty share, not none: the exchange still says that this rank took part
        return [int(fp["rows"]), from_hex64(fp["digest"]), self._content_sum if self._content_sum is not None else 0]

    def _compare_datasets(self, ctx: Any, step: int, carried: bool) -> None:
        """After the exchange that carried the fingerprints (every rank alike): rank 0 compares them, once per run."""
        self._datasets_step = None
        gathered = ctx.shared(DATASET_SLOT, owner=self.name) if carried else None
        if gathered is None:  # the step never reached its exchange: share again at the next step
            return
        self._datasets_due = False
        if not self._capacity:
            self.idle_hooks("on_before_optimizer_step")  # back to no call per step
        if ctx.is_main:
            self._check_datasets(ctx, step, gathered)

    def _check_datasets(self, ctx: Any, step: int, gathered: list[list[int] | None]) -> None:
        """Rank 0: one RANK_DATASETS_DIFFER when the ranks' training datasets (row count, digest) are not all the same."""
        finding = rank_datasets_finding(step, gathered, self.fingerprint)
        if finding is not None:
            message, evidence = finding
            self.report(RANK_DATASETS_DIFFER.code, message, step=step, evidence=evidence)

    # -- checkpoints and resume --------------------------------------------------------------------------

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any] | None:
        try:
            self._check_unchecked(ctx)  # the epoch stored is the one of the last step trained
        finally:
            if self._writer is not None:
                self._writer.sync()  # the ledger up to this checkpoint is on disk before the checkpoint counts
        # the samples this rank trained in the epoch so far, lost micro-batches included (the ledger lacks their lines)
        return {"fingerprint": self.fingerprint, "epoch": self._epoch, "position": self._position, "position_epoch": self._step_epoch}

    @hookimpl
    def on_resume(self, ctx: Any, state: dict[str, Any] | None) -> None:
        self._resume_step = ctx.step
        self._restore_epoch_from_ledger(ctx)
        position, epoch = (state or {}).get("position"), (state or {}).get("position_epoch")
        if type(position) is int and position >= 0 and type(epoch) is int and epoch == self._step_epoch:
            self._position = position  # the count at the save: the ledger's lines miss a step whose hashes an error lost
        stored = (state or {}).get("fingerprint")
        edit = getattr(ctx, "data_edit", None)
        if edit:  # the data changed on purpose: what the interrupted run trained next is not what this one should
            self._interrupted.clear()
            log.info("data_hash: the resume's data differs from the checkpoint's on purpose (%s): not compared", edit)
        elif stored and self.fingerprint and stored["digest"] != self.fingerprint["digest"] and ctx.is_main:
            self.report(
                RESUME_DATA_CHANGED.code,
                f"the training data changed since the checkpoint: {stored['rows']} rows (fingerprint {stored['digest']}) then, "
                f"{self.fingerprint['rows']} rows (fingerprint {self.fingerprint['digest']}) now; the data position restored "
                "from the checkpoint points into different data.",
                evidence={"stored": stored, "current": self.fingerprint},
            )

    def _check_skipped(self, ctx: Any) -> None:
        """At the run end: DATA_SKIPPED for samples the interrupted run trained, up to the step reached, that no rank trained again."""
        reached = ctx.step
        if self._unseen_steps:
            self._report_unseen(ctx, reached)
            return
        missing = {key: s for key, s in self._interrupted.items() if s <= reached and key not in self._since_resume}
        if not missing:
            return
        steps = sorted(set(missing.values()))
        who = "by any rank of the resumed run" if self._skips_of_all_ranks else (
            f"by the resumed run on rank {ctx.rank}" if ctx.world_size > 1 else "by the resumed run")
        self.report(
            DATA_SKIPPED.code,
            f"{len(missing)} samples the interrupted run trained at steps {steps[0]}-{steps[-1]} (after the checkpoint of step "
            f"{self._resume_step}) were not trained in the same epoch {who}, which reached step {reached}: the resumed data "
            "order differs from the interrupted one.",
            step=reached,
            evidence={"missing": len(missing), "steps": steps[:50], "hashes": [hex64(h) for _, h in list(missing)[:10]],
                      "epochs": sorted({e for e, _ in missing}), "all_ranks": self._skips_of_all_ranks or ctx.world_size == 1},
            limit=self.options.max_reports,
        )

    def _report_unseen(self, ctx: Any, reached: int) -> None:
        """DATA_SKIPPED_UNCHECKED (rank 0): steps after the resume did not bring every rank's samples, so none is judged.

        A sample the interrupted run trained may have been trained again at any
        of those steps (the order may differ: that is what DATA_SKIPPED looks
        for), so judging the rest would report samples as skipped that were not.
        """
        steps = sorted({s for s in self._interrupted.values() if s <= reached})
        why = []
        if self._unseen_cut:
            why.append(f"rank(s) {sorted(self._unseen_cut)} had more rows in a step than the exchange's slot of {self._capacity} "
                       "per rank (per_device_train_batch_size x gradient_accumulation_steps): packed, paired (DPO) or otherwise "
                       "multiplied rows; only the first ones arrive")
        if self._unseen_absent:
            why.append(f"rank(s) {sorted(self._unseen_absent)} shared no hashes (lost to an error on that rank, or the step "
                       "never reached its exchange)")
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "the steps after it"
        self.report(
            DATA_SKIPPED_UNCHECKED.code,
            f"DATA_SKIPPED was not judged for the resume from step {self._resume_step}: at {self._unseen_steps} of the "
            f"{len(steps)} steps the interrupted run trained after the checkpoint ({span}), rank 0 did not get every rank's "
            f"samples from the step exchange: {'; '.join(why) or 'unknown'}. The first steps' data position was still checked "
            "rank by rank (RESUME_DATA_POSITION); the ledger holds every rank's samples for a comparison by hand "
            "(read_ledger).",
            step=reached,
            evidence={"unseen_steps": self._unseen_steps, "interrupted_steps": len(steps), "ranks_cut": sorted(self._unseen_cut),
                      "ranks_absent": sorted(self._unseen_absent), "slot_per_rank": self._capacity, "resume_step": self._resume_step},
        )

    def _restore_epoch_from_ledger(self, ctx: Any) -> None:
        """What this epoch already trained before the checkpoint, and what the interrupted run trained after it."""
        before, _ = around_resume(ctx.run_dir, ctx.rank, ctx.step)
        for record in before:
            if record["epoch"] == self._epoch:
                ids = record.get("sample_ids")
                for i, h in enumerate(record["sample_hashes"]):
                    self._seen.add(key64(ids[i] if ids else from_hex64(h)))
                self._position += len(record["sample_hashes"])
        for record in self._interrupted_records(ctx):
            for h in record["sample_hashes"]:
                self._interrupted.setdefault((record["epoch"], from_hex64(h)), record["step"])
        self._interrupted_epoch = max((epoch for epoch, _ in self._interrupted), default=0)
        self._interrupted_last = max(self._interrupted.values(), default=0)

    def _interrupted_records(self, ctx: Any) -> list[dict[str, Any]]:
        """The interrupted run's records after the checkpoint that this rank judges DATA_SKIPPED against.

        A step's samples are one set over the ranks, whatever the world size of
        either run: one process judges every rank's records; with several, rank
        0 does, with every rank's resumed samples from the step's exchange. Without
        that exchange (``check_rank_overlap: false``) each rank judges its own
        ledger, which holds its share only when the world size is unchanged.
        """
        if ctx.world_size == 1 or self._skips_of_all_ranks:
            return continuation(ctx.run_dir, ctx.step).records
        if self._capacity:
            return []  # rank 0 judges every rank's samples
        found = continuation(ctx.run_dir, ctx.step)
        if found.world_size not in (None, ctx.world_size):
            self._skip_note = (
                f"the interrupted run trained with {found.world_size} processes and this one with {ctx.world_size}, and "
                "data_hash.check_rank_overlap is off (no step exchange of the samples), so no rank's ledger share of a step "
                "matches its share of the interrupted run's. Fix: leave check_rank_overlap on (rank 0 then judges every "
                "rank's samples)"
            )
            return []
        return [record for record in found.records if record["rank"] == ctx.rank]

    @hookimpl
    def on_run_end(self, ctx: Any) -> None:
        try:
            self._check_unchecked(ctx)
            if self._skip_note is not None and ctx.is_main:  # alike on every rank: said once
                self.report(DATA_SKIPPED_UNCHECKED.code, f"DATA_SKIPPED was not judged: {self._skip_note}.", step=ctx.step,
                            evidence={"resume_step": self._resume_step, "cause": "world_size_changed_without_exchange"})
            if self._interrupted and self._resume_step is not None:
                self._check_skipped(ctx)
        finally:  # the ledger is closed (trimmed, and its lock released for the next train() call) whatever failed above
            if self._writer is not None:
                self._writer.close()
                self._writer = None
