"""rank_rng: at the first step, compare every rank's random streams and train-sampler seed.

Before the first micro-batch's forward pass each rank digests (63 bits
each, :mod:`harness.lib.rng_digest`) its torch CPU generator, its CUDA
generator (once CUDA is in use), python's ``random`` and numpy's global
state, and reads its train sampler's seed (:mod:`harness.lib.sampler_seed`).
The row rides that step's one exchange; rank 0 judges the rows of all ranks:

* ``RNG_IDENTICAL_ACROSS_RANKS`` (warning): ranks whose dropout stream
  (torch CPU for a CPU model, CUDA for a CUDA one) is bit-identical while
  the model draws dropout in training (:mod:`harness.lib.dropout`: what
  its modules run, not every config key named "dropout"): every rank draws
  the same masks. It is HF's default (the Trainer calls
  ``set_seed(args.seed)`` on every rank), which is why it is a warning; the
  fix is one line.
* ``SAMPLER_SEED_MISMATCH`` (error): ranks whose sharded sampler shuffles
  with different seeds: accelerate's ``BatchSamplerShard`` (and torch's
  ``DistributedSampler``) give each rank a slice of *one* shuffled order, so
  slices cut from different orders overlap and leave samples out every
  epoch: the data the run trains on is wrong, as with ``RANK_DATA_OVERLAP``.

Rank 0 also writes ``harness/rank_rng.json`` (every rank's digests and seed).
One process: the plugin does nothing. Cost: once, at the first step, a
few kilobytes hashed per rank (a few hundred microseconds) and, on rank 0,
one walk over the model's modules at run start; on every step a slot of
``1 + 8`` int64s in the step's existing all-gather (no collective of its
own), and two hooks (``inspect_batch``, ``on_step_agreed``) that return
at their first test.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.core.strictjson import dumps
from harness.lib.dropout import describe, dropout_sources
from harness.lib.rng_digest import STREAM_NAMES, stream_digests
from harness.lib.rng_ranks import WIDTH, RankRow, SharedStream, majority_seed, pack, rows_of, sampler_mismatch, shared_streams
from harness.lib.safe_paths import safe_write_text
from harness.lib.sampler_seed import SamplerSeed, sampler_seed, train_loader

log = logging.getLogger("harness.rank_rng")

RNG_IDENTICAL_ACROSS_RANKS = FindingCode(
    "RNG_IDENTICAL_ACROSS_RANKS", Severity.WARNING,
    "Data-parallel ranks start training with the same dropout RNG state while the model has dropout: every rank draws the same masks.",
    "rng#rng_identical_across_ranks",
)
SAMPLER_SEED_MISMATCH = FindingCode(
    "SAMPLER_SEED_MISMATCH", Severity.ERROR,
    "The ranks' train samplers shuffle with different seeds: their shards come from different orders (samples repeated and skipped).",
    "rng#sampler_seed_mismatch",
)
SLOT = "streams"


class RankRngOptions(BaseModel):
    """Options of the ``rank_rng`` plugin."""

    model_config = ConfigDict(extra="forbid")

    dropout_only: bool = Field(
        True, description="Report ranks sharing their dropout RNG stream only when the model draws dropout in training (nn.Dropout "
        "modules with p > 0, probabilities a module applies itself such as an attention's attention_dropout; not config keys no "
        "module reads); false: whenever they share it (a model that draws its own noise).")
    check_sampler_seed: bool = Field(True, description="Compare the train sampler's seed across ranks (SAMPLER_SEED_MISMATCH).")


class RankRng(Plugin):
    """Compares the ranks' RNG streams and sampler seeds at the first step: RNG_IDENTICAL_ACROSS_RANKS, SAMPLER_SEED_MISMATCH."""

    name = "rank_rng"
    Options = RankRngOptions
    CODES = (RNG_IDENTICAL_ACROSS_RANKS, SAMPLER_SEED_MISMATCH)
    options: RankRngOptions

    def __init__(self) -> None:
        self.options = RankRngOptions()
        self.setup(None)

    def setup(self, ctx: Any) -> None:
        self._active = False  # several ranks, and the first step's exchange not read yet
        self._row: list[int] | None = None
        self._dropout: list[str] = []
        self._stream = "torch"
        self._loader: Any = None
        self.record: dict[str, Any] | None = None

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self.idle_hooks("inspect_batch", "on_step_agreed", idle=ctx.world_size <= 1)  # one process: no per-step call
        if ctx.world_size <= 1:
            return
        ctx.reserve(SLOT, WIDTH)  # every rank, first: the exchange's layout must be the same everywhere
        self._active = True
        self._loader = train_loader(trainer)
        model = getattr(trainer, "model", None)
        self._stream = "cuda" if _device_type(model) == "cuda" else "torch"
        if ctx.rank == 0:
            self._dropout = dropout_sources(model)

    @hookimpl
    def inspect_batch(self, ctx: Any) -> None:
        if not self._active:
            return
        if self._row is None:  # before the first forward: the states as seeding (or a resume's restore) left them
            self._row = pack(stream_digests(), self._sampler_seed())
        ctx.share(SLOT, self._row)  # for this step's exchange; again at the next step if this one's did not carry it

    def _sampler_seed(self) -> SamplerSeed:
        """This rank's train-sampler seed; an unreadable custom loader compares nothing (the streams still are)."""
        if not self.options.check_sampler_seed:
            return SamplerSeed()
        try:
            return sampler_seed(self._loader)
        except Exception as exc:  # noqa: BLE001 - a loader we cannot read is no reason to lose the stream check
            log.info("harness rank_rng: the train sampler's seed could not be read: %s", exc)
            return SamplerSeed()

    @hookimpl
    def on_step_agreed(self, ctx: Any, step: int) -> None:
        if not self._active:
            return
        rows = rows_of(ctx.shared(SLOT))
        if not rows:
            return
        self._active = False  # judged once: nothing more on any later step
        self.idle_hooks("inspect_batch", "on_step_agreed")
        if ctx.rank == 0:
            self._judge(ctx, step, rows)

    # -- rank 0: the verdict --------------------------------------------------------------------------

    def _judge(self, ctx: Any, step: int, rows: dict[int, RankRow]) -> None:
        shared = shared_streams(rows, self._stream)  # HF's default seeding: the ranks share every stream
        mismatch = sampler_mismatch(rows) if self.options.check_sampler_seed else None
        self.record = _record(step, ctx.world_size, rows, self._stream, self._dropout, shared, mismatch)
        for group in shared if self._dropout or not self.options.dropout_only else []:
            self._report_identical(ctx, step, group, rows)
        if mismatch:
            self._report_mismatch(ctx, step, mismatch)
        try:
            safe_write_text(ctx.run_dir, ctx.path("rank_rng.json"), dumps(self.record, indent=1))
        except Exception as exc:  # noqa: BLE001 - the findings are made; the file is a convenience
            log.warning("harness rank_rng: could not write rank_rng.json: %s", exc)

    def _report_identical(self, ctx: Any, step: int, group: SharedStream, rows: dict[int, RankRow]) -> None:
        ranks = ", ".join(str(r) for r in group.ranks)
        streams = ", ".join(STREAM_NAMES[s] for s in group.streams)
        why = (f"the model has dropout ({describe(self._dropout)}), so every one of these ranks draws the same dropout masks on its "
               "own batch: the noise is correlated across ranks instead of independent (weaker regularisation; under tensor "
               "parallelism the same mask hits every shard of an activation)") if self._dropout else (
               "(dropout_only is off: reported although the model has no dropout)")
        self.report(
            RNG_IDENTICAL_ACROSS_RANKS.code,
            f"ranks {ranks} of {ctx.world_size} start training with identical RNG state ({streams}) at step {step}; {why}. This is HF's "
            "default: the Trainer calls set_seed(args.seed) on every rank. Fix: set `data_seed` in TrainingArguments (the train sampler "
            "must keep one seed on every rank) and reseed per rank after the Trainer is built, e.g. "
            "`transformers.set_seed(args.seed + args.process_index)` (or `accelerate.utils.set_seed(args.seed, device_specific=True)`).",
            step=step,
            evidence={"ranks": list(group.ranks), "dropout_stream": group.stream, "identical_streams": list(group.streams),
                      "dropout": self._dropout[:20], "dropout_sources": len(self._dropout), "world_size": ctx.world_size,
                      "digests": {str(r): _hex(rows[r].digests) for r in group.ranks}},
        )

    def _report_mismatch(self, ctx: Any, step: int, seeds: dict[int, SamplerSeed]) -> None:
        common = majority_seed(seeds)
        odd = [r for r, s in seeds.items() if (s.kind, s.seed, s.epoch) != (common.kind, common.seed, common.epoch)]
        named = ", ".join(f"rank {r}: {_seed_text(s)}" for r, s in sorted(seeds.items()))
        args = getattr(ctx.trainer, "args", None)
        data_seed, seed = getattr(args, "data_seed", None), getattr(args, "seed", None)
        self.report(
            SAMPLER_SEED_MISMATCH.code,
            f"the train sampler shuffles with different seeds on different ranks ({named}; rank{'s' if len(odd) > 1 else ''} "
            f"{', '.join(map(str, odd))} differ{'' if len(odd) > 1 else 's'}): each rank takes its slice of one shuffled order only "
            "when every rank shuffles alike, so this epoch some samples are trained on several ranks and others on none. "
            f"accelerate seeds the sampler with data_seed ({data_seed}) or, without it, with torch.initial_seed() when train() builds "
            "the loader: a per-rank set_seed before train() changes it. Fix: set `data_seed` in TrainingArguments "
            f"(e.g. data_seed={seed}), and reseed per rank (for dropout) only after the Trainer is built.",
            step=step,
            evidence={"seeds": {str(r): s.seed for r, s in sorted(seeds.items())}, "kinds": {str(r): s.kind for r, s in sorted(seeds.items())},
                      "epochs": {str(r): s.epoch for r, s in sorted(seeds.items())}, "differing_ranks": odd,
                      "expected_seed": common.seed, "data_seed": data_seed, "seed": seed},
        )


