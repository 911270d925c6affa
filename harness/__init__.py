"""train-harness: monitoring and diagnostics around the Hugging Face Trainer.

``harness.attach(trainer, config=...)`` before ``trainer.train()`` is the one-line way in.
"""
from __future__ import annotations

from harness.core.actions import Action, HarnessStop
from harness.core.errors import HarnessStopped
from harness.core.findings import Finding, FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin

__version__ = "0.1.0"
__all__ = ["Action", "Finding", "FindingCode", "HarnessStop", "HarnessStopped", "Plugin", "Severity", "attach", "hookimpl", "__version__"]


def attach(trainer, config=None, plugins=None, rollback=None, only=None, show_notes=True):  # type: ignore[no-untyped-def]
    """Attach the harness to a Trainer; see :func:`harness.hf.attach.attach`."""
    from harness.hf.attach import attach as _attach

    return _attach(trainer, config=config, plugins=plugins, rollback=rollback, only=only, show_notes=show_notes)
