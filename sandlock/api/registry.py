"""A tool registry: the policies of all of an agent's tools, loaded once.

Two layouts, chosen by what the path is:

* a directory: ``NAME.toml`` per tool (``policies/read_file.toml`` is tool ``read_file``);
* one file: a ``[tools.NAME]`` table per tool, each with the policy schema.

``extends`` paths are relative to the file that names them. Variables are given
per call (``vars=``): the registry keeps the parsed text and builds one
:class:`~sandlock.api.sandbox.Sandbox` per (tool, variables), reused by later calls.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

from ..errors import PolicyError
from ..policy.model import _parse_text, _read, loads_policy, policy_from_dict

if TYPE_CHECKING:
    from ..policy.model import Policy
    from .sandbox import Result, Sandbox

#: Sandboxes kept per registry (each holds one ruleset fd).
CACHE_SIZE = 32


class Registry:
    """The policies of an agent's tools. Thread-safe; ``close()`` releases the cache."""

    def __init__(self, source: Union[str, "os.PathLike[str]"], *, best_effort: bool = False,
                 **sandbox_options: Any) -> None:
        path = Path(source)
        self.source = str(source)
        self._options = {"best_effort": best_effort, **sandbox_options}
        self._tools: dict[str, Callable[[Mapping[str, str]], Policy]] = {}
        try:
            mode = os.stat(path).st_mode
            files = sorted(path.glob("*.toml")) if stat.S_ISDIR(mode) else []
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
            reason = getattr(exc, "strerror", None) or str(exc)
            missing = isinstance(exc, FileNotFoundError)
            raise PolicyError("no such policy directory or file" if missing
                              else f"cannot read the policies: {reason}", source=self.source) from None
        if stat.S_ISDIR(mode):
            for file in files:
                self._tools[file.stem] = self._from_file(file)
        else:
            self._from_tools_table(path)  # a regular file, or refused by the bounded reader
        if not self._tools:
            raise PolicyError("no tools found (expected NAME.toml files, or [tools.NAME] tables)",
                              source=self.source)
        self._cache: OrderedDict[tuple[str, tuple[tuple[str, str], ...]], Sandbox] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _from_file(file: Path) -> Callable[[Mapping[str, str]], Policy]:
        text = _read(file, str(file))
        _parse_text(text, str(file))  # syntax errors surface at load time
        base = file.resolve().parent
        return lambda variables: loads_policy(text, variables, source=str(file), base_dir=base)

    def _from_tools_table(self, file: Path) -> None:
        text = _read(file, str(file))
        data = _parse_text(text, str(file))
        unknown = sorted(set(data) - {"tools"})
        if unknown or not isinstance(data.get("tools"), dict):
            raise PolicyError("a tools file holds only [tools.NAME] tables"
                              + (f" (unknown key {unknown[0]!r})" if unknown else ""),
                              source=str(file))
        base = file.resolve().parent
        for name, table in data["tools"].items():
            if not isinstance(table, dict):
                raise PolicyError("expected a table", source=str(file), key=f"tools.{name}")
            self._tools[name] = _table_loader(table, f"{file} [tools.{name}]", base)

    # -- lookup

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def policy(self, tool: str, variables: Optional[Mapping[str, str]] = None) -> Policy:
        """The effective policy of ``tool`` with these variables (what the CLI runs)."""
        build = self._tools.get(tool)
        if build is None:
            raise PolicyError(f"unknown tool {tool!r} (known: {', '.join(self.names)})",
                              source=self.source)
        return build(dict(variables or {}))

    def sandbox(self, tool: str, vars: Optional[Mapping[str, str]] = None) -> Sandbox:
        """The compiled sandbox of ``tool`` for these variables, built once and cached."""
        from .sandbox import Sandbox

        key = (tool, tuple(sorted((vars or {}).items())))
        with self._lock:
            box = self._cache.get(key)
            if box is not None:
                self._cache.move_to_end(key)
                return box
        box = Sandbox(self.policy(tool, vars), **self._options)
        with self._lock:
            if key in self._cache:  # another thread built it meanwhile: keep one
                box.close()
                return self._cache[key]
            self._cache[key] = box
            while len(self._cache) > CACHE_SIZE:
                # Not closed here: a thread may hold it between lookup and call. It
                # closes its ruleset fd when the last reference goes (Sandbox.__del__).
                self._cache.popitem(last=False)
        return box

    # -- calls

    def run(self, tool: str, argv: Any, *, vars: Optional[Mapping[str, str]] = None,
            **kwargs: Any) -> Result:
        """``Sandbox.run`` with ``tool``'s policy: ``registry.run("read_file", ["cat", f])``."""
        return self.sandbox(tool, vars).run(argv, **kwargs)

    async def run_async(self, tool: str, argv: Any, *, vars: Optional[Mapping[str, str]] = None,
                        **kwargs: Any) -> Result:
        return await self.sandbox(tool, vars).run_async(argv, **kwargs)

    def call(self, tool: str, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``Sandbox.call`` with ``tool``'s policy (no variables: use :meth:`sandbox`)."""
        return self.sandbox(tool).call(func, *args, **kwargs)

    def close(self) -> None:
        with self._lock:
            while self._cache:
                self._cache.popitem()[1].close()

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _table_loader(table: dict[str, Any], source: str,
                  base: Path) -> Callable[[Mapping[str, str]], Policy]:
    def load(variables: Mapping[str, str]) -> Policy:
        return policy_from_dict(table, variables, source=source, base_dir=base)
    return load