def _device_type(model: Any) -> str:
    try:
        return str(next(model.parameters()).device.type)
    except Exception:  # noqa: BLE001 - no parameters: treat as CPU
        return "cpu"


def _hex(digests: dict[str, int]) -> dict[str, str | None]:
    return {s: (f"{v:016x}" if v >= 0 else None) for s, v in digests.items()}


def _seed_text(s: SamplerSeed) -> str:
    return f"{s.seed}" + (f" (epoch {s.epoch})" if s.epoch else "") + ("" if s.kind == "seedable" else f" [{s.kind}]")


def _record(step: int, world: int, rows: dict[int, RankRow], stream: str, dropout: list[str], shared: list[SharedStream],
            mismatch: dict[int, SamplerSeed] | None) -> dict[str, Any]:
    """What rank_rng.json keeps: every rank's digests and sampler seed, and the verdicts."""
    return {
        "step": step, "world_size": world, "dropout_stream": stream, "dropout": dropout[:20],
        "ranks": {str(r): {"digests": _hex(row.digests), "sampler": {"kind": row.sampler.kind, "seed": row.sampler.seed,
                                                                       "epoch": row.sampler.epoch, "sharded": row.sampler.sharded}}
                  for r, row in sorted(rows.items())},
        "identical": [{"ranks": list(g.ranks), "streams": list(g.streams)} for g in shared],
        "sampler_mismatch": sorted(mismatch) if mismatch else [],
    }
