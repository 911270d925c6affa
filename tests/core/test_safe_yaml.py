"""Issue 44 item 3: YAML alias bombs and deep nesting are refused where the harness reads YAML, in milliseconds."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.config import read_yaml
from harness.core.errors import ConfigError
from harness.core.safe_yaml import MAX_DEPTH, load_yaml, short_repr
from harness.report.record import read_run_config

LAUGHS = "\n".join(["a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]"]
                   + [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},"
                      f"*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)}]" for i in range(8)]
                   + ["plugins: *i"]) + "\n"  # 9^9 = 387 million strings once expanded


def test_a_billion_laughs_config_is_refused_naming_the_file_and_the_alias(tmp_path: Path) -> None:
    bomb = tmp_path / "h.yaml"
    bomb.write_text(LAUGHS)
    with pytest.raises(ConfigError) as caught:
        read_yaml(bomb)
    message = str(caught.value)
    assert str(bomb) in message and "alias (*a)" in message and "line 2" in message and "Fix:" in message


def test_a_received_config_with_aliases_is_a_note_and_the_report_goes_on(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(LAUGHS)
    config, problems = read_run_config(tmp_path)
    assert config == {} and len(problems) == 1 and "alias" in problems[0] and len(problems[0]) < 300


def test_deep_nesting_and_huge_text_are_refused_plain_data_is_read() -> None:
    with pytest.raises(Exception, match=f"nested more than {MAX_DEPTH} deep"):
        load_yaml("a: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5))
    with pytest.raises(Exception, match="more than the"):
        load_yaml("a: 1\n" * 300_000)
    assert load_yaml("plugins: [defaults]\nnan_guard: {max_consecutive: 5}\nanchor: &x 3\n") == {
        "plugins": ["defaults"], "nan_guard": {"max_consecutive": 5}, "anchor": 3}


def test_short_repr_never_walks_the_whole_value() -> None:
    shared = ["lol"] * 9
    for _ in range(8):
        shared = [shared] * 9  # 9^9 leaves through shared references: a plain repr would not end
    text = short_repr({"plugins": shared})
    assert len(text) <= 80 and text.startswith("{'plugins': [[")
