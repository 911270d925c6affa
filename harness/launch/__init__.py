"""Launchers: `harness wrap` and the auto-attach site hook."""
