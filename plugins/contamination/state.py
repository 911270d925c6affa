"""The contamination plugin's checkpoint state: the windows agreed so far, so a resume judges on the whole run.

Every rank holds the same agreed windows (see ``harness.lib.overlap_ledger``),
so each rank's state is the same. Examples are named by eval set and id and
carry their window count, so a resume with another eval set or tokenizer
restores only what still describes the same example.
"""
from __future__ import annotations

from typing import Any

from harness.lib.ngrams import NgramIndex
from harness.lib.overlap_ledger import LANES, MatchLedger, lane_of


def state_of(index: NgramIndex, ledger: MatchLedger) -> dict[str, Any]:
    """``{"agreed": [[eval set, id, variant, windows, bits as hex, kind], ...], "reported": [[eval set, id], ...]}`` (JSON;
    kind: ``harness.lib.overlap_ledger``'s lanes, absent in states written before it: matched windows)."""
    agreed = [[index.examples[e].eval_set, index.examples[e].example_id, lane // LANES, index.windows_of(e, lane // LANES),
               format(b, "x"), lane % LANES]
              for e, per in sorted(ledger.agreed.items()) for lane, b in sorted(per.items()) if b]
    reported = [[index.examples[e].eval_set, index.examples[e].example_id] for e in sorted(ledger.reported)]
    return {"agreed": agreed, "reported": reported}  # the same on every rank: a resume agrees on what was reported


def restore(index: NgramIndex, ledger: MatchLedger, state: dict[str, Any]) -> int:
    """Merge a checkpoint's agreed windows and reported examples into ``ledger``; how many window entries still matched."""
    where: dict[tuple[str, str], int] = {}
    for e, x in enumerate(index.examples):
        where.setdefault((x.eval_set, x.example_id), e)
    restored = 0
    for item in state.get("agreed") or []:
        try:
            eval_set, example_id, variant, windows, bits = item[:5]
            kind = int(item[5]) if len(item) > 5 else 0
            e = where.get((str(eval_set), str(example_id)))
            if e is None or not 0 <= int(variant) < len(index.examples[e].variants) or not 0 <= kind < LANES:
                continue
            if index.windows_of(e, int(variant)) == int(windows):  # the same example as at save time
                ledger.restore(e, lane_of(int(variant), kind), int(bits, 16) & ((1 << int(windows)) - 1))
                restored += 1
        except (TypeError, ValueError):
            continue  # a hand-edited or foreign state: what cannot be read is not restored
    for item in state.get("reported") or []:
        try:
            e = where.get((str(item[0]), str(item[1])))
        except (TypeError, IndexError):
            continue
        if e is not None:
            ledger.reported.add(e)
    return restored
