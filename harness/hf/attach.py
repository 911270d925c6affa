"""``attach()``: the one-line way in (``harness.attach`` re-exports it)."""
from __future__ import annotations

from typing import Any

from harness.core.config import Catalog, load_config
from harness.core.context import RunContext
from harness.hf.actions import RollbackHandler
from harness.hf.bridge import Bridge


def attach(trainer: Any, config: Any = None, plugins: list[Any] | None = None, rollback: RollbackHandler | None = None,
           only: list[Any] | None = None, show_notes: bool = True) -> RunContext:
    """Attach the harness to ``trainer`` (a ``transformers.Trainer`` or TRL subclass); call before ``train()``.

    ``config`` is a YAML path, a dict, or None (then ``HARNESS_CONFIG`` /
    ``HARNESS_PLUGINS`` from the environment, else the defaults). ``plugins``
    adds plugins by name, ``module:Class`` path or object to the config's
    (``"defaults"`` among them stands for the plugins on by default);
    ``only`` runs exactly the plugins it lists instead. ``rollback`` is
    the handler that can restart training from the last good checkpoint (a
    stage runner's); without one a ``rollback`` action saves and stops.
    ``show_notes``: log the config's notes (a disabled plugin's section ...)
    on rank 0; False where the caller said them already (``harness wrap``).
    Attaching twice returns the first context.
    """
    existing: Bridge | None = getattr(trainer, "_harness_bridge", None)
    if existing is not None:
        return existing.ctx
    objects = [p for p in [*(plugins or []), *(only or [])] if not isinstance(p, str)]
    catalog = Catalog.build(extra=objects)

    def names(listed: list[Any]) -> list[str]:
        return [p if isinstance(p, str) else catalog.add(p) for p in listed]

    resolved = load_config(config, catalog, extra_plugins=names(plugins or []),
                           only=names(only) if only is not None else None)
    bridge = Bridge(trainer, resolved, catalog, rollback=rollback, show_notes=show_notes)
    trainer._harness_bridge = bridge
    return bridge.ctx
