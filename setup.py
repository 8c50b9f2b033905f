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
#: The `sandlock` command the install puts on PATH (setup(scripts=)): the same front end,
#: built to find the interpreter and the package at run time (from the record the Python
#: CLI beside it writes, docs/design.md "Native front end"); a Python script without the
#: native parts. The Python CLI itself is pip's console script `sandlock-python`.
COMMAND = os.path.join("build", "sandlock-command", "sandlock")
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
    _compile(attempts(), os.path.join(out_dir, TARGET), [os.path.join(HERE, SOURCE)])


def compile_front_end(out_dir: str) -> None:
    """The front end with this interpreter's paths built in, into ``out_dir``'s package: a
    tool of the source tree (tests, benchmarks) and of an editable install, never of a
    wheel (installed elsewhere, those paths may not exist)."""
    if not without_native():
        _compile(attempts(), os.path.join(out_dir, RUN_TARGET), [*run_defines(),
                                                                 os.path.join(HERE, RUN_SOURCE)])


def attempts() -> list[list[str]]:
    """The ways to compile, best first: static with musl if it is installed (CC= wins),
    then static, then dynamic with the C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    musl = None if os.environ.get("CC") else shutil.which("musl-gcc")
    return ([[musl, "-static"]] if musl else []) + ([[cc, "-static"], [cc]] if cc else [])


def c_string(text: str) -> str:
    """``text`` as a C string literal; SystemExit for text that would need escapes (an
    interpreter path with a quote is no path to bake into the front end)."""
    if not text.isprintable() or not text.isascii() or '"' in text or "\\" in text:
        raise SystemExit(f"sandlock: cannot build {RUN_SOURCE}: {text!r} needs escaping")
    return f'"{text}"'


def version_define() -> str:
    with open(os.path.join(HERE, "sandlock", "__init__.py"), encoding="utf-8") as handle:
        version = next(line.split('"')[1] for line in handle if line.startswith("__version__ = "))
    return f"-DSANDLOCK_VERSION={c_string(version)}"


def run_defines() -> list[str]:
    """The in-tree front end's build facts: the interpreter of the Python CLI, the version."""
    return [f"-DSANDLOCK_PYTHON={c_string(sys.executable)}", version_define()]


def front_end_variant(target: str, python: Optional[str], package_file: Optional[str],
                      key_directory: Optional[str] = None) -> Optional[str]:
    """Build a copy of the front end elsewhere (benchmarks/, tests/): ``python`` run on a
    fallback (its key still names this interpreter, which stores the entries), the
    package above ``package_file``, the key file's directory ``key_directory``; with no
    ``python``, the installed command (COMMAND), which finds both at run time. The
    compiler's complaint, or None once built."""
    defines = [version_define()]
    if python is not None:
        defines += [f"-DSANDLOCK_PYTHON={c_string(python)}",
                    f"-DSANDLOCK_KEY_PYTHON={c_string(sys.executable)}",
                    f"-DSANDLOCK_PACKAGE_FILE={c_string(package_file or '')}"]
    if key_directory is not None:
        defines.append(f"-DSANDLOCK_KEY_DIRECTORY={c_string(key_directory)}")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    built = subprocess.run([cc, "-O2", *WARNINGS, "-o", target, *defines,
                            os.path.join(HERE, RUN_SOURCE)], capture_output=True, text=True)
    return None if built.returncode == 0 else built.stderr.strip()[-2000:] or "cc failed"


def bundled_front_end(target: str) -> None:
    """The front end as an object for the single-file binary's stub to link
    (scripts/build_binary.sh): SANDLOCK_BUNDLED, no main, nothing built in but the version."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    built = subprocess.run([cc, "-O2", *WARNINGS, "-fPIE", "-c", "-DSANDLOCK_BUNDLED",
                            version_define(), "-o", target, os.path.join(HERE, RUN_SOURCE)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"sandlock: cannot compile {RUN_SOURCE} for the binary:\n"
                         f"{built.stderr.strip()}")


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
    """build_py, plus the helper (into the source tree for an editable install) and the
    `sandlock` command."""

    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        out = HERE if editable else self.build_lib
        # Programs built earlier in the tree stay out of a wheel: the helper without the
        # native parts; the in-tree front end always (its paths are this machine's).
        for target in ((TARGET, RUN_TARGET) if without_native() else (RUN_TARGET,)):
            if not editable and os.path.exists(os.path.join(out, target)):
                os.remove(os.path.join(out, target))
        compile_helper(out)
        if editable:
            compile_front_end(out)
        build_command()


#: The `sandlock` command of an install without the native parts: the Python CLI.
PYTHON_COMMAND = "#!python\nfrom sandlock.__main__ import main\n\nmain()\n"


def build_command() -> None:
    """COMMAND: the front end with no path built in, or PYTHON_COMMAND without the native
    parts."""
    target = os.path.join(HERE, COMMAND)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.exists(target):
        os.remove(target)
    if without_native():
        with open(target, "w", encoding="utf-8") as handle:
            handle.write(PYTHON_COMMAND)
        return
    _compile(attempts(), target, [version_define(), os.path.join(HERE, RUN_SOURCE)])


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
        compile_front_end(HERE)


def scripts_command() -> type:
    """build_scripts, copying the compiled `sandlock` command as it is (distutils reads
    every script as text, for a shebang to adjust)."""
    base: type = importlib.import_module("distutils.command.build_scripts").build_scripts

    class BuildScripts(base):  # type: ignore[misc]  # a base found at build time
        scripts: list[str]
        build_dir: str

        def copy_scripts(self) -> tuple[list[str], list[str]]:
            compiled = []
            for script in self.scripts:
                with open(script, "rb") as handle:
                    if not handle.read(2) == b"#!":
                        compiled.append(script)
            self.scripts = [s for s in self.scripts if s not in compiled]
            outfiles: list[str]
            updated: list[str]
            outfiles, updated = super().copy_scripts() if self.scripts else ([], [])
            self.mkpath(self.build_dir)
            for script in compiled:
                target = os.path.join(self.build_dir, os.path.basename(script))
                self.copy_file(script, target)
                os.chmod(target, 0o755)
                outfiles.append(target)
                updated.append(target)
            return outfiles, updated

    return BuildScripts


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
    commands: dict[str, Any] = {"build_py": BuildPy, "build_helper": BuildHelper,
                                "build_scripts": scripts_command()}
    if BDIST_WHEEL is not None:
        commands["bdist_wheel"] = wheel_command(BDIST_WHEEL)
    if not os.path.exists(os.path.join(HERE, COMMAND)):  # build_py makes it before it is copied
        os.makedirs(os.path.dirname(os.path.join(HERE, COMMAND)), exist_ok=True)
        with open(os.path.join(HERE, COMMAND), "w", encoding="utf-8") as handle:
            handle.write(PYTHON_COMMAND)
    setup(cmdclass=commands, scripts=[COMMAND])
