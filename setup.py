"""Package discovery for train-harness; all other metadata is in pyproject.toml.

One import namespace: ``plugins/``, ``stages/`` and ``playbooks/`` install as
``harness.plugins``, ``harness.stages`` and ``harness.playbooks``, so nothing
generic (``plugins``, ``stages``) lands at the top of site-packages.
setuptools' ``[tool.setuptools.packages.find]`` cannot find packages below a
folder mapped to another name, so the packages are found here, folder by
folder, and never listed by hand: a new subpackage (``harness/report/``) is
in the wheel without editing anything. ``tests/test_install.py`` builds the
wheel and runs it from a fresh venv.

One optional C extension, ``harness.lib._scan_kernels`` (the inner loops of
``harness scan``): where it cannot be compiled, the install goes on without
it and the scan runs its numpy code (``harness/lib/scan_kernels.py``).
"""
from setuptools import Extension, find_packages, setup

# import name -> folder in the repository (the same mapping serves regular and editable installs)
PACKAGE_DIR = {"harness": "harness", "harness.plugins": "plugins", "harness.stages": "stages", "harness.playbooks": "playbooks"}


def discover() -> list[str]:
    found: list[str] = []
    for name, folder in PACKAGE_DIR.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


KERNELS = Extension("harness.lib._scan_kernels", ["harness/lib/_scan_kernels.c"], extra_compile_args=["-O3"], optional=True)

setup(package_dir=PACKAGE_DIR, packages=discover(), ext_modules=[KERNELS])
