"""Which of the run's own earlier findings a loss or grad-norm jump points back to.

The harness often finds a cause before its effect: the learning rate an
update used (``LR_SCHEDULE_MISMATCH``), a batch with nothing to learn from,
repeated data, a packed row that sees across documents. Such a finding a few
steps before a spike explains it better than any generic heuristic (the
spike "came after a resume"), so it is named first. Kept from ``on_finding``:
a bounded list, a few host operations per finding, nothing per step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

# finding codes that can make the loss or the grad norm jump, with what they mean for it. A state the run carries on (the
# learning rate, the optimizer, the weights) can explain a jump up to WINDOW steps later; what one batch holds explains
# the jump of its own step only (BATCH_CAUSES). A skipped non-finite step changed nothing, so it explains nothing.
CAUSES: dict[str, str] = {
    "LR_SCHEDULE_MISMATCH": "the learning rate an update used was not the schedule's",
    "LR_ADVANCED_ON_SKIPPED_STEP": "the LR scheduler stepped on a skipped update",
    "GA_LOSS_SCALING": "the loss and gradients are scaled by the accumulation factor",
    "ALL_LABELS_MASKED": "a micro-batch had every label masked",
    "DATA_REPEATED": "samples were trained again",
    "PACKING_LOSS_ON_PADDING": "padding or document starts were trained on",
    "PACKING_CROSS_DOC_ATTENTION": "packed documents attend across their boundaries",
    "RESUME_OPTIMIZER_NOT_RESTORED": "the optimizer state was not restored on resume",
    "RESUME_SCHEDULER_MISMATCH": "the LR scheduler was not restored on resume",
    "RESUME_MODEL_MISMATCH": "the weights were not restored on resume",
    "RESUME_DATA_POSITION": "the data position was not restored on resume",
    "LAYER_GRAD_SURGE": "a layer's gradients surged",
    "UPDATE_RATIO_HIGH": "updates were large against the weights",
    "ATTENTION_LOGIT_GROWTH": "attention logits grew",
}
BATCH_CAUSES = frozenset({"ALL_LABELS_MASKED", "PACKING_LOSS_ON_PADDING", "PACKING_CROSS_DOC_ATTENTION"})
KEEP = 32  # cause findings remembered
WINDOW = 20  # steps before a jump within which a cause finding is named


@dataclass(frozen=True)
class Cause:
    code: str
    step: int
    rank: int
    meaning: str
    message: str

    def words(self, at: int) -> str:
        when = "at the same step" if self.step == at else f"at step {self.step}, {at - self.step} step(s) before"
        return f"{self.code} {when} ({self.meaning})"

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "step": self.step, "rank": self.rank, "message": self.message[:300]}


class EarlierFindings:
    """The run's recent cause findings (see the module); ``before(step)``: those a jump at ``step`` may come from, latest first."""

    def __init__(self) -> None:
        self._seen: deque[Cause] = deque(maxlen=KEEP)

    def note(self, finding: Any) -> None:
        meaning = CAUSES.get(getattr(finding, "code", ""))
        step = getattr(finding, "step", None)
        if meaning is None or not isinstance(step, int):
            return
        self._seen.append(Cause(finding.code, step, int(getattr(finding, "rank", 0) or 0), meaning, str(getattr(finding, "message", ""))))

    def before(self, step: int, window: int = WINDOW) -> list[Cause]:
        found = [c for c in self._seen if (c.step == step if c.code in BATCH_CAUSES else step - window <= c.step <= step)]
        latest: dict[str, Cause] = {}
        for cause in found:  # one per code: its latest
            latest[cause.code] = cause
        return sorted(latest.values(), key=lambda c: -c.step)

    def clear(self) -> None:
        self._seen.clear()
