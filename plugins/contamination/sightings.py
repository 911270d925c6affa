"""Where this rank saw an eval example's n-grams, and the CONTAMINATION finding built from it.

A sighting is one training row of one micro-batch that matched windows of
an example not matched before on this rank. An example keeps its first few
sightings and its latest, with the matched tokens of each (for the snippet),
so the finding can say which batches made the example dirty.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

KEEP = 6  # sightings kept per example: the first KEEP - 1 and the latest


@dataclass
class Sighting:
    """One training row that matched new windows of an eval example on this rank."""

    step: int
    micro: int
    rank: int
    row: int
    sample_id: Any
    position: int  # token position of the first matched window in the row
    windows: int  # windows of the example new to this rank in this row
    tokens: np.ndarray  # the row's tokens from the first matched window to the end of the last

    def where(self) -> str:
        sample = f", sample id {self.sample_id}" if self.sample_id is not None else ""
        return f"step {self.step} (rank {self.rank}, micro-batch {self.micro}, row {self.row}{sample})"


def remember(kept: list[Sighting], sighting: Sighting) -> None:
    """Keep the first ``KEEP - 1`` sightings and the latest."""
    if len(kept) >= KEEP:
        kept[-1] = sighting
    else:
        kept.append(sighting)


def finding(example: Any, verdict: dict[str, Any], n: int, kept: list[Sighting], ranks: tuple[int, ...],
            decode: Callable[[np.ndarray], str | None], dirty_span: int = 0) -> tuple[str, int, dict[str, Any]]:
    """Message, step and evidence of the CONTAMINATION finding of one example.

    ``verdict`` is ``judge``'s row (its n-gram counts leave out those across a line or document boundary of a joined
    row); the step is the latest sighting's (the batch that made the example dirty, as far as this rank saw), the row
    and snippet those of the sighting that held most of it.
    """
    main = max(kept, key=lambda s: s.windows)
    last = kept[-1]
    snippet = decode(main.tokens)
    others = [r for r in ranks if r != main.rank]
    steps = sorted({s.step for s in kept})
    matched, total, across = verdict["matched_ngrams"], verdict["ngrams"], verdict["boundary_ngrams"]
    where = main.where() + (f" and {len(kept) - 1} more training row(s), at steps {', '.join(map(str, steps))}" if len(kept) > 1 else "")
    seams = f", none of the {across} that cross a line or document boundary inside it counted for it" if across else ""
    ngrams = f"{matched} of its {total + across} {n}-grams ({matched / max(total + across, 1):.0%}{seams}) were in training batches"
    longest = f"longest training span {verdict['longest_span']} tokens"
    if verdict.get("dirty_by") == "span":
        said = f"{ngrams}, {longest}: dirty by that span (a training span of at least {dirty_span} tokens makes a row dirty whatever its shares)"
    elif verdict.get("judged_share") == "tokens":
        long = f" or spans of at least {dirty_span} tokens" if dirty_span else ""
        said = (f"{verdict['copied_fraction']:.0%} of the tokens its n-grams cover are training text (whole lines inside training spans{long}): "
                f"dirty by that token share, the larger of its two shares ({ngrams}), {longest}")
    else:
        said = f"{ngrams}: dirty by that n-gram share, {longest}"
    message = (
        f"eval example '{example.example_id}' of eval set '{example.eval_set}' is in the training data: {said}; "
        f"most of it in the batch of {where}"
        + (f", also seen on rank(s) {', '.join(map(str, others))}" if others else "")
        + (f', e.g. "{snippet}"' if snippet else "") + "."
    )
    evidence = {
        "eval_set": example.eval_set, "example_id": example.example_id, "rank": main.rank, "micro_batch": main.micro,
        "row": main.row, "sample_id": main.sample_id, "position": main.position, "matched_ngrams": matched, "ngrams": total,
        "boundary_ngrams": across, "boundary_matched": verdict["boundary_matched"], "matched_fraction": verdict["matched_fraction"], "coverage": verdict["coverage"],
        "longest_span": verdict["longest_span"], "dirty_by": verdict.get("dirty_by"), "judged_share": verdict.get("judged_share"),
        "copied_fraction": verdict.get("copied_fraction"), "ngram_fraction": verdict.get("ngram_fraction"), "ranks": list(ranks), "steps": steps,
        "snippet": snippet,
        "sightings": [{"step": s.step, "rank": s.rank, "micro_batch": s.micro, "row": s.row, "sample_id": s.sample_id,
                       "new_ngrams": s.windows} for s in kept],
    }
    return message, last.step, evidence
