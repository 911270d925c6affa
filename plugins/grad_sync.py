"""grad_sync: proves that data-parallel replicas stay replicas.

Every ``every`` optimizer steps (and at the first), inside the step guard,
each rank fingerprints what data parallelism promises is identical on all
ranks and the ranks compare:

* weights: the parameters the step's forward pass used (bit patterns, so a
  one-ulp drift in one element of one tensor is seen);
* reduced gradients: under DDP (and DeepSpeed stage 0) every rank holds the
  whole averaged gradient, compared bit for bit. Under ZeRO-1/2 each rank
  owns a slice of it, so nothing is replicated: instead every rank sums its
  own (local, pre-reduction) gradient over every slice, the ranks add those
  sums up, and each owner's reduced slice must equal their mean (a linear
  fingerprint survives the reduction; a tolerance covers rounding);
* inputs: whether the ranks were fed identical micro-batches;
* time: how long each rank waited for its data loader (``STRAGGLER_RANK``).

Findings are reported on rank 0 before the update, so ``on_desync: stop``
keeps the step's update from happening. Under FSDP2 HSDP (and FSDP1
``NO_SHARD``) the ranks of one replica group hold the same shards, compared
bit for bit within the group. Fully sharded FSDP holds nothing twice: the
plugin says so once (``GRAD_SYNC_UNSUPPORTED``) and compares only the inputs
and data-loader waits. ZeRO-3 shards everything and the plugin stays idle.
What each engine replicates: :mod:`harness.lib.replicas`.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.appendfile import shared_appender
from harness.core.codes import INTERNAL_PLUGIN_ERROR
from harness.core.distributed import all_gather_guarded, broadcast_guarded, failures
from harness.core.findings import FindingCode, Severity
from harness.lib.fingerprints import exact_fingerprints, same_fingerprint_key, unwrap_optimizer
from harness.lib.fsdp_grads import fsdp2_slices
from harness.lib.grad_slices import ZeroSlices
from harness.lib.replicas import Parallelism, parallelism
from harness.lib.hashing import batch_row_hashes
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.core.strictjson import dumps

GRAD_DESYNC = FindingCode(
    "GRAD_DESYNC",
    Severity.ERROR,
    "Data-parallel ranks hold different reduced gradients: the gradient all-reduce left a rank out or changed it.",
    "distributed#grad_desync",
)
PARAM_DESYNC = FindingCode(
    "PARAM_DESYNC", Severity.ERROR, "Data-parallel replicas hold different weights: they are training different models.", "distributed#param_desync"
)
RANK_INPUTS_IDENTICAL = FindingCode(
    "RANK_INPUTS_IDENTICAL",
    Severity.ERROR,
    "Every data-parallel rank was fed the same micro-batches: N ranks do the work of one.",
    "distributed#rank_inputs_identical",
)
STRAGGLER_RANK = FindingCode(
    "STRAGGLER_RANK", Severity.WARNING, "One rank waits for its data far longer than the others, and every rank waits for it.", "distributed#straggler_rank"
)
GRAD_SYNC_UNSUPPORTED = FindingCode(
    "GRAD_SYNC_UNSUPPORTED",
    Severity.INFO,
    "The replica check cannot run under this parallelism (nothing is replicated).",
    "distributed#grad_sync_unsupported",
)
DESYNC_CODES = (GRAD_DESYNC.code, PARAM_DESYNC.code)


PER_STEP_HOOKS = ("inspect_batch", "on_before_optimizer_step", "on_step_end")

class GradSyncOptions(BaseModel):
    """Options of the ``grad_sync`` plugin."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(
        50, ge=1, description="Check every this many optimizer steps (and at step 1). A check reads every weight and gradient "
        "once on the device and gathers a few numbers per tensor over gloo.",
    )
    on_desync: Literal["warn", "stop", "rebroadcast"] = Field(
        "warn", description="What GRAD_DESYNC/PARAM_DESYNC do: warn; stop (before the step's update); or rebroadcast rank 0's "
        "weights and optimizer state to every rank after the update (DDP only; under ZeRO-1/2 a parameter desync is "
        "repaired by the step's own all-gather and a gradient desync stops; under FSDP a desync stops).",
    )
    check_params: bool = Field(True, description="Compare the weights of every rank.")
    check_grads: bool = Field(True, description="Compare the reduced gradients (DDP, HSDP: bit for bit; ZeRO-1/2, FSDP2: each slice or shard against the ranks' mean).")
    check_inputs: bool = Field(True, description="RANK_INPUTS_IDENTICAL when every rank got the same micro-batches.")
    zero_rtol: float = Field(
        1e-3, gt=0, description="ZeRO-1/2 slice check: tolerance relative to the slice's L2 norm, on top of six times the "
        "rounding of the reduction's dtype (the coarser of the gradient's and DeepSpeed's communication_data_type) per pass.",
    )
    max_tensors: int = Field(5, ge=1, description="Diverging tensors named in a finding (the evidence counts them all).")
    straggler_fraction: float = Field(
        0.1, gt=0, description="STRAGGLER_RANK when a rank's data-loader wait per step exceeds the other ranks' median by "
        "this fraction of the median step time ...",
    )
    straggler_min_seconds: float = Field(0.01, ge=0, description="... and by at least this many seconds per step ...")
    straggler_checks: int = Field(2, ge=1, description="... at this many checks in a row.")
    max_reports: int = Field(5, ge=1, description="Findings per code per run at most.")


