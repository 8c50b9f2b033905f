"""Build step for the native helper; everything else is in pyproject.toml.

``sandlock/exec/helper/sandlock_exec.c`` becomes ``sandlock/exec/helper/sandlock-exec`` (the
Python API's fast path, see sandlock/exec/native.py) when a C compiler is available.
If compiling fails the install goes on without it and the API uses its fork server.
Build it by hand (e.g. for a source checkout): ``python setup.py build_helper``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from setuptools import Command, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    try:
        from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]
    except ImportError:  # neither: no wheel can be built here (build_helper still can);
        bdist_wheel = None  # pip builds wheels with setuptools>=70.1 (pyproject.toml)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join("sandlock", "exec", "helper", "sandlock_exec.c")
TARGET = os.path.join("sandlock", "exec", "helper", "sandlock-exec")


def compile_helper(out_dir: str) -> bool:
    """Compile into ``out_dir``/sandlock/exec/helper. Static, with musl if it is installed
    (Debian: musl-tools): its start-up costs ~0.2 ms less per call than glibc's, which
    probes the CPU; then static glibc; then a dynamic build."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    musl = None if os.environ.get("CC") else shutil.which("musl-gcc")  # CC= wins
    attempts = ([[musl, "-static"]] if musl else []) + ([[cc, "-static"], [cc]] if cc else [])
    if not attempts:
        print("sandlock: no C compiler: the Python API will use its fork server", file=sys.stderr)
        return False
    target = os.path.join(out_dir, TARGET)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    for compiler, *extra in attempts:
        command = [compiler, "-O2", "-Wall", *extra, "-o", target, os.path.join(HERE, SOURCE)]
        try:
            built = subprocess.run(command, capture_output=True).returncode == 0
        except OSError:  # CC names no program: try the next way, then go without
            built = False
        if built:
            os.chmod(target, 0o755)
            return True
    print(f"sandlock: compiling {SOURCE} failed: the Python API will use its fork server",
          file=sys.stderr)
    return False


class BuildPy(build_py):
    """build_py, plus the helper (into the source tree for an editable install)."""

    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        compile_helper(HERE if editable else self.build_lib)


class BuildHelper(Command):
    """``python setup.py build_helper``: compile the helper in place."""

    description = "compile sandlock/exec/helper/sandlock-exec in the source tree"
    user_options: list[tuple[str, str, str]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        if not compile_helper(HERE):
            raise SystemExit(1)


class BdistWheel(bdist_wheel or Command):  # type: ignore[misc]
    """A wheel carrying the compiled helper says so: any Python 3, this platform only."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        return ("py3", "none", super().get_tag()[2])


setup(cmdclass={"build_py": BuildPy, "build_helper": BuildHelper,
               **({"bdist_wheel": BdistWheel} if bdist_wheel is not None else {})})
