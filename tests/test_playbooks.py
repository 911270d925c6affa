"""Meta-tests of the playbook library: every code has a complete section, topics exist, links resolve, the CLI prints them."""
from __future__ import annotations

import re
from typing import Any

import pytest

from conftest import FAULTS, REPO
from harness.cli import main as harness_main
from harness.core.config import Catalog
from harness.lib.playbook import find_section, load_library, parse_playbook, section_problems

BOOKS = load_library(str(REPO / "playbooks"))
SECTIONS = [section for book in BOOKS.values() for section in book.sections]
TOPICS = ("loss-not-decreasing", "throughput", "oom", "repetitive-generations", "instruction-following", "dpo")


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.key)
def test_every_section_has_the_five_parts_in_order_and_a_first_confirm_step(section: Any) -> None:
    assert section_problems(section) == [], f"{section.family}.md {section.key}"


def test_every_declared_code_has_a_section_and_every_section_a_code() -> None:
    catalog = Catalog.build(extra=[FAULTS, "harness.stages.demo.faults:DemoFaults"], autoload=False)
    for code in catalog.codes.values():
        section = find_section(code.code)
        assert section is not None and section.link == f"{code.playbook.replace('#', '.md#', 1)}", code.code
    code_sections = {s.key for s in SECTIONS if s.anchor}
    assert code_sections <= set(catalog.codes), f"sections without a code: {code_sections - set(catalog.codes)}"


def test_general_topics_exist_and_the_report_points_only_at_them() -> None:
    for topic in TOPICS:
        book = BOOKS[topic]
        assert book.is_topic and book.title and find_section(topic) is not None
    source = (REPO / "harness" / "report" / "verdict.py").read_text(encoding="utf-8")
    assert set(re.findall(r'Symptom\("([\w-]+)"', source)) <= set(TOPICS)


def test_links_between_playbooks_resolve() -> None:
    links = 0
    for book in BOOKS.values():
        text = re.sub(r"`[^`\n]*`", "", book.text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            assert not target.startswith("http"), f"{book.name}.md links outside: {target}"
            name, _, anchor = target.partition("#")
            linked = BOOKS.get(name.removesuffix(".md")) if name else book
            assert linked is not None, f"{book.name}.md: {target}"
            assert not anchor or anchor in {s.anchor for s in linked.sections}, f"{book.name}.md: {target}"
            links += 1
    assert links >= 3  # the sections point at each other where one cause is another code's finding


def test_a_section_without_its_parts_is_caught(tmp_path: Any) -> None:
    broken = tmp_path / "broken.md"
    broken.write_text("# Broken\n\n## SOME_CODE\n\n**Symptom.** x\n\n**Fix.** y\n\n**How to confirm.** look around\n", encoding="utf-8")
    (section,) = parse_playbook(broken).sections
    problems = section_problems(section)
    assert any("expected" in p for p in problems) and "'Verify.' is empty" in problems
    assert "'How to confirm.' must be a numbered list" in problems and any("first confirm step" in p for p in problems)


def test_cli_lists_and_prints_playbooks(capsys: Any) -> None:
    assert harness_main(["playbook"]) == 0
    listing = capsys.readouterr().out
    assert "numeric-health" in listing and "NONFINITE_LOSS" in listing and "oom" in listing
    assert harness_main(["playbook", "loss_spike"]) == 0  # any case
    text = capsys.readouterr().out
    assert text.startswith("## LOSS_SPIKE") and "**How to confirm.**" in text and "## GRAD_NORM_SPIKE" not in text
    assert harness_main(["playbook", "oom"]) == 0
    assert capsys.readouterr().out.startswith("# ")
    assert harness_main(["playbook", "LOSS_SPIK"]) == 2
    assert "Did you mean 'LOSS_SPIKE'?" in capsys.readouterr().err
