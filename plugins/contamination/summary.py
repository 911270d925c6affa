"""The contamination plugin's run-end files and its report section (built from the run directory alone).

Each rank writes ``contamination/summary.rank-<r>.json`` (per eval set:
clean/partial/dirty counts; the non-clean examples with their numbers) and
``{clean,partial,dirty}_ids.rank-<r>.txt``. Statuses are judged on the
windows agreed over all ranks plus this rank's own, so the ranks' summaries
agree but for what a rank matched after the last exchange.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from harness.core.strictjson import dumps

STATUSES = ("clean", "partial", "dirty")
ORDER = {"too_short": 0, "clean": 0, "partial": 1, "dirty": 2}


def write_summary(out: Path, rank: int, rows: list[dict[str, Any]], checked_tokens: int, complete: bool,
                  dirty_span: int = 0, n: int = 0) -> dict[str, Counter[str]]:
    """The summary and the id lists of one rank (atomically: rank 0's report may read them at any moment)."""
    per_set: dict[str, Counter[str]] = {}
    for row in rows:
        per_set.setdefault(row["eval_set"], Counter())[row["status"]] += 1
    summary = {"rank": rank, "checked_tokens": checked_tokens, "eval_sets": {k: dict(v) for k, v in per_set.items()},
               "complete": complete, "dirty_span": dirty_span, "n": n,
               "long_spans": {name: c["long_spans"] for name, c in span_counts(rows, dirty_span).items()},
               "examples": [{k: v for k, v in r.items() if k != "locations"} for r in rows if r["status"] != "clean"]}
    tmp = out / f".summary.rank-{rank}.json.tmp"
    tmp.write_text(dumps(summary, indent=1), encoding="utf-8")
    tmp.replace(out / f"summary.rank-{rank}.json")
    for status in STATUSES:
        (out / f"{status}_ids.rank-{rank}.txt").write_text(
            "".join(f"{r['eval_set']}\t{r['id']}\n" for r in rows if r["status"] == status), encoding="utf-8")
    return per_set


def span_counts(rows: list[dict[str, Any]], dirty_span: int,
                named: set[tuple[str, str]] | None = None) -> dict[str, dict[str, int]]:
    """Per eval set: rows, rows holding a training span of at least ``dirty_span`` tokens, dirty, partial, the longest
    span; with ``named`` (the (eval set, example id) pairs that have a CONTAMINATION finding), also the dirty rows
    left without one (``unreported``: the findings per example stop at ``max_reports``)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = out.setdefault(row["eval_set"], {"rows": 0, "long_spans": 0, "dirty": 0, "partial": 0, "longest_span": 0})
        counts["rows"] += 1
        counts["long_spans"] += int(bool(dirty_span) and row["longest_span"] >= dirty_span)
        counts["dirty"] += int(row["status"] == "dirty")
        counts["partial"] += int(row["status"] == "partial")
        counts["longest_span"] = max(counts["longest_span"], int(row["longest_span"]))
        if named is not None:
            unnamed = row["status"] == "dirty" and (str(row["eval_set"]), str(row["id"])) not in named
            counts["unreported"] = counts.get("unreported", 0) + int(unnamed)
    return out


def summary_message(counts: dict[str, dict[str, int]], dirty_span: int, dirty_fraction: float, n: int, ids_file: str,
                    summary_file: str = "", max_reports: int = 0) -> str | None:
    """The CONTAMINATION_SUMMARY message: per eval set with a dirty row, how many rows hold training text, and how many
    dirty rows got no finding of their own (past ``max_reports``); None if no row is dirty."""
    parts = []
    for name, c in counts.items():
        if not c["dirty"]:
            continue
        spans = (f"{c['long_spans']} of {c['rows']} eval rows hold training spans of at least {dirty_span} tokens "
                 f"(the longest {c['longest_span']}), " if dirty_span else "")
        long_rule = f" or spans of at least {dirty_span} tokens" if dirty_span else ""
        span_rule = "; or one such span" if dirty_span else ""
        unreported = c.get("unreported", 0)
        silent = (f"; {unreported} of the dirty rows have no finding of their own (findings stop at "
                  f"{max_reports} per rank and attempt; the most copied rows of a step come first)" if unreported else "")
        parts.append(f"eval set '{name}': {spans}{c['dirty']} of {c['rows']} are dirty (at least {dirty_fraction:.0%} of their "
                     f"{n}-grams seen in training; in a row that joins lines, also {dirty_fraction:.0%} of its tokens in "
                     f"whole lines inside training spans{long_rule}{span_rule}) and {c['partial']} more hold less training "
                     f"text (partial){silent}")
    if not parts:
        return None
    numbers = f", each row's numbers in <output_dir>/harness/{summary_file}" if summary_file else ""
    return ("contamination: " + "; ".join(parts) + f". The dirty ids are in <output_dir>/harness/{ids_file}{numbers}: eval "
            "metrics on those rows measure memory, not skill. A row that joins several lines (run_clm's blocks) is dirty for "
            "the lines it holds: to judge each line of the validation file on its own, name the file in "
            "contamination.eval_sets (a .txt is one example per line), or run `harness scan --eval <file>`.")


def console_line(rows: list[dict[str, Any]], dirty_fraction: float, dirty_span: int = 0) -> str:
    """One line per run: what the eval sets met in training, partial ones with their largest fraction."""
    parts = []
    for name in dict.fromkeys(r["eval_set"] for r in rows):
        mine = [r for r in rows if r["eval_set"] == name]
        counts = Counter(r["status"] for r in mine)
        partial = [r["matched_fraction"] for r in mine if r["status"] == "partial"]
        text = f"{name}: {len(mine)} examples, {counts['dirty']} dirty, {counts['partial']} partial"
        if dirty_span:
            text += f", {sum(1 for r in mine if r['longest_span'] >= dirty_span)} with training spans of at least {dirty_span} tokens"
        if partial:
            text += (f" (at most {max(partial):.0%} of an example's n-grams seen, below dirty_fraction {dirty_fraction:g}: "
                     "in partial_ids, not reported)")
        parts.append(text)
    return "contamination: " + "; ".join(parts)


def report_section(run_dir: Path) -> Any:
    """Per eval set: examples clean/partial/dirty (worst over ranks), the dirtiest ones, the id lists."""
    from urllib.parse import quote

    from harness.core.received import read_received_json
    from harness.lib.textsafe import md_escape
    from harness.report.model import Raw, ReportSection, md_table

    summaries = []
    for path in sorted(run_dir.glob("contamination/summary.rank-*.json")):
        try:
            summary = read_received_json(path)  # a received run's file: never a link, a FIFO or a device
        except (OSError, ValueError):
            continue  # one unreadable rank costs its numbers, not the section
        if isinstance(summary, dict):
            summaries.append(summary)
    if not summaries:
        return None
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    totals: dict[str, int] = {}
    long_spans: dict[str, int] = {}
    span = max((int(s.get("dirty_span") or 0) for s in summaries), default=0)
    n = max((int(s.get("n") or 0) for s in summaries), default=0)  # 0: a summary written before it was kept
    for summary in summaries:
        for name, counts in summary.get("eval_sets", {}).items():
            totals[name] = max(totals.get(name, 0), sum(counts.values()))
        for name, count in (summary.get("long_spans") or {}).items():
            long_spans[name] = max(long_spans.get(name, 0), int(count))
        for example in summary.get("examples", []):
            key = (example["eval_set"], str(example["id"]))
            if key not in worst or ORDER.get(example["status"], 0) > ORDER.get(worst[key]["status"], 0):
                worst[key] = example
    rows = []
    for name, total in totals.items():
        hit = Counter(e["status"] for (s, _), e in worst.items() if s == name)
        rows.append([name, total, total - hit["partial"] - hit["dirty"], hit["partial"], hit["dirty"], long_spans.get(name, 0)])
    text = (f"Eval examples met in the training batches of this run ({sum(s.get('checked_tokens', 0) for s in summaries):,} "
            f"training tokens checked{f'; n-grams of {n} tokens' if n else ''}; an example counts at its worst over ranks; n-grams across a line or document boundary "
            "inside a joined row are not counted; partial examples share some n-grams with training, below the dirty "
            "fraction (and, in a joined row, shorter than the dirty span), and are not reported as findings).\n\n")
    text += md_table(["eval set", "examples", "clean", "partial", "dirty", f"training spans >= {span} tokens"], rows) + "\n\n"
    dirtiest = sorted(worst.values(), key=lambda e: (-ORDER.get(e["status"], 0), -float(e.get("matched_fraction") or 0)))[:10]
    if dirtiest:
        text += md_table(["eval set", "example", "status", "matched fraction", "longest span", "training documents hit"],
                         [[e["eval_set"], e["id"], e["status"], e.get("matched_fraction"), e.get("longest_span"), e.get("documents_hit")]
                          for e in dirtiest])
        text += "\n\n"
    lists = sorted(run_dir.glob("contamination/*_ids.rank-*.txt"))
    if lists:
        text += "Id lists (eval set, tab, id): " + ", ".join(  # file names from the run dir are data: escaped, quoted
            Raw(f"[{md_escape(p.name)}](contamination/{quote(p.name)})").markdown for p in lists) + ".\n"
    return ReportSection("Contamination", text)
