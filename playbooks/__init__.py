"""Troubleshooting playbooks, one markdown file per finding-code family, shipped as data."""
