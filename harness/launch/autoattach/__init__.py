"""Zero-edit attachment for ``harness wrap``: every Trainer the wrapped script trains gets the harness.

``harness wrap`` puts ``harness/autoattach/site-hook`` first on ``PYTHONPATH`` so
that each Python process of the job (the launcher's children included) runs
its ``sitecustomize``, which calls :func:`install`. Nothing is imported
eagerly: ``transformers.trainer`` is patched when the script itself imports it.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

WRAP_ENV = "HARNESS_WRAP"
# DeepSpeed's multi-node launcher forwards only a few variable families (PYTHON* among them) to
# remote nodes; the harness settings ride along in this one and are restored by sitecustomize.
CARRIER_ENV = "PYTHON_HARNESS_SETTINGS"
SITE_DIR = Path(__file__).with_name("site-hook")
TARGET = "transformers.trainer"


def patch_trainer_class(trainer_cls: Any) -> None:
    """Make ``Trainer.train`` attach the harness (config from the environment) on first use."""
    if getattr(trainer_cls.train, "_harness_patched", False):
        return
    original = trainer_cls.train

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_harness_bridge", None) is None:
            from harness.hf.attach import attach
            from harness.core.errors import HarnessError, NoCompleteCheckpointError, RunDirError

            try:
                attach(self, show_notes=os.environ.get(WRAP_ENV) != "1")  # `harness wrap` said the config's notes already
            except HarnessError as exc:  # as the harness CLI does: one paragraph, no traceback, exit status 2
                sys.stderr.write(f"harness: {exc}\n")
                raise SystemExit(2) from None
            try:  # run Trainer.train itself under the bridge: a subclass's own train() body already runs
                return self._harness_bridge.run_train(functools.partial(original, self), args, kwargs)
            except (RunDirError, NoCompleteCheckpointError) as exc:  # refused before the first step
                sys.stderr.write(f"harness: {exc}\n")
                raise SystemExit(2) from None
        return original(self, *args, **kwargs)

    train._harness_patched = True  # type: ignore[attr-defined]
    trainer_cls.train = train


class _TrainerImportHook(importlib.abc.MetaPathFinder):
    """Patches ``transformers.trainer`` right after it is executed, wherever it is imported from."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch_trainer_class(module.Trainer)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def restore_settings_from_carrier() -> None:
    """Recreate HARNESS_* variables from the PYTHON_* carrier when a launcher dropped them."""
    import json
    import os

    carried = os.environ.get(CARRIER_ENV)
    if not carried:
        return
    try:
        for key, value in json.loads(carried).items():
            os.environ.setdefault(key, value)
    except (ValueError, AttributeError):
        sys.stderr.write(f"harness wrap: ignoring malformed {CARRIER_ENV}\n")


def install() -> None:
    """Patch now if transformers' Trainer is already imported, else when it is."""
    module = sys.modules.get(TARGET)
    if module is not None and hasattr(module, "Trainer"):
        patch_trainer_class(module.Trainer)
    elif not any(isinstance(f, _TrainerImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrainerImportHook())
