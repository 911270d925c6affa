"""The run context handed to every hook, and the findings hub behind ``ctx.report``."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from harness.core.actions import Action, strongest
from harness.core.appendfile import HOLD_BYTES, OUTAGES
from harness.core.codes import RUN_DIR_WRITE_FAILED
from harness.core.console import Console
from harness.core.deferred import DeferredReads
from harness.core.errors import HarnessError
from harness.core.distributed import DistInfo, all_reduce_max, alone, exchange_rows, gather_to_main
from harness.core.exchange import StepExchange
from harness.core.findings import Finding, FindingCode, FindingsFile, Severity, findings_path, iter_findings
from harness.core.manager import HarnessPluginManager
from harness.core.options import ResolvedConfig
from harness.core.protocols import PluginContext  # noqa: F401 - re-exported: it was defined here

UNDECIDED_CODES = frozenset({"ACTION_TAKEN", "INTERNAL_PLUGIN_ERROR", "PLUGIN_DISABLED", "PLUGIN_STOP", "SKIP_NOT_APPLIED", "ROLLBACK_PERFORMED", "ROLLBACK_EXHAUSTED"})


class FindingsHub:
    """Writes findings where they are made and brings other ranks' findings to rank 0 once.

    Rank 0 appends to ``findings.jsonl``. Other ranks append to
    ``ranks/findings.rank-<r>.jsonl`` at once (so a kill loses nothing) and
    queue the finding; the queue is gathered to rank 0 at the next point
    where all ranks meet, and rank 0's file drops ids it already holds.
    What no such point carries (a finding made in ``on_run_end``, after the
    last one; a watchdog's off-thread finding; a queue a crash cut off) rank 0
    copies from the spill files at the end of the call, with no collective
    (:meth:`merge_rank_files`): the same ids, so each lands once.
    """

    def __init__(self, run_dir: Path, dist: DistInfo) -> None:
        self.dist = dist
        self.run_dir = Path(run_dir)
        self.file = FindingsFile(findings_path(run_dir, 0 if dist.is_main else dist.rank))
        self.outbox: list[str] = []
        self._earlier: set[str] = set()  # ids the spill files held when this train() call began (rank 0)

    def _rank_files(self) -> list[Path]:
        """This job's other ranks' spill files (a larger earlier job's are left to the report, which reads them all)."""
        return [findings_path(self.run_dir, rank) for rank in range(1, self.dist.world_size)]

    def note_rank_files(self) -> None:
        """Rank 0, as a train() call begins: remember the findings other ranks' spill files already hold (an earlier call's)."""
        if not self.dist.is_main:
            return
        self._earlier = {f.id for path in self._rank_files() if path.is_file() for f in iter_findings(path)}

    def merge_rank_files(self) -> tuple[list[Finding], list[Finding]]:
        """Rank 0: append the findings of other ranks' spill files that ``findings.jsonl`` lacks.

        Returns ``(made in this call, left over from an earlier one)``, both
        now in ``findings.jsonl`` (an earlier call's: a rank 0 killed before
        it could copy them). Reads files only: a rank that is gone blocks
        nothing; a torn last line (a rank still writing, or killed) is skipped.
        """
        if not self.dist.is_main:
            return [], []
        current: list[Finding] = []
        earlier: list[Finding] = []
        for path in self._rank_files():
            if not path.is_file():
                continue
            for finding in iter_findings(path):
                if self.file.append(finding):
                    (earlier if finding.id in self._earlier else current).append(finding)
        return current, earlier

    def record(self, finding: Finding) -> None:
        self.file.append(finding)
        if not self.dist.is_main:
            self.outbox.append(finding.to_json())

    def exchange(self) -> list[Finding]:
        """Collective: every rank sends its queue; rank 0 writes what is new and returns it."""
        import json

        sent, self.outbox = self.outbox, []
        gathered = gather_to_main(sent)
        if gathered is None:
            return []
        received = [Finding.from_dict(json.loads(line)) for per_rank in gathered[1:] for line in per_rank or []]
        return [f for f in received if self.file.append(f)]

    def close(self) -> None:
        self.file.close()


class RunContext:
    """What every hook gets first: where the run is, its config, and how to report a finding."""

    def __init__(
        self,
        config: ResolvedConfig,
        codes: dict[str, FindingCode],
        manager: HarnessPluginManager,
        run_dir: Path,
        dist: DistInfo,
    ) -> None:
        self.config = config
        self.options = config.model
        self.codes = codes
        self.manager = manager
        self.run_dir = Path(run_dir)
        self.dist = dist
        self.rank = dist.rank
        self.world_size = dist.world_size
        self.is_main = dist.is_main
        self.trainer: Any = None
        self.step = 0
        self.micro_step = 0
        self.resumed_from: Path | None = None
        self.unsaved_states: dict[int, str] = {}  # step -> why this rank's harness state of that save was not written
        self.run_dir_recreated = False  # the run directory was deleted mid-run and made again (said once)
        # the batches are masked-LM ones (the HF layer decides at the run's start, harness.lib.hashing.masked_lm_run):
        # a sample is hashed from its original tokens, which the labels hold where the collator masked the input
        self.masked_lm = False
        self.recent_batches: deque[tuple[int, int, dict[str, Any]]] = deque(maxlen=config.model.recent_batches)
        # this optimizer step's micro-batches as the loss saw them, (micro_step, batch) in order: one list kept by the
        # loop for every plugin that needs them at the guard (nan_guard, spike_capture, rerun), instead of one on_loss
        # call per plugin per micro-batch; emptied when the next step begins
        self.step_batches: list[tuple[int, dict[str, Any]]] = []
        self.findings: list[Finding] = []
        self.pending_action = Action.CONTINUE
        self.after_update = Action.CONTINUE  # save_and_stop / stop asked for after this step's update (stop_after_update)
        self.after_update_cause: Finding | None = None
        self.status = "running"
        self.stage: str | None = None  # set by the stage runner; otherwise inferred from the trainer class
        # why this train() call's data differs on purpose from its checkpoint's (a rollback that left rows out): the
        # checks that compare the data after a resume with the interrupted run's hold their findings
        self.data_edit: str | None = None
        self._hub = FindingsHub(self.run_dir, dist)
        self._in_on_finding = False
        self.console = Console(config.model.console, is_main=dist.is_main)  # live lines on rank 0's stderr
        # who else hears of each metric and announced finding (the HF layer's tracker feed); an observer never raises
        self.metric_observers: list[Callable[[dict[str, Any]], None]] = []
        self.finding_observers: list[Callable[[Finding], None]] = []
        self.reads = DeferredReads()  # device tensors read once per step, at the guard
        self.exchange = StepExchange()  # plugin payloads riding the guard's one collective
        self._layout_checked = False
        manager.defer_disabling = dist.world_size > 1  # a failing plugin is switched off on every rank together, in agree()

    # -- paths ------------------------------------------------------------------------------

    def path(self, *parts: str) -> Path:
        """A path under the run directory, its parent created."""
        target = self.run_dir.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    # -- metrics -------------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Emit metrics for the trackers (the ``on_metrics`` hook), at ``step`` or the current step."""
        self.manager.hooks.on_metrics(self, self.step if step is None else step, metrics)
        self._tell(self.metric_observers, metrics)

    # -- one device read and one exchange per step ------------------------------------------------

    def _owner(self, owner: str | None) -> str:
        return owner or self.manager.current_plugin or "harness"

    def defer(self, key: str, tensor: Any, *, owner: str | None = None) -> None:
        """Queue a device tensor; the step guard reads every queued tensor in one transfer (``deferred``)."""
        self.reads.defer(self._owner(owner), key, tensor)

    def deferred(self, key: str, *, owner: str | None = None) -> list[Any]:
        """Host values of ``key`` from the last read (one per ``defer`` call, in order; [] if none)."""
        return self.reads.values(self._owner(owner), key)

    def read_deferred(self) -> None:
        """The step's one device-to-host transfer (called by the step guard, and at step end if no guard ran)."""
        self.reads.read(on_error=lambda owner, exc: self.manager.record_error(owner, "defer", exc))

    def start_step(self) -> None:
        """A new optimizer step begins: tensors queued and payloads shared for a step that died half-way are dropped."""
        self.reads.drop_pending()
        self.exchange.drop_outgoing()
        self.step_batches = []

    def reserve(self, key: str, capacity: int, *, owner: str | None = None) -> None:
        """A fixed slot of ``capacity`` int64s in every step's exchange (in ``on_run_start``, on every rank)."""
        self.exchange.reserve(self._owner(owner), key, capacity)

    def share(self, key: str, values: Sequence[int], *, owner: str | None = None) -> None:
        """Contribute integers to this step's exchange (before the guard's agreement)."""
        self.exchange.share(self._owner(owner), key, values)

    def shared(self, key: str, *, owner: str | None = None) -> list[list[int] | None] | None:
        """Every rank's contribution of ``key`` at the last agreement (rank order), or None."""
        return self.exchange.received(self._owner(owner), key)

    def shared_cut(self, key: str, *, owner: str | None = None) -> list[int]:
        """Ranks whose contribution of ``key`` was longer than its slot at the last agreement (their values arrived cut)."""
        return self.exchange.cut_ranks(self._owner(owner), key)

    def stop_after_update(self, save: bool = True, cause: Finding | None = None) -> None:
        """Save a checkpoint (or not) and stop once this step's update is applied: nothing trained is lost.

        Unlike a finding's ``save_and_stop`` (which holds the step's update
        back: the step is suspect), the step completes and its checkpoint holds
        it. With several ranks call it where every rank decides alike: in
        ``on_step_agreed`` from the shared values (e.g. a preemption signal one
        rank got), so that every rank saves at the same step.
        """
        wanted = Action.SAVE_AND_STOP if save else Action.STOP
        if self.after_update is Action.CONTINUE or wanted is Action.SAVE_AND_STOP:
            self.after_update, self.after_update_cause = wanted, cause or self.after_update_cause

    def take_after_update(self) -> tuple[Action, Finding | None]:
        """The stop asked for after this step's update (and its cause), cleared (the bridge, at step end)."""
        asked, cause = self.after_update, self.after_update_cause
        self.after_update, self.after_update_cause = Action.CONTINUE, None
        return asked, cause

    # -- findings -----------------------------------------------------------------------------

    def report(
        self,
        code: str,
        message: str,
        *,
        step: int | None = None,
        evidence: dict[str, Any] | None = None,
        severity: Severity | str | None = None,
        plugin: str | None = None,
    ) -> Finding:
        """Make a finding: written to disk at once, its action decided, ``on_finding`` fired."""
        declared = self.codes.get(code)
        if declared is None:
            raise ValueError(f"finding code '{code}' was not declared by any plugin (declare it in declare_codes()).")
        override = self.options.severity.get(code)
        finding = Finding(
            code=code,
            severity=Severity(override or severity or declared.severity),
            plugin=plugin or self.manager.current_plugin or "harness",
            message=message,
            step=self.step if step is None else step,
            rank=self.rank,
            evidence=dict(evidence or {}),
            playbook=declared.playbook,
        )
        action = self._decide(finding)
        finding.action = action.value
        self._hub.record(finding)
        self.findings.append(finding)
        self.pending_action = strongest(self.pending_action, action)
        self._announce(finding)
        return finding

    def _decide(self, finding: Finding) -> Action:
        if finding.code in UNDECIDED_CODES:
            return Action.CONTINUE
        chosen = self.options.policy.get(finding.code)
        if chosen is not None:
            return Action(chosen)
        answer = self.manager.hooks.decide_action(self, finding)
        if answer is None:
            return Action.CONTINUE
        plugin, value = answer
        try:
            return Action(value)
        except ValueError:
            valid = ", ".join(a.value for a in Action)
            self.manager.record_error(plugin, "decide_action", ValueError(f"decide_action returned {value!r} for {finding.code}; valid actions: {valid}"))
            return Action.CONTINUE

    def _announce(self, finding: Finding) -> None:
        self.console.show(finding)  # rank 0: this rank's findings and, through collect_findings, the other ranks'
        self._tell(self.finding_observers, finding)
        if self._in_on_finding:
            return
        self._in_on_finding = True
        try:
            self.manager.hooks.on_finding(self, finding)
        finally:
            self._in_on_finding = False

    @staticmethod
    def _tell(observers: list[Callable[[Any], None]], item: Any) -> None:
        for observe in observers:
            try:
                observe(item)
            except Exception:  # noqa: BLE001 - an observer (a tracker) is never worth a finding lost or a step
                pass

    def note_write_outages(self, final: bool = False) -> None:
        """Retry what the run's files hold while their folder could not be written (every few seconds; all of it at
        ``final``), and record each outage that is over as a ``RUN_DIR_WRITE_FAILED`` finding. At ``final`` an outage
        still going on is recorded too (held, it is written if the folder takes writes before the process ends)."""
        OUTAGES.retry(force=final)
        over = OUTAGES.take_over() + (list(OUTAGES.active.values()) if final else [])
        for outage in over:
            seconds = (outage.until or time.time()) - outage.since
            how = "until the end of the run" if outage.until is None else f"for {seconds:.0f} s"
            lost = (f"; {outage.dropped} line(s) past the {HOLD_BYTES >> 20} MB a file may hold were dropped"
                    if outage.dropped else "; nothing was lost")
            self.report(
                RUN_DIR_WRITE_FAILED.code,
                f"the harness could not write to {outage.folder} {how} ({outage.error}, errno {outage.errno}); training "
                f"went on, and what the harness wrote there meanwhile ({', '.join(sorted(outage.files))}) was held in "
                f"memory and written once it could{lost}.",
                plugin="harness",
                evidence={"folder": outage.folder, "errno": outage.errno, "error": outage.error, "since": round(outage.since, 3),
                          "until": None if outage.until is None else round(outage.until, 3), "seconds": round(seconds, 1),
                          "dropped_lines": outage.dropped, "files": sorted(outage.files)},
            )

    def agree(self) -> Action:
        """Collective at the step guard: the strongest pending action of all ranks, findings moved to rank 0.

        The same all-gather (the step's one collective) carries one vote per
        plugin, so that a plugin past its error limit on any rank is switched
        off on every rank here, at once, and the plugins' shared payloads
        (``ctx.share``), which ``ctx.shared`` then returns on every rank.
        """
        votes: list[int]
        if OUTAGES.active or OUTAGES.over:  # a folder of the run could not be written: retry, and record it once over
            self.note_write_outages()
        if self.world_size == 1 and alone():  # the exchange would hand this rank its own row back (and meets nobody)
            self.exchange.loop_back()
            agreed, outgoing = self.pending_action, len(self._hub.outbox)
            votes = self.manager.disabling_votes() if self.manager.has_disabling_votes() else []
        else:
            header = [self.pending_action.level, len(self._hub.outbox), *self.manager.disabling_votes()]
            if self.world_size > 1 and not self._layout_checked:
                self._check_layout(len(header))
            headers = self.exchange.unpack(exchange_rows(self.exchange.pack(header)), len(header))
            level, outgoing, *votes = [max(column) for column in zip(*headers)]
            agreed = Action.from_level(level)
        if outgoing:
            self.collect_findings()
        if any(votes):  # no vote switches nothing off: skip the pass over every plugin
            self._switch_off(votes, "step guard")
        self.pending_action = Action.CONTINUE
        return agreed

    def _check_layout(self, header_width: int) -> None:
        """Once, at the first guard: every rank's row has the same width (else the all-gather would fail or hang)."""
        self._layout_checked = True
        width = header_width + self.exchange.width
        widest, narrowest = all_reduce_max([width, -width])
        if widest != -narrowest:
            raise HarnessError(
                f"the ranks' step exchanges differ in size (this rank {width}, others between {-narrowest} and {widest} "
                "int64s): a plugin reserved a slot (ctx.reserve) on some ranks only. Fix: reserve in on_run_start on every "
                "rank, before anything that can fail on one rank; the reservations made here: "
                + (", ".join(f"{o}/{k}" for o, k in self.exchange.keys()) or "none")
            )

    def _switch_off(self, votes: list[int], where: str) -> None:
        """Disable the plugins some rank voted off (every rank alike); rank 0 reports each once."""
        names = self.manager.apply_disabling_votes(votes)
        if not names or not self.is_main:
            return
        for name in names:
            errors = [f for f in self.findings if f.code == "INTERNAL_PLUGIN_ERROR" and f.plugin == name]
            ranks = sorted({f.rank for f in errors if f.rank is not None})
            last = errors[-1].evidence.get("hook") if errors else None
            self.report(
                "PLUGIN_DISABLED",
                f"plugin '{name}' reached max_plugin_errors ({self.manager.max_errors_per_plugin}) on rank(s) "
                f"{ranks if ranks else 'another rank'}{f' (last in {last}())' if last else ''} and is switched off on every rank "
                f"for the rest of the run, from the {where} of step {self.step} on (all ranks together, so no rank waits in a "
                "collective the others skip).",
                evidence={"ranks_with_errors": ranks, "errors_on_rank_0": self.manager.error_count(name),
                          "max_plugin_errors": self.manager.max_errors_per_plugin, "agreed_at": where, "hook": last},
                plugin=name,
            )

    def collect_findings(self) -> None:
        """Collective: bring queued findings of other ranks to rank 0 (which announces them)."""
        self._take_in(self._hub.exchange())

    def flush_findings(self) -> None:
        """At the end of the training loop: drop the queue of findings no step exchange carried. No collective.

        Every finding of another rank is in its spill file already, and rank 0
        copies those files in at the run end (:meth:`merge_rank_findings`),
        with a bounded wait for the other ranks. A collective here assumed
        that every rank ends its loop together; a rank whose data ran out a
        step early (uneven shards) then waited in it while the others were in
        the next step's gradient all-reduce, and a job that fails in seconds
        without the harness hung until the process group's timeout.
        """
        self._hub.outbox.clear()

    def note_rank_findings(self) -> None:
        """Rank 0, as a train() call begins: what other ranks' spill files already hold is not this call's news."""
        self._hub.note_rank_files()

    def merge_rank_findings(self) -> list[Finding]:
        """Rank 0, at the end of a train() call: other ranks' findings that no exchange carried, into ``findings.jsonl``.

        No collective (a rank may be gone): rank 0 reads the spill files, once
        the other ranks' run ends are over or waited for. The findings made in
        this call are announced (console, ``on_finding``, trackers) as the
        exchange would have; an earlier call's are only written. Returns the
        findings appended.
        """
        current, earlier = self._hub.merge_rank_files()
        self._take_in(current)
        return current + earlier

    def _take_in(self, arrived: list[Finding]) -> None:
        """Rank 0: other ranks' findings, newly in ``findings.jsonl``, join this run's list and are announced."""
        for finding in arrived:
            self.findings.append(finding)
            self._announce(finding)

    def write_findings_again(self) -> None:
        """This rank's findings file was removed and made anew (``harness.hf.run_dir_recovery``): what this process
        holds goes into it again (rank 0: every rank's findings it has; another rank: its own)."""
        self._hub.file.write_again([f for f in self.findings if self.is_main or f.rank == self.rank])

    def close(self) -> None:
        self._hub.close()
