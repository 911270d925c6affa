"""Text from a run (training data, eval ids, finding messages, file names) shown in markdown: escaped, never live.

A run directory received from someone else is data. Whatever it holds ends up
in report.md, report.html (rendered by markdown-it) and the capture summaries;
none of it may become a link, an image or raw HTML there. Every place that
puts such text into markdown goes through :func:`md_escape` (inline text),
:func:`md_cell` (one table cell) or :func:`md_code` (a code span): one helper,
used everywhere (``harness.report.model.cell`` is :func:`md_cell`).
"""
from __future__ import annotations

import re
from typing import Any

# what makes markdown live: links and images ([ ]), raw HTML and autolinks (< >), code spans (`),
# and the backslash itself so that an escape in the data cannot undo ours
_ESCAPES = {"\\": "\\\\", "`": "\\`", "[": "\\[", "]": "\\]", "<": "&lt;", ">": "&gt;", "|": "\\|"}
_SPECIAL = re.compile(r"[\\`\[\]<>|]")


def md_escape(text: Any) -> str:
    """``text`` as literal inline markdown: no link, image, HTML tag, autolink or code span can come through."""
    return _SPECIAL.sub(lambda m: _ESCAPES[m.group(0)], str(text))


def md_cell(text: Any, limit: int = 400) -> str:
    """Text made safe for one markdown table cell: one line, escaped, long text cut."""
    if isinstance(text, float):
        text = f"{text:.4g}"
    value = " ".join(str(text).split())
    if len(value) > limit:
        value = value[: limit - 1] + "…"
    return md_escape(value)


def md_code(text: Any) -> str:
    """``text`` as one inline code span (paths, commands): literal, whatever backticks it holds."""
    value = " ".join(str(text).splitlines())
    longest = max((len(run) for run in re.findall(r"`+", value)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if value.startswith("`") or value.endswith("`") or not value.strip() else ""
    return f"{fence}{pad}{value}{pad}{fence}"


__all__ = ["md_cell", "md_code", "md_escape"]


def counted(count: Any, noun: str) -> str:
    """``1 layer``, ``2 layers``: a count with its noun in the right number (``noun`` given in the plural)."""
    return f"{count} {noun[:-1] if count == 1 and noun.endswith('s') else noun}"
