"""The embedded demo: `harness demo` pretrains a tiny Llama while the demo-only plugin breaks it on purpose."""
from harness.stages.demo.run import run_demo

__all__ = ["run_demo"]
