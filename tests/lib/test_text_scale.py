"""n and dirty_span counted in text: a tokenizer with short tokens gets them scaled up, a usual one keeps them."""
from __future__ import annotations

import numpy as np

from harness.lib.ngrams import EvalExample
from harness.lib.overlap import REFERENCE_CHARS_PER_UNIT, ScanOptions, eval_chars_per_unit, scaled_to_text


def _example(text: str | None, units: int) -> EvalExample:
    return EvalExample("e", "0", text, [np.arange(units, dtype=np.int64)])


def test_short_tokens_scale_both_thresholds_up_and_say_so() -> None:
    given = ScanOptions(n=13, dirty_span=32)
    scaled, scale = scaled_to_text(given, 2.0)
    assert scale is not None and scale.factor == 2.0 and (scaled.n, scaled.dirty_span) == (26, 64)
    line = scale.line(given, scaled, "pass --no-scale-to-text")
    assert "2.0 characters" in line and "26 tokens instead of 13" in line and "64 instead of 32" in line
    assert line.endswith("pass --no-scale-to-text.")
    assert (scaled.dirty_fraction, scaled.template_min_examples) == (given.dirty_fraction, given.template_min_examples)


def test_usual_or_long_tokens_keep_the_thresholds_and_bytes_are_capped() -> None:
    given = ScanOptions(n=13, dirty_span=32)
    for chars in (REFERENCE_CHARS_PER_UNIT, 3.3, 6.0, None, 0.0):
        assert scaled_to_text(given, chars) == (given, None)
    assert scaled_to_text(ScanOptions(scale_to_text=False), 1.0) == (ScanOptions(scale_to_text=False), None)
    scaled, scale = scaled_to_text(given, 0.1)  # more than a byte per token cannot be; capped all the same
    assert scale is not None and scale.factor == 8.0 and scaled.n == 104
    off, off_scale = scaled_to_text(ScanOptions(dirty_span=0), 2.0)
    assert off.dirty_span == 0 and off_scale is not None and "dirty span" not in off_scale.line(ScanOptions(dirty_span=0), off, "x")


def test_characters_per_token_from_text_or_decoded_ids() -> None:
    assert eval_chars_per_unit([_example("a" * 30, 10), _example(" " + "b" * 10 + "\n", 10)]) == 2.0
    decoded = eval_chars_per_unit([_example(None, 4)], decode=lambda ids: "x" * (3 * len(ids)))
    assert decoded == 3.0
    assert eval_chars_per_unit([_example(None, 4)]) is None and eval_chars_per_unit([]) is None

    def broken(ids: list[int]) -> str:
        raise ValueError("no decoder")

    assert eval_chars_per_unit([_example(None, 4)], decode=broken) is None
