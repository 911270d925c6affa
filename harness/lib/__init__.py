"""Libraries the plugins share: no hooks, no run context."""
