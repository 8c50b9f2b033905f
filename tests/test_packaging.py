"""Packaging tells the truth: a wheel's tags match what it carries, and a missing native
helper is a build failure unless it is asked for."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, package_of, require_tool

ELF = b"\x7fELF"
HELPER = "sandlock/exec/helper/sandlock-exec"
RUN = "sandlock/exec/helper/sandlock-run"

pytestmark = pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")


def build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``pip wheel`` of a clean copy of the checkout (no helper built in it), offline:
    with the system's setuptools, which needs the wheel package before 70.1 (Debian 12: 66)."""
    require_tool("python3:wheel")
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".mypy_cache",
        ".ruff_cache", ".benchmarks", "benchmarks", "tests", "sandlock-exec"))
    venv = tmp_path / "venv"
    if not venv.exists():
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                       check=True)
    full = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1",
            "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env}
    out = tmp_path / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(source)],
                          env=full, capture_output=True, text=True, timeout=600)


def the_wheel(tmp_path: Path) -> tuple[str, dict[str, bytes]]:
    (wheel,) = (tmp_path / "wheels").glob("sandlock_agent-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        contents = {info.filename.split("/purelib/")[-1].split("/platlib/")[-1]: archive.read(info)
                    for info in archive.infolist() if not info.is_dir()}
    return wheel.name, contents


def the_command(contents: dict[str, bytes]) -> bytes:
    """The wheel's `sandlock` command (setup.py COMMAND: a script of the wheel)."""
    (command,) = [data for name, data in contents.items() if name.endswith(".data/scripts/sandlock")]
    return command


def test_a_wheel_with_the_helper_is_platform_tagged(tmp_path: Path) -> None:
    built = build(tmp_path)
    assert built.returncode == 0, built.stderr
    name, contents = the_wheel(tmp_path)
    assert name.endswith(f"-py3-none-linux_{os.uname().machine}.whl"), name
    assert contents[HELPER].startswith(ELF)
    # The `sandlock` command is the front end, with no path of this build in it (pip may
    # install the wheel anywhere); the source tree's front end, whose paths are built in,
    # stays out.
    command = the_command(contents)
    assert command.startswith(ELF)
    assert str(tmp_path).encode() not in command
    assert RUN not in contents


def test_without_the_helper_on_request_the_wheel_is_pure(tmp_path: Path) -> None:
    built = build(tmp_path, SANDLOCK_NO_NATIVE="1")
    assert built.returncode == 0, built.stderr
    name, contents = the_wheel(tmp_path)
    assert name.endswith("-py3-none-any.whl"), name
    assert not any(data.startswith(ELF) for data in contents.values())
    assert HELPER not in contents
    assert the_command(contents).startswith(b"#!python\n")  # pip names the interpreter


def test_a_helper_that_cannot_be_compiled_fails_the_build(tmp_path: Path) -> None:
    """No silent fallback: without a working compiler, the build stops and says why."""
    built = build(tmp_path, CC="/bin/false")
    assert built.returncode != 0
    assert "cannot compile" in built.stderr and "SANDLOCK_NO_NATIVE=1" in built.stderr, built.stderr
    assert not list((tmp_path / "wheels").glob("*.whl"))


def test_without_a_compiler_the_last_line_says_what_to_install(tmp_path: Path) -> None:
    """The line a reader sees last of the build's output (above pip's own) is what to do."""
    (tmp_path / "empty").mkdir()
    built = build(tmp_path, PATH=str(tmp_path / "empty"))  # no cc, no musl-gcc
    assert built.returncode != 0
    output = [line.strip() for line in built.stderr.splitlines() if line.strip()]
    last = output[output.index("[end of output]") - 1]
    packages = " ".join(package_of(compiler) for compiler in ("cc", "musl-gcc"))
    assert last == f"sandlock: no C compiler found; Debian/Ubuntu: sudo apt-get install {packages}", last
    assert not list((tmp_path / "wheels").glob("*.whl"))
