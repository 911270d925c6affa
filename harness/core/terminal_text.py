"""Text from a run directory or from training data, made inert before it reaches a terminal.

A finding message, an error in run.json or a captured sample may hold
terminal control sequences: ESC ``[2J`` clears the screen, ESC ``]0;`` sets
the window title, ESC ``]52;`` writes the clipboard (xterm, iTerm2, kitty
and tmux honour it). Every line the harness prints from such text goes
through :func:`terminal_text`, which shows C0 and C1 control characters
(newline and tab kept) and DEL as escapes (``\\x1b``) instead of sending them.
"""
from __future__ import annotations

import re

_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_text(text: str) -> str:
    """``text`` with every control character but newline and tab shown escaped (``\\x1b``), so none acts on a terminal."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group(0)):02x}", text)
