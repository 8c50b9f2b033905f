"""Build step for the native helper; everything else is in pyproject.toml.

``sandlock/exec/helper/sandlock_exec.c`` becomes ``sandlock/exec/helper/sandlock-exec``, the
executor of the Python API's commands (sandlock/exec/native.py), built with all warnings
as errors. If it cannot be compiled the install fails, unless SANDLOCK_NO_NATIVE=1 asks
for an install without it (the API then starts commands through its fork server, and the
wheel is tagged pure). A wheel with the helper is tagged py3-none-<platform>.
Build it by hand (e.g. for a source checkout): ``python setup.py build_helper``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from typing import Any, ClassVar, Optional

from setuptools import Command, setup
from setuptools.command.build_py import build_py


def _bdist_wheel() -> Optional[type]:
    """setuptools' bdist_wheel (>= 70.1, what pip builds with: pyproject.toml), else the
    wheel package's; None if neither is here (build_helper still works then)."""
    for module in ("setuptools.command.bdist_wheel", "wheel.bdist_wheel"):
        try:
            base: type = importlib.import_module(module).bdist_wheel
            return base
        except ImportError:
            continue
    return None


HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join("sandlock", "exec", "helper", "sandlock_exec.c")
TARGET = os.path.join("sandlock", "exec", "helper", "sandlock-exec")
#: The native front end of `sandlock run` (docs/design.md "Native front end"): execs
#: the Python CLI with the interpreter that ran this build on anything it does not run.
RUN_SOURCE = os.path.join("sandlock", "exec", "helper", "sandlock_run.c")
RUN_TARGET = os.path.join("sandlock", "exec", "helper", "sandlock-run")
#: The system packages (scripts/install.sh installs them); COMPILERS: what the build runs.
PACKAGES = os.path.join("scripts", "system-packages.txt")
COMPILERS = ("cc", "musl-gcc")


#: bubblewrap's warning set, and all warnings are errors: the helper confines every command
#: the Python API starts, so a warning is a bug until shown otherwise.
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wformat=2", "-Werror=format-security",
            "-Werror=empty-body", "-Werror=strict-prototypes", "-Werror=missing-prototypes",
            "-Werror=implicit-function-declaration", "-Werror=pointer-arith", "-Werror=init-self",
            "-Werror=missing-declarations", "-Werror=return-type", "-Werror=overflow",
            "-Werror=int-conversion", "-Werror=parentheses", "-Werror=incompatible-pointer-types",
            "-Werror=misleading-indentation", "-Werror=missing-include-dirs"]
#: Set to 1 to install without the helper, on purpose: the API then starts every command
#: through its fork server (the same confinement steps, in Python), and the wheel is pure.
ENV_NO_NATIVE = "SANDLOCK_NO_NATIVE"


def without_native() -> bool:
    return os.environ.get(ENV_NO_NATIVE) == "1"


def compile_helper(out_dir: str) -> None:
    """Compile into ``out_dir``/sandlock/exec/helper. Static, with musl if it is installed
    (Debian: musl-tools): its start-up costs ~0.2 ms less per call than glibc's, which
    probes the CPU; then static glibc; then a dynamic build. If none builds, the install
    fails (SystemExit) unless SANDLOCK_NO_NATIVE=1 says to go without."""
    if without_native():
        print(f"sandlock: {ENV_NO_NATIVE}=1: no native helper; the Python API will start "
              "commands through its fork server", file=sys.stderr)
        return
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    musl = None if os.environ.get("CC") else shutil.which("musl-gcc")  # CC= wins
    attempts = ([[musl, "-static"]] if musl else []) + ([[cc, "-static"], [cc]] if cc else [])
    _compile(attempts, os.path.join(out_dir, TARGET), [os.path.join(HERE, SOURCE)])
    _compile(attempts, os.path.join(out_dir, RUN_TARGET), [*run_defines(),
                                                           os.path.join(HERE, RUN_SOURCE)])


def c_string(text: str) -> str:
    """``text`` as a C string literal; SystemExit for text that would need escapes (an
    interpreter path with a quote is no path to bake into the front end)."""
    if not text.isprintable() or not text.isascii() or '"' in text or "\\" in text:
        raise SystemExit(f"sandlock: cannot build {RUN_SOURCE}: {text!r} needs escaping")
    return f'"{text}"'


def run_defines() -> list[str]:
    """The front end's build facts: the interpreter of the Python CLI, the version."""
    with open(os.path.join(HERE, "sandlock", "__init__.py"), encoding="utf-8") as handle:
        version = next(line.split('"')[1] for line in handle if line.startswith("__version__ = "))
    return [f"-DSANDLOCK_PYTHON={c_string(sys.executable)}",
            f"-DSANDLOCK_VERSION={c_string(version)}"]


