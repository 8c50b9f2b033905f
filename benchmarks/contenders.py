"""Find or install the other sandboxes, each into a temporary place, never into the project.

- bubblewrap and gVisor's ``runsc``: Debian packages (``apt-get`` when root).
- Anthropic's ``srt``: the npm package ``@anthropic-ai/sandbox-runtime`` in a cache
  directory (it also needs bwrap, socat and ripgrep from Debian).
- multikernel's ``sandlock`` wheel from PyPI: ``pip install --target`` a cache
  directory. It has the same import name as this project, so it is only ever
  imported by a worker process whose ``sys.path`` holds that directory.
- matplotlib for the plots, likewise in the cache when the environment lacks it.

Every function returns what it found, or a reason to skip; nothing here fails the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

MULTIKERNEL_VERSION = "0.9.0"  # the version ANCHORS.md measured
SRT_PACKAGE = "@anthropic-ai/sandbox-runtime"
APT_PACKAGES = {"bwrap": "bubblewrap", "runsc": "runsc", "socat": "socat", "rg": "ripgrep"}


@dataclass
class Setup:
    """Where each contender lives, or why it is missing."""

    cache: Path
    install: bool
    log: list[str] = field(default_factory=list)
    _apt_updated: bool = False

    def say(self, message: str) -> None:
        self.log.append(message)
        print(f"setup: {message}", file=sys.stderr, flush=True)

    def run(self, argv: list[str], timeout: float = 600) -> Optional[str]:
        """Run an installer quietly; None on success, else the reason."""
        self.say("$ " + " ".join(argv))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        if proc.returncode:
            tail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            return f"{argv[0]} exited {proc.returncode}: {tail[:200]}"
        return None

    # ------------------------------------------------------------------ Debian

    def binary(self, name: str) -> tuple[Optional[str], str]:
        """A Debian-packaged program: found on PATH, or installed with apt-get when allowed."""
        found = shutil.which(name)
        if found:
            return found, ""
        package = APT_PACKAGES[name]
        if not self.install:
            return None, f"{name} not installed (apt-get install {package}; quick mode installs nothing)"
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            return None, f"{name} not installed and apt-get needs root (apt-get install {package})"
        if not self._apt_updated:
            why = self.run(["apt-get", "update", "-qq"])
            if why:
                return None, f"apt-get update failed: {why}"
            self._apt_updated = True
        why = self.run(["apt-get", "install", "-y", "-qq", package])
        found = shutil.which(name)
        return (found, "") if found else (None, f"apt-get install {package} failed: {why}")

    # ------------------------------------------------------------------ npm

    def srt(self) -> tuple[Optional[list[str]], str]:
        """The argv prefix that runs ``srt`` with a settings file that denies network and writes."""
        for helper in ("bwrap", "socat", "rg"):
            found, why = self.binary(helper)
            if not found:
                return None, f"srt needs {helper}: {why}"
        home = self.cache / "srt"
        cli = home / "node_modules" / ".bin" / "srt"
        if not cli.exists():
            if not self.install:
                return None, f"{SRT_PACKAGE} not in {home} (quick mode installs nothing)"
            if not shutil.which("npm"):
                return None, "npm not found (apt-get install npm)"
            home.mkdir(parents=True, exist_ok=True)
            failed = self.run(["npm", "install", "--silent", "--no-audit", "--no-fund",
                               "--prefix", str(home), SRT_PACKAGE])
            if failed or not cli.exists():
                return None, f"npm install {SRT_PACKAGE} failed: {failed}"
        settings = home / "settings.json"
        settings.write_text(json.dumps({
            "network": {"allowedDomains": [], "deniedDomains": []},
            "filesystem": {"denyRead": [], "allowWrite": [], "denyWrite": []},
        }))
        return [str(cli), "--settings", str(settings)], ""

    def srt_version(self) -> str:
        manifest = self.cache / "srt" / "node_modules" / SRT_PACKAGE / "package.json"
        try:
            return str(json.loads(manifest.read_text())["version"])
        except (OSError, ValueError, KeyError):
            return "?"

    # ------------------------------------------------------------------ PyPI

    def pip_target(self, requirement: str, target: Path, marker: str) -> Optional[str]:
        """``pip install --target`` unless ``target/marker`` exists; None on success."""
        if (target / marker).exists():
            return None
        if not self.install:
            return f"{requirement} not in {target} (quick mode installs nothing)"
        return self.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                         "--target", str(target), requirement])

    def multikernel(self) -> tuple[Optional[Path], str]:
        target = self.cache / f"multikernel-sandlock-{MULTIKERNEL_VERSION}"
        why = self.pip_target(f"sandlock=={MULTIKERNEL_VERSION}", target, "sandlock/sandbox.py")
        if why:
            return None, why
        return target, ""

    def matplotlib(self) -> str:
        """Make ``import matplotlib`` work (from the environment or the cache); '' on success."""
        if importlib.util.find_spec("matplotlib"):
            return ""
        target = self.cache / "matplotlib"
        why = self.pip_target("matplotlib", target, "matplotlib/__init__.py")
        if why:
            return f"matplotlib unavailable: {why}"
        sys.path.append(str(target))
        return ""


def version_of(argv: list[str]) -> str:
    """First line a program prints about its version, or '?'."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (proc.stdout or proc.stderr).strip().splitlines()
    return text[0][:80] if text else "?"
