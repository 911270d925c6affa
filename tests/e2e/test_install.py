"""The wheel alone: build it, install it non-editable into a fresh venv, and run the harness from there.

An editable install finds every module through the source tree, so a package
missing from the wheel (``harness.report`` once was) goes unnoticed until a
user runs ``pip install .``. This test builds the wheel from a copy of the
sources, installs it without dependencies into a new venv that sees the
dependencies of ``.venv`` but not the project's editable install, and runs
the command line from that venv, outside the repository.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import EXAMPLE, REPO

SOURCES = ("harness", "plugins", "stages", "playbooks", "pyproject.toml", "setup.py", "README.md")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _fresh_venv(root: Path) -> tuple[Path, Path]:
    """A venv that imports the dependencies from this interpreter's site-packages, but runs none of its .pth files.

    A path line in a ``.pth`` file adds the directory to ``sys.path`` without
    processing the ``.pth`` files inside it, so ``__editable__.train_harness``
    (which points ``harness`` at the repository) stays inactive.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "_deps_of_dot_venv.pth").write_text("".join(f"{d}\n" for d in deps), encoding="utf-8")
    return python, site


@pytest.mark.slow  # a wheel build, a venv and three harness processes: ~20 s alone, a minute on a busy machine
def test_wheel_install_is_whole(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ behind and could pick up stale files
    src.mkdir()
    for name in [n for n in SOURCES if (REPO / n).exists()]:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))  # built here
        else:
            shutil.copy2(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH")}
    env.pop("VIRTUAL_ENV", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src)], tmp_path, env)
    (wheel,) = dist.glob("train_harness-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top_level == {"harness"}, f"the wheel puts {sorted(top_level)} at the top of site-packages"
    for member in ("harness/report/__init__.py", "harness/plugins/nan_guard.py", "harness/stages/runner.py",
                   "harness/playbooks/numeric-health.md", "harness/data/corpus.txt", "harness/launch/autoattach/site-hook/sitecustomize.py",
                   "harness/plugins/mlflow/tracker.py", "harness/stages/demo/faults.py", "harness/hf/optimizers/deepspeed.py"):
        assert member in names, f"{member} is not in the wheel"
    from harness.lib.scan_kernels import KERNELS

    compiled = KERNELS is not None or os.environ.get("HARNESS_REQUIRE_SCAN_KERNELS") == "1"  # this machine compiles them
    if compiled:
        assert any(n.startswith("harness/lib/_scan_kernels.") for n in names), "harness scan's C kernels are not in the wheel"

    python, site = _fresh_venv(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path, env)
    work = tmp_path / "work"  # outside the repository: no source folder on sys.path
    work.mkdir()
    where = _run([str(python), "-c", "import harness, harness.report, harness.plugins, harness.stages.runner, harness.playbooks; "
                  "from harness.lib.scan_kernels import KERNELS; "
                  "print(harness.__file__); print(harness.report.__file__); print(harness.plugins.__file__); "
                  "print(KERNELS.__file__ if KERNELS else '')"], work, env)
    found = where.stdout.split()
    assert len(found) == (4 if compiled else 3), f"harness scan's C kernels do not import from the wheel: {where.stdout}"
    for line in found:
        assert Path(line).resolve().is_relative_to(site.resolve()), f"imported from {line}, not from the new venv's {site}"
        assert not any(Path(line).resolve().is_relative_to(REPO / d) for d in ("harness", "plugins", "stages")), line

    harness = str(python.parent / "harness")  # the console script of the installed wheel
    assert "--out" in _run([harness, "demo", "--help"], work, env).stdout

    out = work / "run"
    _run([harness, "wrap", "--", str(python), str(EXAMPLE), "--output_dir", str(out), "--max_steps", "3"], work, env, timeout=600)
    report = out / "harness" / "report.md"
    assert report.exists(), "train() ended without a report: harness.report is missing from the install"

    report.unlink()
    (out / "harness" / "report.html").unlink(missing_ok=True)
    _run([harness, "report", str(out), "--no-plots"], work, env)
    assert report.exists() and "#" in report.read_text(encoding="utf-8")
