"""sandlock: give every tool call of an AI agent its own sandbox.

The public API is loaded on first use (module ``__getattr__``), so ``import
sandlock`` stays cheap for the CLI's per-call path::

    import sandlock
    with sandlock.Sandbox("policy.toml", vars={"workspace": ws}) as box:
        box.run(["cat", "notes.md"], capture_output=True).check()
"""

__version__ = "0.2.0"
#: The name this package is installed under (pip). PyPI's "sandlock" is another project
#: with the same import name: the two cannot share an environment, and this attribute
#: tells which one ``import sandlock`` found.
__distribution__ = "sandlock-agent"
#: The directory of this package (its modules live in the subpackages below it).
PACKAGE_DIR = __path__[0]

#: Each public name and the module that defines it (loaded on first use).
_EXPORTS = {
    "Sandbox": "api.sandbox", "Process": "api.sandbox", "PIPE": "api.sandbox",
    "STDOUT": "api.sandbox", "DEVNULL": "api.sandbox", "start": "api.sandbox",
    "shutdown": "api.sandbox",
    "Result": "api.results", "Outcome": "api.results", "RemoteTraceback": "api.results",
    "Registry": "api.registry",
    "Policy": "policy.model", "load_policy": "policy.model", "loads_policy": "policy.model",
    "policy_from_dict": "policy.model",
    "SandlockError": "errors", "PolicyError": "errors", "KernelSupportError": "errors",
    "LandlockError": "errors", "SeccompError": "errors", "SetupError": "errors",
    "ExecError": "errors", "TimeoutExpired": "errors", "CommandFailed": "errors",
    "CallError": "errors", "ExitCode": "errors",
}

TYPE_CHECKING = False
if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads each on first use
    from .api.registry import Registry
    from .api.results import Outcome, RemoteTraceback, Result
    from .api.sandbox import DEVNULL, PIPE, STDOUT, Process, Sandbox, shutdown, start
    from .errors import (
        CallError,
        CommandFailed,
        ExecError,
        ExitCode,
        KernelSupportError,
        LandlockError,
        PolicyError,
        SandlockError,
        SeccompError,
        SetupError,
        TimeoutExpired,
    )
    from .policy.model import Policy, load_policy, loads_policy, policy_from_dict

__all__ = [
    "CallError", "CommandFailed", "DEVNULL", "ExecError", "ExitCode", "KernelSupportError",
    "LandlockError", "Outcome", "PIPE", "Policy", "PolicyError", "Process", "Registry",
    "RemoteTraceback", "Result", "STDOUT", "Sandbox", "SandlockError", "SeccompError",
    "SetupError", "TimeoutExpired", "load_policy", "loads_policy", "policy_from_dict", "shutdown",
    "start",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sandlock' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"sandlock.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
