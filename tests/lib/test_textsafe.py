"""Text helpers for reports and messages."""
from __future__ import annotations


def test_a_count_gets_its_noun_in_the_right_number() -> None:
    from harness.lib.textsafe import counted

    assert counted(1, "layers") == "1 layer" and counted(2, "layers") == "2 layers" and counted(0, "ranks") == "0 ranks"
    assert counted(1, "steps") == "1 step" and counted(None, "ranks") == "None ranks"
