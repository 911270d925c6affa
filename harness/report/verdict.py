"""The one-line verdict, and the general symptoms the numbers point at.

Verdict: ``running`` when the last ``train()`` call has not ended and its process holds the run
lock on this host now; ``failed`` when it did not complete (crashed, interrupted,
stopped by a plugin, killed) or a finding is critical; ``needs attention``
when a finding is at warning or above; ``healthy`` otherwise.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from harness.core.findings import Severity, worst
from harness.lib.rank_markers import first_failure
from harness.lib.rundir import LockHolder
from harness.lib.runinfo import RUN_FILE, UNREADABLE
from harness.lib.trainer_kind import token_loss_named, token_loss_stage
from harness.report.record import INTERRUPTED, RunRecord, as_float, error_text

HEALTHY, ATTENTION, FAILED = "healthy", "needs attention", "failed"
RUNNING = "running"  # the last train() call has not ended: its process holds the run lock on this host now


@dataclass(frozen=True)
class Verdict:
    label: str
    reason: str

    def line(self) -> str:
        return f"{self.label}: {self.reason}"


@dataclass(frozen=True)
class Symptom:
    """A general playbook the metrics point at (the harness cannot prove it alone)."""

    topic: str  # playbook file stem
    why: str


def verdict_of(run: RunRecord) -> Verdict:
    status = run.last_status
    step = run.attempt_end_step(-1)  # the last train() call's own step, not the highest step of any attempt
    at = f" at step {step}" if step is not None else ""
    which = _attempt_text(run)
    attempt = f" ({which})" if which else ""
    severe = [f for f in run.findings if f.severity >= Severity.WARNING]
    counts = Counter(f.code for f in severe)
    counts.update({code: n for (code, severity), n in run.left_out.items() if severity >= Severity.WARNING})  # counted, not held
    codes = ", ".join(f"{code} x{n}" if n > 1 else code for code, n in counts.most_common(4))
    codes += ", ..." if len(counts) > 4 else ""
    summary = f"{sum(counts.values())} finding(s) at warning or above ({codes})" if severe else "no finding at warning or above"
    if not run.findings_known:  # "no finding" would be a claim about findings nobody read
        summary = (f"{summary} in the files that could be read, but {run.findings_unknown}, so there may be more" if severe
                   else f"findings not known: {run.findings_unknown}")
    ranks = rank_failure(run, -1)  # with several processes: the rank that failed first, and why
    if status == "killed":  # no end recorded: still training (its process holds the run lock on this host), or killed
        crashed = f"; {ranks}" if ranks else ""
        step = run.last_known_step(-1)  # steps.jsonl comes in batches: metrics.jsonl and the ledger may know a later step
        holder = run.lock_holder()
        if holder is not None and holder.alive:
            so_far = f"at step {step} so far" if step is not None else "no step recorded yet"
            return Verdict(RUNNING, f"the last train() call is in progress (pid {holder.pid} on this host"
                                    f"{'; ' + which if which else ''}), {so_far}{crashed}; {summary}.")
        at = f" at step {step} or later (the last step recorded)" if step is not None else ""
        return Verdict(FAILED, f"the last train() call never reached its end{at}: {_not_running(holder)}{attempt}{crashed}; {summary}.")
    after = f" after step {step}" if step is not None else ""  # global_step: the last step that completed, not the one in flight
    if status == INTERRUPTED:  # Ctrl-C: the person at the terminal ended it, training did not crash
        return Verdict(FAILED, f"training was interrupted (Ctrl-C / SIGINT){after}{attempt}; {summary}.")
    if status == "crashed" and ranks:
        return Verdict(FAILED, f"training crashed{after}: {ranks}{'; ' + which if which else ''}; {summary}.")
    if status == "crashed":
        error = error_text(run.attempts[-1].get("error")) or "an exception"
        return Verdict(FAILED, f"training crashed{after} with {error}{attempt}; {summary}.")
    if status == "completed" and ranks:  # rank 0 completed, another rank did not
        return Verdict(FAILED, f"training crashed{after}: {ranks}{'; ' + which if which else ''}; {summary}.")
    if status == "stopped":
        stop_step, causes = run.attempt_stop(-1)
        at = f" at step {stop_step}" if stop_step is not None else at
        because = f" after {causes[-1]}" if causes else ""
        return Verdict(FAILED, f"the harness stopped training{at}{because}{attempt}; {summary}.")
    if worst(run.findings) is Severity.CRITICAL:
        critical = sorted({f.code for f in run.findings if f.severity is Severity.CRITICAL})
        return Verdict(FAILED, f"critical finding(s) {', '.join(critical)}; {summary}.")
    if status == "unknown":
        why = _run_json_state(run)
        return Verdict(ATTENTION if severe or not run.findings_known else HEALTHY, f"no record of how training ended ({why}); {summary}.")
    if severe or not run.findings_known:  # completed, but what the harness found cannot be told: not "healthy"
        return Verdict(ATTENTION, f"training completed{at}; {summary}.")
    return Verdict(HEALTHY, f"training completed{at}; {summary}.")


def _not_running(holder: LockHolder | None) -> str:
    """Why a train() call that never recorded its end reads as killed, from the run lock (``<run_dir>/.lock``)."""
    if holder is None:  # no lock file (an older harness, or one that could not make it), a link, or no pid in it
        return "killed, or still running elsewhere"
    if not holder.here:  # the lock of another host cannot be tested from here
        return f"killed, or still running on {holder.host or 'another host'} (pid {holder.pid})"
    return f"killed: pid {holder.pid} on this host no longer holds its run lock"


def rank_failure(run: RunRecord, index: int) -> str | None:
    """``rank 1 raised ValueError: ... (rank 0 then failed with RuntimeError: Connection closed by peer ...)`` for attempt
    ``index`` of a run with several processes, from how each rank ended (its marker, run.json's copy): the rank that
    failed first (a failed collective is secondary to another rank's own error; then the earliest end), and the ranks
    that failed after it. None when no rank but rank 0 is known to have failed (run.json's error says it all)."""
    first, rest = first_failure(run.rank_ends(index))
    if first is None or (first.rank == 0 and not rest):
        return None
    text = f"rank {first.rank} raised {first.error}"
    then = [f"rank {end.rank} then failed with {end.error}" for end in rest[:3]]
    then += [f"{len(rest) - 3} more rank(s) then failed"] if len(rest) > 3 else []
    return text + (f" ({'; '.join(then)})" if then else "")


def _run_json_state(run: RunRecord) -> str:
    """Why run.json tells nothing of how training ended: absent, unreadable (cut off, not JSON), or no attempt in it."""
    if any(problem.startswith(UNREADABLE) for problem in run.problems):
        return UNREADABLE
    return "run.json records no attempt that ended" if (run.run_dir / RUN_FILE).exists() else "run.json missing"


def _attempt_text(run: RunRecord) -> str:
    """``attempt 2, resumed from checkpoint-10`` for the last train() call; '' for a run without run.json."""
    attempts = run.attempts
    if not attempts:
        return ""
    resumed = attempts[-1].get("resumed_from")
    name = str(resumed).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] if resumed else None
    return f"attempt {len(attempts)}" + (f", resumed from {name}" if name else "")


def symptoms_of(run: RunRecord) -> list[Symptom]:
    """General playbooks worth reading, from the numbers (heuristics: each says why it fired)."""
    found: list[Symptom] = []
    steps, losses = run.series("loss")
    diverged = any(f.code == "LOSS_DIVERGENCE" for f in run.findings)  # its own playbook covers a rising loss
    # a preference or policy loss (DPO, GRPO ...) is no progress signal that must fall: its own checks judge the run
    token = token_loss_named(run.info.get("trainer")) and token_loss_stage(run.info.get("stage"))
    if len(losses) >= 20 and not diverged and token:
        tenth = max(2, len(losses) // 10)
        first, last = statistics.median(losses[:tenth]), statistics.median(losses[-tenth:])
        if last > first * 0.98:
            found.append(Symptom("loss-not-decreasing", f"median loss of the last {tenth} steps ({last:.4g}) is not below that of the first {tenth} ({first:.4g})."))
    fractions = [
        data / total
        for record in run.steps
        if (data := as_float(record.get("data_time"))) is not None and (total := as_float(record.get("step_time"))) and total > 0
    ]
    if len(fractions) >= 5 and statistics.median(fractions) > 0.3:
        found.append(Symptom("throughput", f"steps spent a median {statistics.median(fractions):.0%} of their time waiting for data."))
    errors = " ".join(str(a.get("error", "")) for a in run.attempts).lower()
    if "out of memory" in errors or "outofmemory" in errors:
        found.append(Symptom("oom", "an attempt ended with an out-of-memory error."))
    stage = run.info.get("stage")
    if stage == "dpo":
        chosen = [v for r in run.logs if (v := as_float(r.get("logps/chosen"))) is not None]
        if len(chosen) >= 3 and chosen[-1] < chosen[0]:
            found.append(Symptom("dpo", f"the chosen responses' log-probability fell from {chosen[0]:.4g} to {chosen[-1]:.4g}."))
    if stage == "sft":
        if any(f.code == "ALL_LABELS_MASKED" for f in run.findings):
            found.append(Symptom("instruction-following", "some batches had no completion tokens to learn from (ALL_LABELS_MASKED)."))
        if losses and losses[-1] < 0.2:
            found.append(Symptom("repetitive-generations", f"the final training loss {losses[-1]:.3g} suggests memorised SFT data."))
    return found
