"""The playbook library: the markdown files under ``playbooks/``, parsed into sections.

Two kinds of file. A *family* file (``numeric-health.md``) has one ``## CODE``
section per finding code. A *topic* file (``oom.md``) covers one symptom the
harness cannot prove alone and has no ``##`` sections. Every section (and
every topic file) holds the same five parts, in order: Symptom, Likely
causes, How to confirm, Fix, Verify; "How to confirm" is a numbered list
whose first item is the next step ``harness explain`` prints.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

PARTS = ("Symptom.", "Likely causes, most likely first.", "How to confirm.", "Fix.", "Verify.")
_PART_RE = re.compile(r"^\*\*(" + "|".join(re.escape(p) for p in PARTS) + r")\*\*", re.M)
_LIST_ITEM_RE = re.compile(r"^\s*\d+\.\s+", re.M)


@dataclass(frozen=True)
class Section:
    """One playbook section: a finding code's, or a whole topic file's."""

    key: str  # the finding code, or the topic name (file stem)
    family: str  # the file stem
    anchor: str  # the markdown heading anchor ("" for a topic file)
    title: str
    text: str  # the section's markdown, heading included
    parts: dict[str, str] = field(default_factory=dict)

    @property
    def confirm_steps(self) -> list[str]:
        """The numbered items of "How to confirm", each as one line of markdown."""
        return _list_items(self.parts.get("How to confirm.", ""))

    @property
    def next_step(self) -> str | None:
        steps = self.confirm_steps
        return steps[0] if steps else None

    @property
    def link(self) -> str:
        """``<file>.md#<anchor>`` relative to the playbooks folder."""
        return f"{self.family}.md" + (f"#{self.anchor}" if self.anchor else "")


@dataclass(frozen=True)
class Playbook:
    """One markdown file of the library."""

    name: str  # file stem, e.g. "numeric-health"
    title: str
    path: Path
    text: str
    sections: tuple[Section, ...]

    @property
    def is_topic(self) -> bool:
        return len(self.sections) == 1 and not self.sections[0].anchor


def playbook_dir() -> Path:
    """Where the shipped playbooks live (the ``harness.playbooks`` package)."""
    return Path(str(resources.files("harness.playbooks")))


@lru_cache(maxsize=4)
def load_library(directory: str | None = None) -> dict[str, Playbook]:
    """Every playbook, by file stem, parsed once per process."""
    root = Path(directory) if directory else playbook_dir()
    books: dict[str, Playbook] = {}
    for path in sorted(root.glob("*.md")):
        books[path.stem] = parse_playbook(path)
    return books


def parse_playbook(path: Path) -> Playbook:
    text = path.read_text(encoding="utf-8")
    title_match = re.search(r"^# (.+)$", text, re.M)
    title = title_match.group(1).strip() if title_match else path.stem
    heads = list(re.finditer(r"^## (\S+)[^\n]*$", text, re.M))
    sections: list[Section] = []
    if not heads:
        body = text[title_match.end():] if title_match else text
        sections.append(Section(path.stem, path.stem, "", title, text, split_parts(body)))
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        chunk = text[head.start():end].rstrip() + "\n"
        code = head.group(1)
        sections.append(Section(code, path.stem, code.lower(), code, chunk, split_parts(chunk)))
    return Playbook(path.stem, title, path, text, tuple(sections))


def split_parts(text: str) -> dict[str, str]:
    """The five labelled parts of a section, by label, each without its label."""
    marks = list(_PART_RE.finditer(text))
    parts: dict[str, str] = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        parts[mark.group(1)] = text[mark.end():end].strip()
    return parts


def _list_items(text: str) -> list[str]:
    starts = list(_LIST_ITEM_RE.finditer(text))
    items = []
    for i, start in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        items.append(" ".join(text[start.end():end].split()))
    return items


def section_problems(section: Section) -> list[str]:
    """What keeps a section from being a complete playbook (empty when it is one); the meta-tests use it."""
    problems = []
    labels = [label for label in re.findall(r"^\*\*(.+?)\*\*", section.text, flags=re.M) if label in PARTS]
    if labels != list(PARTS):
        problems.append(f"parts {labels}; expected {list(PARTS)}, each once, in this order")
    problems += [f"'{part}' is empty" for part in PARTS if not section.parts.get(part)]
    for part in ("Likely causes, most likely first.", "How to confirm."):
        if section.parts.get(part) and not section.parts[part].startswith("1. "):
            problems.append(f"'{part}' must be a numbered list")
    if len(section.next_step or "") < 40:
        problems.append("the first confirm step (what `harness explain` prints) is missing or too short to act on")
    return problems


def find_section(key: str) -> Section | None:
    """The section of finding code ``key`` (any case), or the topic file named ``key``."""
    books = load_library()
    wanted = key.strip()
    for book in books.values():
        for section in book.sections:
            if section.anchor and section.key.upper() == wanted.upper():
                return section
    book = books.get(wanted.lower())
    if book is not None and book.is_topic:
        return book.sections[0]
    return None


def section_for_link(playbook: str | None) -> Section | None:
    """The section a finding's ``playbook`` field (``family#anchor``) points at."""
    if not playbook:
        return None
    family, _, anchor = playbook.partition("#")
    book = load_library().get(family)
    if book is None:
        return None
    for section in book.sections:
        if section.anchor == anchor:
            return section
    return book.sections[0] if book.is_topic and not anchor else None
