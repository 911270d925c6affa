"""spike_capture: the loss and grad norm against a robust running baseline and an absolute anchor; the offending batch captured.

``plugin.py`` holds the hooks and the running baseline's judgement;
``anchor.py`` the anchor that does not move with the run (the untrained level
and the run's first losses); ``evals.py`` the evaluation losses' trend;
``causes.py`` which of the run's own earlier findings a spike points back to.
"""
from __future__ import annotations

from .plugin import EVAL_LOSS_RISING, GRAD_NORM_SPIKE, LOSS_ABOVE_START, LOSS_DIVERGENCE, LOSS_NOT_RECOVERED, LOSS_SPIKE, SpikeCapture, SpikeCaptureOptions

__all__ = ["EVAL_LOSS_RISING", "GRAD_NORM_SPIKE", "LOSS_ABOVE_START", "LOSS_DIVERGENCE", "LOSS_NOT_RECOVERED", "LOSS_SPIKE", "SpikeCapture",
           "SpikeCaptureOptions"]