def _module(model: Any) -> Any:
    return getattr(model, "module", model)


class GradSync(Plugin):
    """Compares weights, reduced gradients, inputs and data-loader waits across data-parallel ranks.

    Everything it reads from the device and every collective it issues
    happens on check steps only (step 1 and every ``every``); on ordinary
    steps it adds host-side timings to a window and nothing else.
    """

    name = "grad_sync"
    Options = GradSyncOptions
    CODES = (GRAD_DESYNC, PARAM_DESYNC, RANK_INPUTS_IDENTICAL, STRAGGLER_RANK, GRAD_SYNC_UNSUPPORTED)

    def __init__(self) -> None:
        self.options = GradSyncOptions()
        self.mode = "single"
        self._parallelism = Parallelism("single", "one process")
        self._group: tuple[int, ...] = ()
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        self._zero: ZeroSlices | None = None
        self._armed_step: int | None = None
        self._inputs: list[torch.Tensor] = []
        self._window = [0.0, 0.0, 0]  # data_time, step_time, steps since the last check
        self._slow_checks: Counter[int] = Counter()
        self._rebroadcast: int | None = None  # the rank to copy from after this step's update
        self._rebroadcast_step: int | None = None  # a check step after which every rank joins the rebroadcast agreement
        self._optimizer: Any = None
        self._deepspeed = False
        self._micro_batches = 0
        self._reference = 0
        self._clip = 1.0  # the clip coefficient the reduced gradients already carry at this guard (FSDP)
        self._max_norm = 0.0

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        found = self._parallelism = parallelism(trainer, ctx.world_size, ctx.rank)
        self.mode, self._described, self._group = found.mode, found.described, found.group
        described = found.described
        self._deepspeed = found.engine == "deepspeed"
        self._max_norm = float(getattr(getattr(trainer, "args", None), "max_grad_norm", 0.0) or 0.0)
        self._params = list(_module(trainer.model_wrapped).named_parameters())
        if self._zero is not None:
            self._zero.disarm()  # a second train() call: no stale hooks
        self._zero = None
        # one process (or no replicas to compare): no per-step call at all
        self.idle_hooks(*PER_STEP_HOOKS, idle=not found.active)
        if self.mode == "sharded" and found.engine == "fsdp2" and self.options.check_grads:
            self._zero = fsdp2_slices(_module(trainer.model_wrapped), self._params, ctx.rank)  # no collective: layout from shapes
        if self.mode == "unsupported" and ctx.is_main:
            self._report(ctx, GRAD_SYNC_UNSUPPORTED.code, f"grad_sync compares replicas, and under {described} there are none; "
                         "the check is off for this run (findings of other plugins are unaffected).", evidence={"parallelism": described})
        if self.mode == "sharded" and ctx.is_main:
            self._report(
                ctx, GRAD_SYNC_UNSUPPORTED.code,
                f"grad_sync compares replicas, and under {described} there are none: each rank holds its own slice of every "
                "weight, gradient and optimizer state, the all-gather gives every rank the same full weights (they cannot drift "
                "apart) and each reduced gradient slice exists on one rank only. Weights are not compared in this run; "
                + ("each rank's reduced gradient shard is checked against the mean of every rank's local gradient over that "
                   "shard (linear sums, as under ZeRO-1/2), " if self._zero is not None else
                   "gradients are not compared either (the reduce-scatter check needs FSDP2's unsharded parameters, not found "
                   "here), ")
                + "and the inputs (RANK_INPUTS_IDENTICAL) and data-loader waits (STRAGGLER_RANK) are. Under HSDP (a replicate "
                "x shard mesh) the replicas of each shard are compared bit for bit.",
                evidence={"parallelism": described, "compared": ["gradient shards"] if self._zero is not None else [],
                          "still_checked": ["inputs", "data_wait"]},
            )

    def _is_check_step(self, step: int) -> bool:
        return step == 1 or step % self.options.every == 0

    # -- the check step's micro-batches --------------------------------------------------------------------

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: Any, step: int, micro_step: int) -> None:
        if not self._parallelism.active or self.mode == "failed" or not self._is_check_step(step):
            return
        if micro_step == 0:
            self._inputs = []
            self._micro_batches = 0
            if self.mode == "zero" and self.options.check_grads:
                if self._zero is None:
                    self._zero = ZeroSlices(self._params, ctx.rank)  # collective: every rank reaches its first check step
                self._zero.arm()
                self._armed_step = step
            elif self.mode == "sharded" and self._zero is not None:
                self._armed_step = step if self._zero.arm() else None  # FSDP2: not before its first all-gather
        self._micro_batches += 1
        if self.options.check_inputs and isinstance(batch, Mapping) and torch.is_tensor(batch.get("input_ids")):
            self._inputs.append(batch_row_hashes(batch, masked_lm=ctx.masked_lm))

    # -- the comparison, inside the step guard ------------------------------------------------------------

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, model: Any, optimizer: Any, grad_norm: float | None = None) -> None:
        if not self._parallelism.active or self.mode == "failed" or not self._is_check_step(step):
            return
        self._optimizer = optimizer
        self._clip = self._clip_coefficient(grad_norm)
        self._rebroadcast = None
        # decided from config and step alone (the same on every rank), before anything that may raise on one rank
        self._rebroadcast_step = step if self.options.on_desync == "rebroadcast" and self._can_rebroadcast() else None

        def local() -> dict[str, Any]:
            try:
                return self._local_fingerprints(step, optimizer)
            finally:
                self._inputs, self._window, self._armed_step = [], [0.0, 0.0, 0], None

        gathered = all_gather_guarded(local, reraise=False)  # every rank joins, even when its fingerprints raised
        failed = failures(gathered)
        if failed:  # every rank sees it: all stop checking together
            self.mode = "failed"
            self._rebroadcast_step = None
            if ctx.is_main:
                self.report(
                    INTERNAL_PLUGIN_ERROR.code,
                    f"grad_sync could not fingerprint at step {step} (rank {failed[0].rank}: {failed[0].error}); the replica check "
                    "is off for the rest of the run on every rank. Training goes on.",
                    step=step, evidence={"errors": [f"rank {f.rank}: {f.error}" for f in failed], "traceback": failed[0].traceback},
                )
            return
        self._compare(ctx, step, gathered)

    def _clip_coefficient(self, grad_norm: float | None) -> float:
        """FSDP: the Trainer clipped the reduced shards before this guard (torch's rule), the local sums saw them unclipped.

        Under ZeRO-1/2 DeepSpeed clips inside its step, after the guard: 1.
        """
        if self.mode != "sharded" or self._max_norm <= 0 or grad_norm is None or not math.isfinite(grad_norm):
            return 1.0
        return min(1.0, self._max_norm / (grad_norm + 1e-6))

    def _local_fingerprints(self, step: int, optimizer: Any) -> dict[str, Any]:
        o = self.options
        tensors = [p for _, p in self._params]
        exact = self._parallelism.compares_tensors  # DDP, HSDP: whole tensors or shards held by every rank of a group
        mine: dict[str, Any] = {
            "params": exact_fingerprints(tensors) if o.check_params and (exact or self.mode == "zero") else None,
            "grads": exact_fingerprints([p.grad for p in tensors]) if o.check_grads and exact else None,
            # host flags, no device read: a tensor frozen on some ranks only leaves their share of the all-reduce zero,
            # and the reduced gradients still agree bit for bit
            "requires_grad": [bool(p.requires_grad) for p in tensors] if o.check_grads else None,
            "group": list(self._group),
            "inputs": [h.tolist() for h in self._inputs] if o.check_inputs else None,
            "timing": list(self._window),
            "micro_batches": self._micro_batches,
        }
        if self._zero is not None and self._armed_step == step:
            mine["zero_local"] = self._zero.disarm()
            mine["zero_owned"] = self._zero.owned(getattr(optimizer, "communication_data_type", None))
        return mine

    def _compare(self, ctx: Any, step: int, gathered: list[dict[str, Any]]) -> None:
        o = self.options
        desync = False
        groups = sorted({tuple(g.get("group") or range(len(gathered))) for g in gathered})
        if o.check_params:
            desync |= self._compare_exact(ctx, step, [g["params"] for g in gathered], PARAM_DESYNC.code, "weights", groups)
        if o.check_grads:
            desync |= self._compare_requires_grad(ctx, step, [g.get("requires_grad") for g in gathered])
            desync |= self._compare_exact(ctx, step, [g["grads"] for g in gathered], GRAD_DESYNC.code, "reduced gradients", groups)
        if self._zero is not None and all(g.get("zero_local") is not None for g in gathered):
            desync |= self._compare_zero(ctx, step, gathered)
        if o.check_inputs:
            self._compare_inputs(ctx, step, [g["inputs"] for g in gathered])
        self._compare_timing(ctx, step, [g["timing"] for g in gathered])
        self._rebroadcast = self._reference if desync and o.on_desync == "rebroadcast" and self._can_rebroadcast() else None
        if ctx.is_main:
            self._record(ctx, step, gathered, desync)

    def _record(self, ctx: Any, step: int, gathered: list[dict[str, Any]], desync: bool) -> None:
        """One line per check in ``grad_sync.jsonl``: what was compared and whether the replicas agreed."""
        record = {
            "step": step, "parallelism": self._described, "ranks": len(gathered), "in_sync": not desync,
            "replica_groups": sorted({tuple(g.get("group") or ()) for g in gathered}) if self.mode == "replicas" else None,
            "params_compared": len(self._params) if gathered[0]["params"] is not None else 0,
            "grads_compared": sum(v is not None for v in gathered[0]["grads"]) if gathered[0]["grads"] is not None else 0,
            "slices_compared": len(self._zero.pieces) if self._zero is not None and gathered[0].get("zero_local") is not None else 0,
            "data_wait_s": [round(t[0] / t[2], 6) if t[2] else None for t in (g["timing"] for g in gathered)],
        }
        shared_appender(ctx.path("grad_sync.jsonl")).write(dumps(record) + "\n")  # a full disk holds it: never raises

    def _compare_exact(self, ctx: Any, step: int, per_rank: list[list[Any] | None], code: str, what: str,
                       replica_groups: list[tuple[int, ...]]) -> bool:
        """Bit-for-bit comparison of each tensor within each replica group (DDP: one group of every rank)."""
        if any(r is None for r in per_rank):
            return False
        diverging: list[dict[str, Any]] = []
        ranks: set[int] = set()
        for index, (name, _) in enumerate(self._params):
            for members in replica_groups:
                values = {rank: per_rank[rank][index] for rank in members if rank < len(per_rank)}  # type: ignore[index]
                agreeing: dict[Any, list[int]] = {}
                for rank, value in values.items():
                    agreeing.setdefault(same_fingerprint_key(value), []).append(rank)
                if len(agreeing) <= 1:
                    continue
                majority = max(agreeing.values(), key=lambda ranks_: (len(ranks_), -min(ranks_)))
                odd = sorted(r for r in values if r not in majority)
                ranks.update(odd)
                self._reference = majority[0]
                diverging.append({
                    "tensor": name, "ranks": odd, "reference_rank": majority[0],
                    "relative_difference": _relative(values[majority[0]], [values[r] for r in odd]),
                })
        if not diverging:
            return False
        shown = diverging[: self.options.max_tensors]
        names = ", ".join(d["tensor"] for d in shown) + (f" and {len(diverging) - len(shown)} more" if len(diverging) > len(shown) else "")
        self._report(
            ctx, code,
            f"{what} differ across {'the replicas of a shard' if self.mode == 'replicas' else 'data-parallel ranks'} at step {step} "
            f"({self._described}): rank(s) {sorted(ranks)} disagree with "
            f"rank {shown[0]['reference_rank']} on {len(diverging)} of {len(self._params)} tensors, first {names}"
            + (" (these are the weights the step's forward used, after the previous update)." if code == PARAM_DESYNC.code else ".")
            + self._policy_note(code),
            step=step,
            evidence={"ranks": sorted(ranks), "tensors": shown, "diverging_tensors": len(diverging), "checked_tensors": len(self._params),
                      "parallelism": self._described, "on_desync": self.options.on_desync,
                      "replica_groups": [list(g) for g in replica_groups] if self.mode == "replicas" else None},
        )
        return True

    def _compare_requires_grad(self, ctx: Any, step: int, per_rank: list[list[bool] | None]) -> bool:
        """Every rank must train the same tensors: ``requires_grad`` per tensor, compared over all ranks (any engine).

        A tensor frozen after the engine wrapped the model, on some ranks only, passes the gradient comparison: DDP still
        all-reduces it (the frozen ranks contribute zeros, or nothing) and every rank holds the same reduced gradient.
        """
        if any(r is None for r in per_rank) or len({len(r) for r in per_rank if r is not None}) != 1:
            return False
        diverging = requires_grad_differences([n for n, _ in self._params], per_rank)  # type: ignore[arg-type]
        if not diverging:
            return False
        ranks = sorted({r for d in diverging for r in d["ranks"]})
        self._reference = diverging[0]["reference_rank"]
        shown = diverging[: self.options.max_tensors]
        more = f" and {len(diverging) - len(shown)} more" if len(diverging) > len(shown) else ""
        self._report(
            ctx, GRAD_DESYNC.code,
            f"requires_grad differs across data-parallel ranks at step {step} ({self._described}) on {len(diverging)} of "
            f"{len(self._params)} tensors: {'; '.join(d['described'] for d in shown)}{more}. The reduced gradients still agree "
            "bit for bit, yet they are wrong: DDP still all-reduces such a tensor, the ranks where it is frozen add zeros "
            "instead of a gradient of their own, so it learns from part of the batch only; and where a frozen rank's optimizer "
            "skips it, that rank's weights drift from the others'. requires_grad was changed after the model was wrapped, "
            "on some ranks only." + self._policy_note(GRAD_DESYNC.code),
            step=step,
            evidence={"ranks": ranks, "tensors": [{k: v for k, v in d.items() if k != "described"} for d in shown],
                      "diverging_tensors": len(diverging), "checked_tensors": len(self._params), "compared": "requires_grad",
                      "parallelism": self._described, "on_desync": self.options.on_desync},
        )
        return True

    def _compare_zero(self, ctx: Any, step: int, gathered: list[dict[str, Any]]) -> bool:
        zero = self._zero
        assert zero is not None
        world = len(gathered)
        owned: dict[int, list[float]] = {}
        for g in gathered:
            owned.update({int(k): v for k, v in g["zero_owned"].items()})
        diverging: list[dict[str, Any]] = []
        hops = world * max(g.get("micro_batches", 1) for g in gathered)  # roundings each element went through, at most
        for k, (index, start, numel, owner) in enumerate(zero.pieces):
            if k not in owned:
                continue
            expected = [self._clip * sum(g["zero_local"][k][j] for g in gathered) / world for j in (0, 1)]
            total, alternating, l2, unit = owned[k]
            # independent roundings of the elements add up like a random walk: about unit * L2 per pass
            tolerance = (self.options.zero_rtol + 6 * unit * math.sqrt(hops)) * l2 + 1e-30
            error = max(abs(total - expected[0]), abs(alternating - expected[1]))
            if error > tolerance:
                diverging.append({"tensor": self._params[index][0], "ranks": [owner], "slice": [start, start + numel],
                                  "owner_sum": total, "expected_sum": expected[0], "error": error, "tolerance": tolerance})
        if not diverging:
            return False
        shown = diverging[: self.options.max_tensors]
        ranks = sorted({r for d in diverging for r in d["ranks"]})
        names = ", ".join(f"{d['tensor']}[{d['slice'][0]}:{d['slice'][1]}]" for d in shown)
        self._report(
            ctx, GRAD_DESYNC.code,
            f"reduced gradients at step {step} ({self._described}) are not the mean of the ranks' gradients: the slices owned by "
            f"rank(s) {ranks} differ on {len(diverging)} of {len(zero.pieces)} slices, first {names}." + self._policy_note(GRAD_DESYNC.code),
            step=step,
            evidence={"ranks": ranks, "tensors": shown, "diverging_tensors": len(diverging), "checked_slices": len(zero.pieces),
                      "parallelism": self._described, "on_desync": self.options.on_desync},
        )
        return True

    def _can_rebroadcast(self) -> bool:
        """DDP only: DeepSpeed keeps fp32 master weights (ZeRO-0) or partitions (ZeRO-1/2), FSDP shards, that a broadcast of the weights misses."""
        return self.mode == "ddp" and not self._deepspeed

    def _action_for(self, code: str) -> str:
        policy = self.options.on_desync
        if policy == "stop":
            return "stop"
        if policy == "rebroadcast" and not self._can_rebroadcast():
            # ZeRO-1/2 re-gathers the weights from the partitions at every step; anything else cannot be repaired here
            return "continue" if self.mode == "zero" and code == PARAM_DESYNC.code else "stop"
        return "continue"

    def _policy_note(self, code: str) -> str:
        action = self._action_for(code)
        if action == "stop":
            return " Training stops before this step's update."
        if self.options.on_desync == "rebroadcast" and self._can_rebroadcast():
            return f" Rank {self._reference}'s weights and optimizer state are broadcast to every rank after this step."
        if self.options.on_desync == "rebroadcast":
            return " The step's all-gather rewrites every replica from the ZeRO partitions."
        return ""

    def _compare_inputs(self, ctx: Any, step: int, per_rank: list[list[list[int]] | None]) -> None:
        if any(not r for r in per_rank) or any(r != per_rank[0] for r in per_rank[1:]):
            return
        self._report(
            ctx, RANK_INPUTS_IDENTICAL.code,
            f"all {len(per_rank)} data-parallel ranks trained on identical micro-batches at step {step} ({len(per_rank[0])} micro-batches, "
            f"{sum(len(m) for m in per_rank[0])} rows each): the data is not sharded across ranks, so the effective batch is one "
            "rank's and the other ranks' compute is wasted.",
            step=step,
            evidence={"ranks": list(range(len(per_rank))), "micro_batches": len(per_rank[0]), "rows": sum(len(m) for m in per_rank[0])},
        )

    def _compare_timing(self, ctx: Any, step: int, per_rank: list[list[float]]) -> None:
        if len(per_rank) < 2 or any(n == 0 for _, _, n in per_rank):
            return
        data = [d / n for d, _, n in per_rank]
        step_time = statistics.median(s / n for _, s, n in per_rank)
        margin = max(self.options.straggler_min_seconds, self.options.straggler_fraction * step_time)
        for rank, wait in enumerate(data):
            others = statistics.median(data[:rank] + data[rank + 1:])
            if wait - others <= margin:
                self._slow_checks[rank] = 0
                continue
            self._slow_checks[rank] += 1
            if self._slow_checks[rank] == self.options.straggler_checks:
                self._report(
                    ctx, STRAGGLER_RANK.code,
                    f"rank {rank} waits {wait * 1000:.0f} ms per step for its data loader, the other ranks {others * 1000:.0f} ms "
                    f"(median step {step_time * 1000:.0f} ms), at {self._slow_checks[rank]} checks in a row up to step {step}: "
                    "every rank waits for it at the next collective.",
                    step=step,
                    evidence={"rank": rank, "data_wait_s": [round(d, 6) for d in data], "median_step_s": step_time,
                              "steps_in_window": per_rank[rank][2]},
                )

    def _report(self, ctx: Any, code: str, message: str, **kwargs: Any) -> None:
        """Rank 0 reports (every rank compared the same gathered values)."""
        if ctx.is_main:
            self.report(code, message, limit=self.options.max_reports, **kwargs)

    @hookimpl
    def decide_action(self, ctx: Any, finding: Any) -> str | None:
        if finding.code not in DESYNC_CODES:
            return None
        return self._action_for(finding.code)

    # -- after the update -----------------------------------------------------------------------------------

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if not self._parallelism.active or self.mode == "failed":
            return
        if self._rebroadcast_step == step:
            # every rank enters (the step was chosen before the check): a rank whose comparison or collection raised
            # still joins the agreement, and nothing is broadcast unless every rank can take part
            source, self._rebroadcast, self._rebroadcast_step = self._rebroadcast, None, None
            broadcast_guarded(self._replica_tensors, source)
        if metrics.get("step_time") is not None:
            self._window[0] += float(metrics.get("data_time") or 0.0)
            self._window[1] += float(metrics["step_time"])
            self._window[2] += 1

    def _replica_tensors(self) -> list[torch.Tensor]:
        """The weights and optimizer state a rebroadcast copies, in the same order on every rank."""
        tensors = [p.data for _, p in self._params]
        optimizer = unwrap_optimizer(self._optimizer) if self._optimizer is not None else None
        for state in (getattr(optimizer, "state", None) or {}).values():
            if isinstance(state, dict):
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """The replica checks of ``grad_sync.jsonl``: how many, how many in sync, the steps that were not."""
        from harness.lib.textsafe import md_escape
        from harness.report.model import ReportSection, md_table
        from harness.report.record import REPORT_SAMPLE_BYTES, read_jsonl

        checks = list(read_jsonl(run.run_dir / "grad_sync.jsonl", sample_bytes=REPORT_SAMPLE_BYTES))
        if not checks:
            return None
        bad = [c for c in checks if not c.get("in_sync", True)]
        first = checks[0]
        # what grad_sync.jsonl holds is data (a received run directory): escaped, never markdown or HTML of its own
        text = (f"{len(checks)} cross-rank checks ({md_escape(first.get('parallelism'))}, {md_escape(first.get('ranks'))} ranks) "
                f"between steps {md_escape(checks[0].get('step'))} and {md_escape(checks[-1].get('step'))}: "
                f"{len(checks) - len(bad)} in sync, {len(bad)} not. "
                "One line per check in [grad_sync.jsonl](grad_sync.jsonl).\n\n")
        if bad:
            text += md_table(["step", "weights compared", "gradients compared", "ZeRO slices compared"],
                             [[c.get("step"), c.get("params_compared"), c.get("grads_compared"), c.get("slices_compared")] for c in bad[:20]])
            text += "\n"
        return ReportSection("Replica consistency (grad_sync)", text)


