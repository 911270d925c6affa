"""Test support shipped with the harness (like pytest's pytester): fault injection for your own tests."""
from harness.testing.faults import EmbeddingPoison, FaultInjector, FaultOptions, advance_scheduler, corrupt_batch, perturb_one_ulp, poison_parameter, scale_lr, scale_reduced_gradients

__all__ = ["EmbeddingPoison", "FaultInjector", "FaultOptions", "advance_scheduler", "corrupt_batch", "perturb_one_ulp", "poison_parameter", "scale_lr", "scale_reduced_gradients"]
