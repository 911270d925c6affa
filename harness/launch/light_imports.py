"""Validate a config in the launcher without paying for torch: the heavy frameworks load on first use there.

``harness wrap`` checks the config before the job starts, which needs every
plugin's options and finding codes, so it imports the plugin modules; they
import torch, numpy and transformers at the top, and loading torch alone
costs seconds before the user's command even starts. Inside
:func:`heavy_imports_deferred`, importing one of those packages binds a
placeholder module: the name exists, nothing executes until an attribute is
read, and then the real package loads and answers. The launcher never trains,
so in the parent the placeholders are never read; the child process (the
user's command) imports everything normally.

Module-level *use* defeats it (``torch.float32`` in a constant, ``import
torch.nn.functional as F``, which reads ``torch.__path__``):
``tests/launch/test_light_imports.py`` fails when a plugin module does that.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

HEAVY_PACKAGES: tuple[str, ...] = (
    "torch", "transformers", "datasets", "accelerate", "deepspeed", "trl", "peft", "mlflow", "pyarrow", "pandas", "safetensors",
)


class DeferredModule(types.ModuleType):
    """A stand-in for a package not loaded yet: the first attribute read loads the real one and forwards to it."""

    def __getattr__(self, attr: str) -> Any:  # only called for attributes the placeholder does not have
        if not self.__dict__.get("_deferred_ready"):  # the import system probing a module being created
            raise AttributeError(attr)
        real = self.__dict__.get("_deferred_real")
        if real is None:
            real = _load_real(self.__name__, self)
            self.__dict__["_deferred_real"] = real
        return getattr(real, attr)


def _load_real(name: str, placeholder: DeferredModule) -> types.ModuleType:
    if sys.modules.get(name) is placeholder:
        del sys.modules[name]
    for finder in [f for f in sys.meta_path if isinstance(f, _DeferringFinder)]:
        finder.names.discard(name)
    return importlib.import_module(name)


class _DeferringLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return DeferredModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing runs now: the real package executes on first use."""
        module.__dict__["_deferred_ready"] = True


class _DeferringFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names or importlib.machinery.PathFinder.find_spec(fullname) is None:
            return None  # not installed: the import fails now, as it would without the placeholder
        return importlib.machinery.ModuleSpec(fullname, _DeferringLoader())


def loaded_for_real(name: str) -> bool:
    """Whether package ``name`` has executed (a placeholder that nobody read has not)."""
    module = sys.modules.get(name)
    if isinstance(module, DeferredModule):
        return module.__dict__.get("_deferred_real") is not None
    return module is not None


@contextmanager
def heavy_imports_deferred(names: Sequence[str] = HEAVY_PACKAGES) -> Iterator[None]:
    """Within the block, importing one of ``names`` that is not imported yet binds a :class:`DeferredModule`.

    Placeholders stay in ``sys.modules`` afterwards (modules imported in the
    block hold them); reading one later loads the real package then.
    """
    finder = _DeferringFinder([n for n in names if n not in sys.modules])
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
