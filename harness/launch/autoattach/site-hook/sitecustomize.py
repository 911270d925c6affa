"""Loaded by every Python process that `harness wrap` starts; see harness.launch.autoattach."""
import os
import sys


def _harness_install() -> None:
    if os.environ.get("HARNESS_WRAP") != "1" and "PYTHON_HARNESS_SETTINGS" not in os.environ:
        return
    try:
        from harness.launch.autoattach import install, restore_settings_from_carrier

        restore_settings_from_carrier()
        if os.environ.get("HARNESS_WRAP") == "1":
            install()
    except Exception as exc:  # never break the user's process
        sys.stderr.write(f"harness wrap: auto-attach unavailable in this process: {exc!r}\n")


def _chain_other_sitecustomize() -> None:
    """Run the sitecustomize this one shadows, if the environment has one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write(f"harness wrap: the environment's sitecustomize failed: {exc!r}\n")


_harness_install()
_chain_other_sitecustomize()
