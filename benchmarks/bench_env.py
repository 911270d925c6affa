"""What the benchmarks share: the environment set before the HF stack is imported (offline, the harness's defaults only)
and the timing of plugin hook calls."""
from __future__ import annotations

import os
import time
from typing import Any, Callable


def offline_defaults() -> None:
    """No hub access, no tokenizer threads, and no harness config or plugin list leaking in from the shell."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for var in ("HARNESS_CONFIG", "HARNESS_PLUGINS"):
        os.environ.pop(var, None)


def time_hook_calls(manager: Any, record: Callable[[str, str, dict[str, Any], float], None]) -> None:
    """Time every plugin hook call of ``manager`` (its one dispatch point, ``_call_one``): ``record(hook, plugin,
    kwargs, seconds)`` after each, with the clock stopped before the benchmark's own bookkeeping."""
    call_one = manager._call_one

    def timed(hook: str, plugin_name: str, function: Any, argnames: Any, kwargs: dict[str, Any]) -> Any:
        began = time.perf_counter()
        try:
            return call_one(hook, plugin_name, function, argnames, kwargs)
        finally:
            record(hook, plugin_name, kwargs, time.perf_counter() - began)

    manager._call_one = timed
