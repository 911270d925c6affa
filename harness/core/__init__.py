"""The core: hook specs, plugin manager, config, run context, findings, actions, codes, distributed. No transformers."""