def front_end_variant(target: str, python: str, package_file: str,
                      key_directory: Optional[str] = None) -> Optional[str]:
    """Build a copy of the front end elsewhere (benchmarks/, tests/): ``python`` run on a
    fallback (its key still names this interpreter, which stores the entries), the
    package above ``package_file``, the key file's directory ``key_directory``; the
    compiler's complaint, or None once built."""
    defines = [f"-DSANDLOCK_PYTHON={c_string(python)}",
               f"-DSANDLOCK_KEY_PYTHON={c_string(sys.executable)}",
               f"-DSANDLOCK_PACKAGE_FILE={c_string(package_file)}",
               *(d for d in run_defines() if not d.startswith("-DSANDLOCK_PYTHON="))]
    if key_directory is not None:
        defines.append(f"-DSANDLOCK_KEY_DIRECTORY={c_string(key_directory)}")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    built = subprocess.run([cc, "-O2", *WARNINGS, "-o", target, *defines,
                            os.path.join(HERE, RUN_SOURCE)], capture_output=True, text=True)
    return None if built.returncode == 0 else built.stderr.strip()[-2000:] or "cc failed"


def _compile(attempts: list[list[str]], target: str, sources: list[str]) -> None:
    """Compile ``sources`` into ``target`` with the first of ``attempts`` that works."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    errors = []
    compiler = ""
    for compiler, *extra in attempts:
        command = [compiler, "-O2", *WARNINGS, *extra, "-o", target, *sources]
        try:
            built = subprocess.run(command, capture_output=True, text=True)
        except OSError as exc:  # CC names no program: try the next way
            errors.append(f"{compiler}: {exc}")
            continue
        if built.returncode == 0:
            os.chmod(target, 0o755)
            return
        errors.append(f"{' '.join(command)}:\n{built.stderr.strip()}")
    raise SystemExit("\n".join([
        f"sandlock: cannot compile {sources[-1]}, a native part of sandlock", *errors,
        f"sandlock: {ENV_NO_NATIVE}=1 installs without it (the API then uses its fork server)",
        # Last, so that it is the line a reader sees above pip's own: what to do.
        f"sandlock: {'the C compiler failed (above)' if errors else 'no C compiler found'}; "
        f"Debian/Ubuntu: {compiler_install_command()}"]))


def compiler_install_command() -> str:
    """``sudo apt-get install ...`` with the packages of scripts/system-packages.txt that
    provide the compilers (the one list); its README step when the list is not here."""
    try:
        with open(os.path.join(HERE, PACKAGES), encoding="utf-8") as handle:
            rows = [line.split() for line in handle if line.strip() and not line.startswith("#")]
    except OSError:
        return "scripts/install.sh from a checkout (README: Install and run)"
    return "sudo apt-get install " + " ".join(row[0] for row in rows if row[2] in COMPILERS)


class BuildPy(build_py):
    """build_py, plus the helper (into the source tree for an editable install)."""

    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        out = HERE if editable else self.build_lib
        if without_native() and not editable:  # a helper built earlier in the tree stays out
            for target in (TARGET, RUN_TARGET):
                try:
                    os.remove(os.path.join(out, target))
                except FileNotFoundError:
                    pass
        compile_helper(out)


class BuildHelper(Command):
    """``python setup.py build_helper``: compile the helper in place."""

    description = "compile sandlock/exec/helper/sandlock-exec in the source tree"
    user_options: ClassVar[list[tuple[str, Optional[str], str]]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        compile_helper(HERE)


def wheel_command(base: type) -> type:
    """bdist_wheel, tagged by what the wheel carries: with the compiled helper, any
    Python 3 on this platform only; without it (SANDLOCK_NO_NATIVE=1), pure Python."""

    class BdistWheel(base):  # type: ignore[misc]  # a base found at build time
        root_is_pure: bool

        def finalize_options(self) -> None:
            super().finalize_options()
            self.root_is_pure = without_native()

        def get_tag(self) -> tuple[str, str, str]:
            if without_native():
                return ("py3", "none", "any")
            tag: tuple[str, str, str] = super().get_tag()
            return ("py3", "none", tag[2])

    return BdistWheel


if __name__ == "__main__":  # setuptools runs it so; benchmarks/ imports the recipe above
    BDIST_WHEEL = _bdist_wheel()
    commands: dict[str, Any] = {"build_py": BuildPy, "build_helper": BuildHelper}
    if BDIST_WHEEL is not None:
        commands["bdist_wheel"] = wheel_command(BDIST_WHEEL)
    setup(cmdclass=commands)
