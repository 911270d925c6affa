"""The built-in diagnostic plugins, one module per plugin (mlflow's tracker and writer in one sub-package).

This package holds no registry: the list of built-in plugins is
``harness.core.registry.BUILTIN_PLUGINS`` (plain ``"module:Class"`` strings),
so the core never imports this package. The names below are re-exported
for code that read them here before.
"""
from __future__ import annotations

from harness.core.registry import BUILTIN_PLUGINS, BuiltinPlugin

__all__ = ["BUILTIN_PLUGINS", "BuiltinPlugin"]
