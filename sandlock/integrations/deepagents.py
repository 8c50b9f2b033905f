"""deepagents: a sandbox backend whose commands and file operations run confined.

``SandlockBackend(workspace)`` implements deepagents' ``BaseSandbox`` (its
``SandboxBackendProtocol``): ``execute(command)`` runs ``/bin/sh -c command`` under
the policy (the built-in ``shell`` profile by default; ``${workspace}`` is the
workspace), and so do the file tools deepagents builds on it (``ls``, ``read_file``,
``grep``, ``glob``, ``edit_file``, delete). ``upload_files`` and ``download_files``
(``write_file`` goes through them) are :meth:`sandlock.Sandbox.call` s of the standard
library's ``Path.read_bytes``/``write_bytes`` under the same policy: no file operation
runs in the agent's process, so none reaches further than the commands do.

The paths are the host's (Landlock confines, it does not remap): tell the model where
the workspace is. Imports ``deepagents`` (the ``langchain`` extra).
"""

from __future__ import annotations

import os
import pathlib
import uuid
from typing import TYPE_CHECKING, Mapping, Optional

from deepagents.backends.protocol import (
    ExecuteResponse,
    FileDownloadResponse,
    FileOperationError,
    FileUploadResponse,
)
from deepagents.backends.sandbox import BaseSandbox

from ._tools import failure, sandbox_for

if TYPE_CHECKING:
    from ..api.registry import Registry
    from ..api.sandbox import PolicyLike, Sandbox

__all__ = ["SandlockBackend"]

#: Seconds a command may run when neither the policy nor the backend sets a limit.
DEFAULT_TIMEOUT = 120
#: Characters of a command's output the model is shown; the rest is cut and said so.
MAX_OUTPUT = 100_000


class SandlockBackend(BaseSandbox):
    """A deepagents sandbox backend confined by sandlock.

    One of ``policy`` (default ``"shell"``, filled with ``workspace`` and ``vars``),
    ``registry`` (its policy ``name``, default ``"shell"``) or ``sandbox``. Commands
    start in ``workspace``, with the policy's environment and ``env`` (as
    ``Sandbox.run``'s ``env=``). deepagents' file tools run ``python3`` from ``PATH``:
    it must name an interpreter the policy grants (a venv's needs the venv profile;
    ``env={"PATH": "/usr/bin:/bin"}`` picks the system's).

    A command's wall-clock limit is the policy's ``[limits] timeout``; ``timeout`` and
    the model's own ``timeout`` argument may only shorten it (the smallest applies), and
    :data:`DEFAULT_TIMEOUT` stands in only for a policy that sets none.
    """

    def __init__(self, workspace: str, *, policy: Optional[PolicyLike] = None,
                 registry: Optional[Registry] = None, sandbox: Optional[Sandbox] = None,
                 vars: Optional[Mapping[str, str]] = None, name: str = "shell",
                 env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
                 max_output: int = MAX_OUTPUT) -> None:
        self.workspace = os.path.abspath(workspace)
        if policy is None and registry is None and sandbox is None:
            policy = "shell"
        filled = None if sandbox is not None else {"workspace": self.workspace, **(vars or {})}
        self.sandbox = sandbox_for(name, policy=policy, registry=registry, sandbox=sandbox,
                                   vars=filled)
        self.env = dict(env or {})
        self.timeout = timeout
        self.max_output = max_output
        self._id = f"sandlock-{uuid.uuid4().hex[:12]}"

    @property
    def id(self) -> str:
        return self._id

    def execute(self, command: str, *, timeout: Optional[int] = None) -> ExecuteResponse:
        """``/bin/sh -c command`` in the workspace, confined; stdout and stderr combined."""
        from ..api.results import Outcome
        from ..api.sandbox import PIPE, STDOUT

        if not command or not isinstance(command, str):
            return ExecuteResponse(output="Error: the command must be a non-empty string.",
                                   exit_code=1)
        limit = self._limit(timeout)
        try:
            result = self.sandbox.run(["/bin/sh", "-c", command], cwd=self.workspace,
                                      stdout=PIPE, stderr=STDOUT, timeout=limit, env=self.env)
        except Exception as exc:  # noqa: BLE001 - the model reads why; the agent goes on
            return ExecuteResponse(output=f"[sandlock: {failure(exc)}]", exit_code=125)
        output = (result.stdout or b"").decode("utf-8", errors="replace")
        if result.outcome is Outcome.TIMED_OUT:
            output += f"\n[sandlock: timed out after {limit:g} s; the command's processes were killed]"
        elif result.outcome is Outcome.NOT_STARTED and result.error is not None:
            output += f"\n[sandlock: {failure(result.error)}]"
        truncated = len(output) > self.max_output
        if truncated:
            output = output[: self.max_output] + f"\n[sandlock: output cut at {self.max_output} characters]"
        return ExecuteResponse(output=output, exit_code=result.returncode, truncated=truncated)

    def _limit(self, asked: Optional[int]) -> float:
        """The command's wall-clock limit: the smaller of the policy's ``timeout`` and the
        backend's (DEFAULT_TIMEOUT when neither is set), shortened to what the model
        ``asked`` for, never lengthened (deepagents lets it ask for up to an hour, or 0
        for "no limit": ignored). The model is told the limit that ended its command."""
        given = (self.sandbox.timeout, self.timeout)
        ceiling = min((limit for limit in given if limit), default=DEFAULT_TIMEOUT)
        return min(ceiling, asked) if asked else ceiling

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        """Each file written by a confined process (its parents made as needed)."""
        out = []
        for path, content in files:
            target = pathlib.Path(self.workspace, path)  # an absolute path stays as given
            try:
                self.sandbox.call(os.makedirs, str(target.parent), exist_ok=True)
                self.sandbox.call(pathlib.Path.write_bytes, target, bytes(content))
                out.append(FileUploadResponse(path=path))
            except Exception as exc:  # noqa: BLE001 - per-file errors, as the protocol asks
                out.append(FileUploadResponse(path=path, error=_error(exc)))
        return out

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        """Each file read by a confined process."""
        out = []
        for path in paths:
            try:
                data = self.sandbox.call(pathlib.Path.read_bytes, pathlib.Path(self.workspace, path))
            except Exception as exc:  # noqa: BLE001
                out.append(FileDownloadResponse(path=path, error=_error(exc)))
                continue
            if not isinstance(data, bytes):  # a confined process answers untrusted data
                out.append(FileDownloadResponse(path=path, error="invalid_path"))
                continue
            out.append(FileDownloadResponse(path=path, content=data))
        return out


def _error(exc: BaseException) -> FileOperationError | str:
    """The protocol's error code for what a confined file operation raised; for anything
    else (sandlock's own errors among them) the exception's type and message."""
    codes: list[tuple[type[BaseException], FileOperationError]] = [
        (FileNotFoundError, "file_not_found"), (PermissionError, "permission_denied"),
        (IsADirectoryError, "is_directory")]
    for kind, code in codes:
        if isinstance(exc, kind):
            return code
    return failure(exc)

