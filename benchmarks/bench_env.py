"""The environment every benchmark sets before the HF stack is imported: offline, and the harness's defaults only."""
from __future__ import annotations

import os


def offline_defaults() -> None:
    """No hub access, no tokenizer threads, and no harness config or plugin list leaking in from the shell."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for var in ("HARNESS_CONFIG", "HARNESS_PLUGINS"):
        os.environ.pop(var, None)
