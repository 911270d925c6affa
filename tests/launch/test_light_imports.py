"""The launcher validates a config without loading torch or transformers (issue 18: start-up cost)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO, findings_of


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    """Each check runs in a fresh interpreter: pytest itself has long imported torch."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_validating_every_plugin_loads_neither_torch_nor_transformers() -> None:
    result = run_fresh(
        """
        from harness.core.registry import BUILTIN_PLUGINS
        from harness.launch.light_imports import loaded_for_real
        from harness.launch.wrap import validate
        validate(None, list(BUILTIN_PLUGINS))
        print({name: loaded_for_real(name) for name in ("torch", "transformers", "datasets", "mlflow")})
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "{'torch': False, 'transformers': False, 'datasets': False, 'mlflow': False}", (
        "a module imported while validating reads torch (or transformers) at import time, e.g. a dict of dtypes at module "
        "level or `import torch.nn.functional as F`: move that use into the function that needs it\n" + result.stdout + result.stderr[-3000:]
    )


def test_a_bad_config_is_still_refused_without_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "h.yaml"
    bad.write_text("nan_guard:\n  action: explode\n")
    result = run_fresh(
        f"""
        import sys
        from harness.core.errors import HarnessError
        from harness.launch.light_imports import loaded_for_real
        from harness.launch.wrap import validate
        try:
            validate({str(bad)!r}, [])
        except HarnessError as e:
            print("refused:", "action" in str(e), loaded_for_real("torch"))
        """
    )
    assert result.stdout.strip() == "refused: True False", result.stdout + result.stderr[-3000:]


def test_a_placeholder_loads_the_real_package_on_first_use() -> None:
    result = run_fresh(
        """
        import sys
        from harness.launch.light_imports import DeferredModule, heavy_imports_deferred, loaded_for_real
        with heavy_imports_deferred(["xml", "colorsys"]):
            import colorsys
            import xml
        assert isinstance(colorsys, DeferredModule) and not loaded_for_real("colorsys")
        assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)  # the first read loads it
        assert loaded_for_real("colorsys") and not isinstance(sys.modules["colorsys"], DeferredModule)
        import xml.dom.minidom  # a submodule import through a placeholder works too
        print(xml.dom.minidom.parseString("<a/>").documentElement.tagName)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "a"


def test_a_package_that_is_not_installed_still_fails_to_import() -> None:
    """A plugin whose dependency is missing must fail validation in the launcher, not later in the job."""
    result = run_fresh(
        """
        from harness.launch.light_imports import heavy_imports_deferred
        with heavy_imports_deferred(["no_such_package_here"]):
            try:
                import no_such_package_here
            except ImportError:
                print("ImportError")
        """
    )
    assert result.stdout.strip() == "ImportError", result.stdout + result.stderr[-2000:]


@pytest.mark.slow  # a whole wrapped client run
def test_wrapping_a_client_script_validates_in_the_launcher_without_torch(tmp_path: Path) -> None:
    """Outside in: `harness wrap -- python examples/run_clm.py` with every default plugin. ``-X importtime`` logs the
    launcher's imports only (the child does not inherit it): a placeholder shows as ``torch``, a real load as ``torch._C``."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLES / "clm_data.py"), "--out", str(data)], check=True, capture_output=True)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HARNESS_CONFIG": ""}
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "harness.cli", "wrap", "--", sys.executable, str(EXAMPLES / "run_clm.py"),
         "--train_file", str(data / "train.txt"), "--validation_file", str(data / "validation.txt"), "--do_train",
         "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "4", "--use_cpu", "--report_to", "none"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    launcher = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    # it did import the plugins to validate them (modules imported by importlib.import_module are not timed, their own imports are)
    assert "harness.plugins.contamination.plugin" in launcher and "harness.plugins.spike_capture.notes" in launcher
    assert not [m for m in launcher if m.startswith(("torch.", "transformers.", "datasets."))], "the launcher loaded a framework"
    assert (out / "harness" / "findings.jsonl").is_file() and findings_of(out) == []  # and the child ran the harness as ever


def test_version_is_said_without_loading_torch() -> None:
    """Issue 46 item 7: `harness --version` exited 2 (no such option). It prints the installed version and exits 0."""
    done = run_fresh("""
        import sys
        from harness.cli import main
        try:
            main(["--version"])
        except SystemExit as exit:
            print("exit", exit.code, "torch" in sys.modules)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    from importlib.metadata import version

    assert f"harness {version('train-harness')} (train-harness)" in done.stdout and "exit 0 False" in done.stdout, done.stdout
