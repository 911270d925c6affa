"""YAML the harness reads (a config given to ``wrap``, a received run's ``config.yaml``): plain data, bounded.

PyYAML's safe loader builds no objects, but it does expand aliases: a
dozen lines of anchors that each repeat the one before ("billion laughs")
make a structure of billions of references, and anything that walks it
(validation, an error message's ``repr``) runs for minutes or runs out of
memory. A harness config has no use for aliases, so :func:`load_yaml`
refuses them, and caps the size of the text and its nesting depth. Error
text about what was read is built with :func:`short_repr`, which never
walks more than a few items.
"""
from __future__ import annotations

import reprlib
from typing import Any

import yaml

MAX_YAML_BYTES = 1 << 20  # a config is a few KB; a received config.yaml of more is refused
MAX_DEPTH = 64  # mappings and lists nested deeper than this are refused


class UnsafeYaml(yaml.YAMLError):
    """YAML the harness refuses to load (an alias, too deep, too large); ``problem`` and ``problem_mark`` say where."""

    def __init__(self, problem: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class _PlainLoader(yaml.SafeLoader):
    """The safe loader without aliases and with a depth limit."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise UnsafeYaml(f"an alias (*{event.anchor}) repeats another part of the file; the harness reads no aliases "
                             "(write the value out again)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise UnsafeYaml(f"values nested more than {MAX_DEPTH} deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str) -> Any:
    """The data of one YAML document: no aliases, at most ``MAX_YAML_BYTES`` of text, ``MAX_DEPTH`` deep (UnsafeYaml)."""
    if len(text) > MAX_YAML_BYTES:
        raise UnsafeYaml(f"{len(text)} characters, more than the {MAX_YAML_BYTES} a harness YAML file may hold")
    loader = _PlainLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 4, 4, 40, 40


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr`` of a value read from a file, for an error message: a few items of it, never the whole structure."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
