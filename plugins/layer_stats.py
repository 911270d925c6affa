"""layer_stats: per-block gradient, parameter, update and attention statistics every ``interval`` steps (opt-in).

Every ``interval``-th optimizer step, per transformer block (and the
embeddings, final norm and head as groups of their own): the pre-clip
gradient norm (the clipped norms divided by the Trainer's clip factor), the
parameter norm before the update, the update-to-parameter ratio
``||delta W|| / ||W||`` (from the Adam state right after the update, with
the LR it used: no copy of the model; other optimizers only with
``update_snapshot``, one transient copy of the parameters), the norm of
Adam's ``exp_avg_sq`` and the largest attention logit of the block on the
step's first micro-batch (hooks on each attention's q and k: separate
projections, their q/k norms, or a fused projection split per the model's
layout, pre-RoPE; see :mod:`harness.lib.attention_sites` and
:mod:`harness.lib.layer_attention`). Each (block, statistic) has its own
robust baseline; ``LAYER_GRAD_SURGE``, ``UPDATE_RATIO_HIGH`` and
``ATTENTION_LOGIT_GROWTH`` are reported once per episode. Blocks whose
attention logit cannot be measured (an unknown fused layout, no attention
module, a hook that gave no value) are named once, at the first measured
step, in ``ATTENTION_LOGIT_UNMEASURED`` (information) and in the report's
section: their rows' ``attn_logit_max`` is null, never silently.

No read of its own: the statistics of step N stay on the device and are
queued at step N+1's first micro-batch, so they travel in that step's one
transfer (the last step's are read at run end). Rows go to
``layer_stats.jsonl`` (flushed per step), which spike captures read to say
which layers surged first. Cost on the benchmark model (2 layers, 2 CPU
cores, a 41 ms step): a measured step adds about 19 ms (attention probe 6 ms,
norms 1 ms, the update derived from Adam state 11 ms), 0.9% of a step
amortised over the default 50 steps, and the median step is unchanged; an
ordinary step costs a few attribute checks in four hooks (tens of us).
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.appendfile import LineAppender
from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.core.strictjson import dumps
from harness.lib.attention_sites import AttentionSites, attention_sites
from harness.lib.layer_attention import AttentionProbe
from harness.lib.layer_baseline import LayerBaselines
from harness.lib.layer_groups import LayerGroups, is_block
from harness.lib.layer_history import FILE, WORDS
from harness.lib.layer_measure import Snapshot, adam_update_norms, grad_param_norms, inner_optimizer, is_adam
from harness.lib.layer_rows import COLUMNS, Flag, describe_flags, judge_step

LAYER_GRAD_SURGE = FindingCode(
    "LAYER_GRAD_SURGE", Severity.WARNING, "A block's gradient norm rose far above its own baseline.", "layer-stats#layer_grad_surge"
)
UPDATE_RATIO_HIGH = FindingCode(
    "UPDATE_RATIO_HIGH", Severity.WARNING, "A block's update-to-weight ratio is above its limit or far above its baseline.",
    "layer-stats#update_ratio_high",
)
ATTENTION_LOGIT_GROWTH = FindingCode(
    "ATTENTION_LOGIT_GROWTH", Severity.WARNING, "A block's largest attention logit is above its limit or far above its baseline.",
    "layer-stats#attention_logit_growth",
)
ATTENTION_LOGIT_UNMEASURED = FindingCode(
    "ATTENTION_LOGIT_UNMEASURED", Severity.INFO,
    "Some blocks' largest attention logit is not measured (their attn_logit_max rows are null); the finding says why.",
    "layer-stats#attention_logit_unmeasured",
)
CODE_OF = {"grad_norm": LAYER_GRAD_SURGE, "update_ratio": UPDATE_RATIO_HIGH, "attn_logit_max": ATTENTION_LOGIT_GROWTH}
COOL_DOWN = 3  # clean measurements in a row that end an episode (one more flag in between is the same episode)
log = logging.getLogger("harness.layer_stats")


class LayerStatsOptions(BaseModel):
    """Options of the ``layer_stats`` plugin."""

    model_config = ConfigDict(extra="forbid")

    interval: int = Field(50, ge=1, description="Measure every interval-th optimizer step.")
    window: int = Field(20, ge=5, description="Measurements per block and statistic kept in its baseline.")
    min_history: int = Field(5, ge=3, description="Measurements a baseline must hold before a block is judged against it.")
    level_steps: int = Field(5, ge=1, description="The baseline level is the median of the last level_steps measurements.")
    z: float = Field(6.0, gt=0, description="A statistic left its baseline when it is this many robust SDs above the median ...")
    min_ratio: float = Field(3.0, ge=1, description="... and at least this multiple of the median.")
    warmup_steps: int = Field(
        20, ge=0, description="No finding for steps up to warmup_steps: early statistics swing widely (outliers still stay out)."
    )
    patience: int = Field(5, ge=2, description="Measurements in a row out of the baseline after which they are its new level.")
    max_update_ratio: float = Field(1e-2, gt=0, description="UPDATE_RATIO_HIGH when a block's ||delta W||/||W|| exceeds this.")
    max_attn_logit: float = Field(100.0, gt=0, description="ATTENTION_LOGIT_GROWTH when a block's largest attention logit exceeds this.")
    attention: bool = Field(True, description="Measure the largest attention logit (q/k projection hooks on one micro-batch).")
    update_snapshot: bool = Field(
        False, description="For optimizers other than Adam/AdamW: copy the parameters before a measured update to get its "
        "ratio (one transient copy of the trainable parameters). Off: no update ratio for them.",
    )
    max_findings: int = Field(20, ge=1, description="Findings per code per run at most.")


class LayerStats(Plugin):
    """Per-block statistics every interval steps, their baselines, findings and layer_stats.jsonl."""

    name = "layer_stats"
    Options = LayerStatsOptions
    CODES = (LAYER_GRAD_SURGE, UPDATE_RATIO_HIGH, ATTENTION_LOGIT_GROWTH, ATTENTION_LOGIT_UNMEASURED)
    options: LayerStatsOptions

    def __init__(self) -> None:
        self.options = LayerStatsOptions()
        self.groups = LayerGroups()
        self._file: LineAppender | None = None  # a full disk holds its lines: never raises into training
        self._handles: list[Any] = []
        self._reset()

    def _reset(self) -> None:
        o = self.options
        self.baselines = LayerBaselines(o.window, o.min_history, o.level_steps, o.z, o.min_ratio, o.patience)
        self.episodes: dict[str, int] = {}  # code -> clean measurements in a row since its last flag (absent: no episode)
        self.measured = 0
        self._measure: dict[str, Any] | None = None  # the step being measured: its device tensors so far
        self._pending: tuple[int, torch.Tensor] | None = None  # a measured step waiting for the next step's read
        self._awaiting: int | None = None  # the step whose values this step's read carries
        self.attention = AttentionSites()
        self._unmeasured_said = False

    def setup(self, ctx: Any) -> None:
        self._reset()

    # -- run start and end ------------------------------------------------------------------------------

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._reset()
        self._close()
        if not ctx.is_main:
            return  # data-parallel replicas hold the same weights and gradients: rank 0 measures them
        model = trainer.model
        self.groups = LayerGroups.of(model)
        if not self.groups.params:
            return
        self._index = torch.tensor(self.groups.index, device=self.groups.params[0].device)
        self._position = {id(p): i for p, i in zip(self.groups.params, self.groups.index)}
        self.attention = attention_sites(model, self.groups.names) if self.options.attention else AttentionSites()
        self.probe = AttentionProbe(self.attention.sites)
        self.optimizer = inner_optimizer(getattr(trainer, "optimizer", None))
        self.adam = is_adam(self.optimizer)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            self._handles = [self.optimizer.register_step_pre_hook(self._before_update),
                             self.optimizer.register_step_post_hook(self._after_update)]
        self._file = LineAppender(ctx.path(FILE))
        update = "from the Adam state" if self.adam else "by snapshot" if self.options.update_snapshot else "not measured"
        log.info("layer_stats: %d groups (%d blocks with attention probes) every %d steps; update ratio %s",
                 len(self.groups), len(self.attention.blocks), self.options.interval, update)

    @hookimpl
    def on_run_end(self, ctx: Any) -> None:
        if self._pending is not None:  # the last measured step: no later step carries it, and a read is fine now
            step, values = self._pending
            self._pending = None
            self._judge(ctx, step, values.cpu().tolist())
        self._close()

    def _close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self, "probe", None) is not None:
            self.probe.remove()
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- checkpoints ---------------------------------------------------------------------------------

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any]:
        return {"baselines": self.baselines.state(), "episodes": self.episodes, "measured": self.measured}

    @hookimpl
    def on_resume(self, ctx: Any, state: dict[str, Any] | None) -> None:
        if state:
            self.baselines.restore(state.get("baselines", {}))
            self.episodes = {str(k): int(v) for k, v in state.get("episodes", {}).items()}
            self.measured = int(state.get("measured", 0))

    # -- the step: queue the last measurement, probe attention, measure ---------------------------------

    def _due(self, step: int) -> bool:
        return self._file is not None and step % self.options.interval == 0

    @hookimpl
    def inspect_batch(self, ctx: Any, step: int, micro_step: int) -> None:
        if micro_step != 0:
            return
        if self._pending is not None:  # step N's statistics ride in this step's one transfer
            self._awaiting, values = self._pending
            self._pending = None
            self.defer("stats", values)
        if self._due(step) and self.probe.sites:
            self.probe.install()

    @hookimpl
    def on_loss(self, step: int, micro_step: int) -> None:
        if micro_step == 0 and self._file is not None and self.probe.installed:
            self.probe.remove()  # before backward: a checkpointing recompute must not measure again

    @hookimpl(tryfirst=True)  # before spike_capture reads layer_stats.jsonl at the same step
    def on_before_optimizer_step(self, ctx: Any, step: int, grad_norm: float | None) -> None:
        if self._awaiting is not None:
            awaited, self._awaiting = self._awaiting, None
            values = self.deferred("stats")
            if values:
                self._judge(ctx, awaited, values[-1])
        if not self._due(step):
            return
        grads, params = grad_param_norms(self.groups.params, self._index, len(self.groups))
        clip = getattr(getattr(ctx.trainer, "args", None), "max_grad_norm", None)
        if grads is not None and clip and grad_norm is not None and math.isfinite(grad_norm) and grad_norm > clip:
            grads = grads * ((grad_norm + 1e-6) / clip)  # the Trainer scaled every gradient by clip / (norm + 1e-6)
        attention = dict(self.probe.results)
        self._say_unmeasured(step, attention)
        self.probe.results, self.probe.failures, self.probe.done = {}, {}, set()
        self._measure = {"step": step, "grad": grads, "param": params, "attention": attention}

    def _say_unmeasured(self, step: int, measured: dict[int, Any]) -> None:
        """Once per run, at the first measured step: the blocks without an attention logit, and why (host values only)."""
        if self._unmeasured_said or not self.options.attention:
            return
        self._unmeasured_said = True
        why: dict[str, str] = dict(self.attention.unmeasured)
        for index, site in enumerate(self.probe.sites):
            if index not in self.probe.done:  # T5's cross-attention may fail while its block's self-attention is measured
                reason = self.probe.failures.get(index, "its hooks did not fire (not called in that micro-batch)")
                why.setdefault(site.name, f"no value at step {step}: {reason}")
        if not why:
            return
        every = [i for i, name in enumerate(self.groups.names) if is_block(name)]
        blocks = [self.groups.names[i] for i in every if i not in measured]
        listed = "; ".join(f"{name}: {reason}" for name, reason in list(why.items())[:4])
        more = f"; and {len(why) - 4} more" if len(why) > 4 else ""
        self.report(
            ATTENTION_LOGIT_UNMEASURED.code,
            f"the attention logits of {len(why)} attention(s) or block(s) are not measured ({listed}{more}): {len(blocks)} of "
            f"{len(every)} blocks have attn_logit_max null in {FILE} (a block with several attentions gets the largest of those "
            "measured); the other statistics are measured as usual.",
            step=step, evidence={"blocks": blocks, "why": why, "measured_blocks": len(measured), "rows": FILE}, limit=1,
        )

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: the LR and weight decay this update really uses (after any change made to them)."""
        m = self._measure
        if m is None:
            return
        m["hyper"] = [(g["lr"], g.get("weight_decay", 0.0)) for g in optimizer.param_groups]
        if not self.adam and self.options.update_snapshot:
            m["snapshot"] = Snapshot(self.groups.params)

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step post-hook: the applied update per group, derived on the device."""
        m = self._measure
        if m is None or "hyper" not in m:
            return
        groups = len(self.groups)
        if self.adam:
            norms = adam_update_norms(optimizer, m["hyper"], self._position, self._index.device, groups)
            if norms is not None:
                m["update"], _, m["moment"] = norms
        elif "snapshot" in m:
            m["update"], _ = m.pop("snapshot").update_norms(self.groups.params, self._index, groups)

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        m, self._measure = self._measure, None
        if m is None or m["step"] != step:
            return
        params: torch.Tensor = m["param"]
        nan = torch.full_like(params, math.nan)
        update = m.get("update") if not metrics.get("skipped") else None
        attention = nan.clone()
        for index, value in m["attention"].items():
            attention[index] = value
        columns = {
            "grad_norm": m["grad"] if m["grad"] is not None else nan,
            "param_norm": params,
            "update_norm": update if update is not None else nan,
            "update_ratio": update / params.clamp_min(1e-30) if update is not None else nan,
            "exp_avg_sq_norm": m.get("moment", nan),
            "attn_logit_max": attention,
        }
        self._pending = (step, torch.stack([columns[c].to(params.dtype) for c in COLUMNS], dim=1))

    # -- judging, rows and findings (host values) --------------------------------------------------------

    def _judge(self, ctx: Any, step: int, values: list[list[float]]) -> None:
        o = self.options
        self.measured += 1
        limits = {"update_ratio": o.max_update_ratio, "attn_logit_max": o.max_attn_logit}
        judged = judge_step(step, self.groups.names, values, self.baselines, limits)
        if self._file is not None:
            self._file.write("".join(dumps(r) + "\n" for r in judged.rows))  # strict JSON ("nan", "inf")
        for metric, flags in judged.flags.items():
            code = CODE_OF[metric].code
            if not flags:
                if code in self.episodes:
                    self.episodes[code] += 1
                    if self.episodes[code] >= COOL_DOWN:
                        del self.episodes[code]  # the episode is over: the next flag is a new one
                continue
            started = code not in self.episodes
            self.episodes[code] = 0
            if started and step > o.warmup_steps:
                self._report(ctx, step, metric, CODE_OF[metric], flags)

    def _report(self, ctx: Any, step: int, metric: str, code: FindingCode, flags: list[Flag]) -> None:
        o = self.options
        flags = sorted(flags, key=lambda f: -(f.ratio or 0.0))
        limit = {"update_ratio": o.max_update_ratio, "attn_logit_max": o.max_attn_logit}.get(metric)
        self.report(
            code.code,
            f"{WORDS[metric]} at step {step}: {describe_flags(flags, limit)} (measured every {o.interval} steps; {len(flags)} of "
            f"{len(self.groups)} groups).",
            step=step,
            evidence={"metric": metric, "step": step, "blocks": [f.as_dict() for f in flags], "limit": limit,
                      "interval": o.interval, "rows": FILE},
            limit=o.max_findings,
        )

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """Per-block figures (report/plots/layer_stats-*.png) and sparklines as their text fallback, from layer_stats.jsonl alone."""
        from harness.lib.layer_plots import layer_figures
        from harness.lib.layer_sparks import layer_table
        from harness.report.model import ReportSection

        table = layer_table(run.run_dir)  # the figures are drawn by the report, and only when it draws plots
        if not table:
            return None
        unmeasured = next((f for f in run.findings if f.code == ATTENTION_LOGIT_UNMEASURED.code), None)
        if unmeasured is not None:  # the one line that says why some max attention logits are missing
            table += f"\nNot measured: {unmeasured.message} (`{ATTENTION_LOGIT_UNMEASURED.code}`)\n"
        return ReportSection("Layer statistics", table, self.name, tuple(layer_figures(run.run_dir, run.findings)))


__all__ = ["LayerStats", "LayerStatsOptions"]
