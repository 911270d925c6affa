"""Offline commands: scan, replay, estimate, explain, report."""
