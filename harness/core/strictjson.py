"""Strict JSON for the run directory: a non-finite float is written as the string "nan", "inf" or "-inf".

Python's ``json.dumps`` writes bare ``NaN`` / ``Infinity`` tokens, which
Python reads back but strict parsers (jq, JavaScript's ``JSON.parse``, Go,
serde_json) reject, line and all. Every file the harness writes for a run
goes through :func:`dumps` (or :func:`strict_json` where a structure is
built first), so a loss of NaN reads ``"loss": "nan"`` in ``findings.jsonl``,
``metrics.jsonl``, ``steps.jsonl``, captures and ``run.json`` alike.

Readers that compare numbers take a field through :func:`as_float`, which
reads those strings back as the floats they stand for.

The common case costs nothing extra: :func:`dumps` encodes once with
``allow_nan=False`` and walks the value only when that refuses a float.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable

NONFINITE = ("nan", "inf", "-inf")  # how a non-finite float is written: str() of it
_ENCODERS: dict[tuple[tuple[str, Any], ...], json.JSONEncoder] = {}  # json.dumps builds one per call when given options


def json_float(value: float | None) -> float | str | None:
    """``value`` as strict JSON holds it: a finite float as it is, NaN/Inf as a string ("nan", "inf", "-inf")."""
    if value is None:
        return None
    return value if math.isfinite(value) else str(float(value))


def strict_json(value: Any, default: Callable[[Any], Any] | None = None) -> Any:
    """The same structure with every non-finite float (keys included) as a string, so that it encodes as strict JSON.

    ``default`` is ``json.dumps``'s: applied here to what JSON cannot hold
    (a tensor, a path) so that the floats it yields are converted too; without
    it such a value is left for the encoder. A container that holds itself
    raises ``ValueError`` as ``json.dumps`` does.
    """
    return _strict(value, default, set())


def _strict(value: Any, default: Callable[[Any], Any] | None, active: set[int]) -> Any:
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, (str, int)) or value is None:  # bool is an int
        return value
    if isinstance(value, (dict, list, tuple)):
        if id(value) in active:
            raise ValueError("Circular reference detected")
        active.add(id(value))
        try:
            if isinstance(value, dict):
                return {(json_float(k) if isinstance(k, float) else k): _strict(v, default, active) for k, v in value.items()}
            return [_strict(v, default, active) for v in value]
        finally:
            active.discard(id(value))
    if default is None:
        return value
    if id(value) in active:
        raise ValueError("Circular reference detected")
    active.add(id(value))
    try:
        return _strict(default(value), default, active)
    finally:
        active.discard(id(value))


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, **kwargs)`` as strict JSON: non-finite floats as "nan", "inf", "-inf".

    One plain encoding when every float is finite (nearly always); only when
    the encoder refuses a float is the value converted and encoded again.
    """
    try:
        return _encoder(kwargs).encode(value)
    except ValueError as exc:
        if not str(exc).startswith("Out of range float"):
            raise  # a cycle: the caller's to handle, as with json.dumps
    return json.dumps(strict_json(value, kwargs.get("default")), allow_nan=False, **kwargs)


def _encoder(kwargs: dict[str, Any]) -> json.JSONEncoder:
    """A strict encoder for these ``json.dumps`` options, built once per option set (the ledger's compact one per step)."""
    key = tuple(sorted(kwargs.items()))
    encoder = _ENCODERS.get(key)
    if encoder is None:
        encoder = _ENCODERS[key] = json.JSONEncoder(allow_nan=False, **kwargs)
    return encoder


def as_float(value: Any) -> float | None:
    """A number from a field of a run-directory file ("nan"/"inf"/"-inf" strings included: NaN and infinities), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None