def requires_grad_differences(names: list[str], per_rank: list[list[bool]]) -> list[dict[str, Any]]:
    """The tensors whose ``requires_grad`` is not the same on every rank: the odd ranks (the minority; a tie leaves the
    lowest rank's side as the reference), the ranks where it is frozen and where it is trained, and a sentence."""
    out: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        if index >= len(per_rank[0]):
            break
        sides: dict[bool, list[int]] = {}
        for rank, flags in enumerate(per_rank):
            sides.setdefault(bool(flags[index]), []).append(rank)
        if len(sides) <= 1:
            continue
        majority = max(sides.values(), key=lambda ranks_: (len(ranks_), -min(ranks_)))
        odd = sorted(r for r in range(len(per_rank)) if r not in majority)
        frozen, trained = sides[False], sides[True]
        described = (f"{name} is frozen on {_ranks(frozen)} only (requires_grad False there, True on {_ranks(trained)})"
                     if frozen == odd else
                     f"{name} is trained on {_ranks(trained)} only (requires_grad True there, False on {_ranks(frozen)})")
        out.append({"tensor": name, "ranks": odd, "reference_rank": majority[0], "frozen_on_ranks": frozen,
                    "trained_on_ranks": trained, "described": described})
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _relative(reference: tuple[int, float, float] | None, others: list[tuple[int, float, float] | None]) -> float | None:
    """Largest relative difference of the float64 sums of squares (how far apart the replicas are)."""
    if reference is None or any(o is None for o in others):
        return None
    base = max(abs(reference[2]), 1e-30)
    return max(abs(o[2] - reference[2]) / base for o in others if o is not None) if others else 0.0


