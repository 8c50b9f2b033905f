"""Credentials of ``[credentials]``: the model, its validation and the secrets' sources.

A credential is a secret (an API key) that the confined tool never holds. The tool
gets a *placeholder* (random per run) in an environment variable and a base URL
``http://127.0.0.1:PORT/<name>`` of a local route; the route server
(:mod:`sandlock.net.routes`, in the launcher) checks each request against the rules
here, replaces the placeholder with the secret and forwards the request over TLS
to the credential's ``upstream``, verifying its certificate. Nothing else ever
carries the secret.

Pure, apart from :func:`secrets_for`, which reads the secrets (the caller's
environment, a file) when a run starts: parsing a policy never reads a secret.

::

    [credentials.openai]
    upstream = "https://api.openai.com/v1"   # https only; port and path prefix optional
    from_env = "OPENAI_API_KEY"               # or from_file = "~/.config/openai/key",
                                              # or none: the Python API gives it
    env = "OPENAI_API_KEY"                    # the tool's variable holding the placeholder
    base_url_env = "OPENAI_BASE_URL"          # the tool's variable holding the route URL
    header = "Authorization"                  # default; or query = "key"
    format = "Bearer {secret}"                # default for Authorization, else "{secret}"
    methods = ["POST"]                        # default: any
    paths = ["/v1/chat/*"]                    # default: everything under the upstream path
    deny = ["/v1/chat/admin*", "GET /v1/*"]   # "[METHOD ]GLOB"; deny wins
    ca_file = "/etc/ssl/private-ca.pem"       # default: the system trust store
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping, Optional, Sequence, Union

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_METHOD = re.compile(r"^[A-Z]{1,20}$")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")  # RFC 9110 token: a header name
_QUERY_NAME = re.compile(r"^[A-Za-z0-9._~-]{1,64}$")
KEYS = ("upstream", "from_env", "from_file", "env", "base_url_env", "header", "format", "query",
        "methods", "paths", "deny", "ca_file")
#: Largest secret read from a file or the environment.
MAX_SECRET = 16 * 1024
PLACEHOLDER_PREFIX = "sandlock-placeholder-"


class CredentialError(ValueError):
    """A ``[credentials]`` entry that cannot be used; ``key`` is its path below the table
    (``("openai", "paths", 1)``) for the policy's file:line message."""

    def __init__(self, message: str, key: Sequence[Union[str, int]] = ()) -> None:
        super().__init__(message)
        self.key = tuple(key)


def _slashless(path: str) -> str:
    """``path`` without its trailing slashes (``/`` stays ``/``)."""
    return path.rstrip("/") or "/"


@dataclass(frozen=True)
class DenyRule:
    text: str  #: as written
    where: str  #: "credentials.openai.deny[0]"
    method: Optional[str]  #: None: every method
    glob: str

    def matches(self, method: str, path: str) -> bool:
        """Deny rules are read the way the loosest upstream could read the request: the
        path case-insensitively (``/v1/ADMIN`` is ``/v1/admin*``), with or without a
        trailing slash (Express, Rails and Spring route ``/v1/admin/`` to the handler of
        ``/v1/admin``), and a ``GET`` rule also covers ``HEAD`` (servers answer HEAD with
        their GET handler)."""
        if not (self.method is None or self.method == method
                or (self.method == "GET" and method == "HEAD")):
            return False
        path, glob = path.lower(), self.glob.lower()
        return fnmatchcase(path, glob) or fnmatchcase(_slashless(path), _slashless(glob))


@dataclass(frozen=True)
class Credential:
    """One ``[credentials.NAME]`` table, validated (paths not yet expanded)."""

    name: str
    host: str  #: upstream host name (or address), lower case
    port: int
    base_path: str  #: upstream path prefix, "" or "/v1" (no trailing slash)
    from_env: Optional[str] = None
    from_file: Optional[str] = None
    env: Optional[str] = None
    base_url_env: Optional[str] = None
    header: Optional[str] = "Authorization"  #: None when ``query`` attaches it
    format: str = "Bearer {secret}"
    query: Optional[str] = None
    methods: tuple[str, ...] = ()  #: empty: any method
    paths: tuple[str, ...] = ()  #: globs on the upstream path; empty: base_path + "/*"
    deny: tuple[DenyRule, ...] = ()
    ca_file: Optional[str] = None

    @property
    def where(self) -> str:
        return f"credentials.{self.name}"

    @property
    def origin(self) -> str:
        """``https://host[:port]`` of the upstream."""
        port = "" if self.port == 443 else f":{self.port}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}{port}"

    @property
    def path_globs(self) -> tuple[str, ...]:
        return self.paths or ((self.base_path + "/*") if self.base_path else "/*",)

    def check(self, method: str, path: str) -> tuple[bool, str]:
        """(allowed, the rule that decided): deny wins, then methods, then paths."""
        for rule in self.deny:
            if rule.matches(method, path):
                return False, f"denied by {rule.where} {rule.text!r}"
        if self.methods and method not in self.methods:
            return False, (f"method {method} is not in {self.where}.methods "
                           f"{list(self.methods)}")
        for index, glob in enumerate(self.path_globs):
            if fnmatchcase(path, glob):
                return True, (f"{self.where}.paths[{index}] {glob!r}" if self.paths
                              else f"{self.where} default path {glob!r}")
        shown = f"{self.where}.paths" if self.paths else f"{self.where} (default path)"
        return False, f"no entry of {shown} {list(self.path_globs)} matches {path}"

    def attach(self, secret: str) -> str:
        """The header value (or query value) that carries ``secret``."""
        return self.format.replace("{secret}", secret) if self.header else secret


def _string(value: object, key: Sequence[Union[str, int]]) -> str:
    if not isinstance(value, str):
        raise CredentialError(f"expected a string, got {type(value).__name__}", key)
    if not value or any(c in value for c in "\0\r\n"):
        raise CredentialError("expected a non-empty string without NUL or line breaks", key)
    return value


def _list(value: object, key: Sequence[Union[str, int]]) -> list[str]:
    if not isinstance(value, list):
        raise CredentialError(f"expected an array of strings, got {type(value).__name__}", key)
    return [_string(item, (*key, index)) for index, item in enumerate(value)]


def _glob(text: str, key: Sequence[Union[str, int]]) -> str:
    if not text.startswith("/"):
        raise CredentialError(f"path glob {text!r} must start with '/'", key)
    return text


def parse_upstream(text: str, key: Sequence[Union[str, int]]) -> tuple[str, int, str]:
    """``https://host[:port][/prefix]`` -> (host, port, prefix)."""
    try:
        url = urllib.parse.urlsplit(text)
        port = url.port or 443
    except ValueError as exc:
        raise CredentialError(f"invalid upstream URL {text!r}: {exc}", key) from None
    if url.scheme != "https":
        raise CredentialError(f"upstream {text!r} must be an https:// URL (the secret is only "
                              "ever sent over TLS to a verified server)", key)
    if not url.hostname or url.username or url.password or url.query or url.fragment:
        raise CredentialError(f"upstream {text!r} must be https://host[:port][/path], without "
                              "user, query or fragment", key)
    path = url.path.rstrip("/")
    if any(segment in (".", "..") for segment in path.split("/")) or "%" in path:
        raise CredentialError(f"upstream path {url.path!r} must be plain (no '.', '..', '%')", key)
    return url.hostname.lower(), port, path


def parse_one(name: str, table: object) -> Credential:
    """One ``[credentials.NAME]`` table; raises :class:`CredentialError`."""
    if not _NAME.match(name):
        raise CredentialError(f"invalid credential name {name!r} (lower-case letters, digits, "
                              "'-' and '_', at most 32)", (name,))
    if not isinstance(table, dict):
        raise CredentialError(f"expected a table, got {type(table).__name__}", (name,))
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise CredentialError(f"unknown key {unknown[0]!r} (expected one of: {', '.join(KEYS)})",
                              (name, unknown[0]))
    if "upstream" not in table:
        raise CredentialError("missing key 'upstream' (https://host[:port][/path])", (name,))
    values: dict[str, Any] = {}
    for key in ("upstream", "from_env", "from_file", "env", "base_url_env", "header", "format",
                "query", "ca_file"):
        if key in table:
            values[key] = _string(table[key], (name, key))
    host, port, base = parse_upstream(values.pop("upstream"), (name, "upstream"))
    if "from_env" in values and "from_file" in values:
        raise CredentialError("give from_env or from_file, not both", (name, "from_file"))
    for key in ("from_env", "env", "base_url_env"):
        if key in values and not _ENV_NAME.match(values[key]):
            raise CredentialError(f"invalid environment variable name {values[key]!r}", (name, key))
    if "env" in values and values["env"] == values.get("base_url_env"):
        raise CredentialError("env and base_url_env must differ", (name, "base_url_env"))
    if "query" in values:
        if "header" in values or "format" in values:
            raise CredentialError("query attaches the secret as a query parameter: header and "
                                  "format do not apply", (name, "query"))
        if not _QUERY_NAME.match(values["query"]):
            raise CredentialError(f"invalid query parameter name {values['query']!r}",
                                  (name, "query"))
        values["header"] = None
        values["format"] = "{secret}"
    else:
        header = values.get("header", "Authorization")
        if not _TOKEN.match(header) or header.lower() in ("host", "content-length",
                                                           "transfer-encoding", "connection"):
            raise CredentialError(f"invalid or reserved header name {header!r}", (name, "header"))
        values["header"] = header
        default = "Bearer {secret}" if header.lower() == "authorization" else "{secret}"
        values["format"] = values.get("format", default)
        if values["format"].count("{secret}") != 1:
            raise CredentialError("format must contain {secret} exactly once", (name, "format"))
    methods: tuple[str, ...] = ()
    if "methods" in table:
        methods = tuple(_list(table["methods"], (name, "methods")))
        for index, method in enumerate(methods):
            if not _METHOD.match(method):
                raise CredentialError(f"invalid method {method!r} (upper case, e.g. \"POST\")",
                                      (name, "methods", index))
        if not methods:
            raise CredentialError("an empty methods list would refuse every request; omit it "
                                  "to allow any method", (name, "methods"))
    paths: tuple[str, ...] = ()
    if "paths" in table:
        paths = tuple(_glob(p, (name, "paths", i))
                      for i, p in enumerate(_list(table["paths"], (name, "paths"))))
        if not paths:
            raise CredentialError("an empty paths list would refuse every request; omit it to "
                                  "allow everything under the upstream path", (name, "paths"))
    deny = []
    for index, text in enumerate(_list(table.get("deny", []), (name, "deny"))):
        method, _, glob = text.rpartition(" ")
        if method and not _METHOD.match(method):
            raise CredentialError(f"deny entry {text!r} is not \"[METHOD ]/glob\"",
                                  (name, "deny", index))
        deny.append(DenyRule(text, f"credentials.{name}.deny[{index}]", method or None,
                             _glob(glob, (name, "deny", index))))
    return Credential(name, host, port, base, methods=methods, paths=paths, deny=tuple(deny),
                      **values)


def parse_table(value: object) -> tuple[Credential, ...]:
    """The ``[credentials]`` table of one policy layer."""
    if not isinstance(value, dict):
        raise CredentialError(f"expected a table of [credentials.NAME] tables, got "
                              f"{type(value).__name__}")
    return tuple(parse_one(name, table) for name, table in value.items())


def merge(items: Sequence[Credential], expand: Callable[[str], str]) -> tuple[Credential, ...]:
    """Credentials of every layer, base first: a later layer's entry of the same name
    replaces the earlier one. ``from_file`` and ``ca_file`` get variables and ``~``
    expanded by ``expand`` and must then be absolute."""
    from dataclasses import replace

    by_name: dict[str, Credential] = {}
    for item in items:
        changes: dict[str, Any] = {}
        for key in ("from_file", "ca_file"):
            raw = getattr(item, key)
            if raw is None:
                continue
            path = expand(raw)
            if not os.path.isabs(path):
                raise CredentialError(f"{key} {path!r} is not absolute (use ~/..., ${{home}}/... "
                                      "or an absolute path)", (item.name, key))
            changes[key] = os.path.normpath(path)
        by_name[item.name] = replace(item, **changes)
    envs: dict[str, str] = {}
    for item in by_name.values():
        for key in ("env", "base_url_env"):
            var = getattr(item, key)
            if var is not None and var in envs:
                raise CredentialError(f"variable {var} is already set by credential "
                                      f"{envs[var]}", (item.name, key))
            if var is not None:
                envs[var] = item.name
    return tuple(by_name.values())


# ----------------------------------------------------------------------------
# Secrets, read when a run starts


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def check_file(credential: Credential, grants: Sequence[Any],
               opened: Optional[str] = None) -> Optional[str]:
    """Why ``from_file`` may not be used with these path grants (or None): a file any
    grant reaches (read, write or exec) is one the tool could read itself. Decided by
    name (``from_file``, its real path and ``opened``, the name of the descriptor it is
    read from, each against every grant and its real path) and by object: a grant that
    is the same directory as one holding the file ((st_dev, st_ino), as a bind mount
    of it would be). Other names of the file itself, hard links, are refused by
    :func:`_read_file`."""
    assert credential.from_file is not None
    names = {credential.from_file, os.path.realpath(credential.from_file)}
    if opened is not None:
        names.add(opened)
    holders = {_identity(directory) for name in names for directory in _parents(name)}
    holders.discard(None)
    for rule in grants:
        same = _identity(rule.path) in holders
        for grant in {rule.path, os.path.realpath(rule.path)}:
            if same or any(_within(name, grant) for name in names):
                return (f"{credential.from_file!r} is within the tool's grant "
                        f"filesystem.{rule.access.value} {rule.path!r} ({rule.origin})"
                        f"{' (the same directory under another name)' if same else ''}: the "
                        "tool could read the secret itself; keep it outside every grant")
    return None


def _parents(path: str) -> list[str]:
    """``path`` and every directory above it, up to ``/``."""
    out = [path]
    while path not in ("/", ""):
        path = os.path.dirname(path)
        out.append(path)
    return out


def _identity(path: str) -> Optional[tuple[int, int]]:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _valid_secret(secret: str, what: str, key: Sequence[Union[str, int]]) -> str:
    if not secret:
        raise CredentialError(f"{what} is empty", key)
    if len(secret) > MAX_SECRET:
        raise CredentialError(f"{what} is longer than {MAX_SECRET} bytes", key)
    if any(not " " <= c <= "~" for c in secret):
        raise CredentialError(f"{what} contains control characters or non-ASCII characters "
                              "(it goes into an HTTP header or query)", key)
    return secret


def _read_file(credential: Credential, grants: Sequence[Any],
               key: Sequence[Union[str, int]]) -> str:
    """The key file, decided on the descriptor it is read from: a regular file with one
    link (another link could lie inside a grant, where no check by name sees it),
    whose names are outside every grant (:func:`check_file`)."""
    path = credential.from_file
    assert path is not None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise CredentialError(f"cannot read {path!r}: {exc.strerror}", key) from None
    try:
        import stat

        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CredentialError(f"{path!r} is not a regular file", key)
        if info.st_nlink > 1:
            raise CredentialError(f"{path!r} has {info.st_nlink} hard links: another name of "
                                  "the file may lie inside a grant of the tool, where the "
                                  "check by name cannot see it; keep the secret in a file "
                                  "with one link", key)
        try:
            opened: Optional[str] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            opened = None
        why = check_file(credential, grants, opened)
        if why:
            raise CredentialError(why, key)
        data = os.read(fd, MAX_SECRET + 2)
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CredentialError(f"{path!r} is not UTF-8 text", key) from None
    return text[:-1] if text.endswith("\n") else text


def secrets_for(credentials: Sequence[Credential], grants: Sequence[Any],
                environ: Mapping[str, str], given: Optional[Mapping[str, str]] = None
                ) -> dict[str, str]:
    """The secret of every credential: ``given`` (the Python API) first, then
    ``from_env`` in ``environ``, then ``from_file``. Raises :class:`CredentialError`
    naming the credential when one has no secret."""
    given = dict(given or {})
    unknown = sorted(set(given) - {c.name for c in credentials})
    if unknown:
        raise CredentialError(f"no [credentials.{unknown[0]}] in the policy", (unknown[0],))
    out: dict[str, str] = {}
    for item in credentials:
        if item.name in given:
            secret = given[item.name]
            if not isinstance(secret, str):
                raise TypeError(f"credentials[{item.name!r}] must be a str")
            out[item.name] = _valid_secret(secret, f"the secret given for {item.name}",
                                           (item.name,))
        elif item.from_env is not None:
            if item.from_env not in environ:
                raise CredentialError(f"{item.from_env} is not set in sandlock's "
                                      "environment", (item.name, "from_env"))
            out[item.name] = _valid_secret(environ[item.from_env], item.from_env,
                                           (item.name, "from_env"))
        elif item.from_file is not None:
            why = check_file(item, grants)  # by name first: no open(2) of a granted file
            if why:
                raise CredentialError(why, (item.name, "from_file"))
            out[item.name] = _valid_secret(_read_file(item, grants, (item.name, "from_file")),
                                           item.from_file, (item.name, "from_file"))
        else:
            raise CredentialError("no secret: give from_env or from_file (or pass it with "
                                  "Sandbox(..., credentials={...}) from Python)", (item.name,))
        value = item.attach(out[item.name])
        if item.header is not None and value != value.strip(" \t"):
            raise CredentialError(f"the secret in its format ({item.format!r}) begins or ends "
                                  "with a space or tab, which no HTTP header value may: it "
                                  "could never be sent; remove it from the secret",
                                  (item.name,))
    return out


def tool_environment(credentials: Sequence[Credential], env: Mapping[str, str],
                     secrets: Mapping[str, str], placeholders: Mapping[str, str],
                     base_urls: Mapping[str, str]) -> dict[str, str]:
    """``env`` as the tool gets it: every ``from_env`` variable and every variable whose
    value contains a secret removed (whatever ``env.pass`` matched), then each
    credential's placeholder and route URL set."""
    names = {c.from_env for c in credentials if c.from_env}
    out = {k: v for k, v in env.items()
           if k not in names and not any(s in v or s in k for s in secrets.values())}
    for item in credentials:
        if item.env:
            out[item.env] = placeholders[item.name]
        if item.base_url_env:
            out[item.base_url_env] = base_urls[item.name] + item.base_path
    return out


def explain(credentials: Sequence[Credential]) -> list[dict[str, Any]]:
    """What ``sandlock explain`` says of each credential (never a secret: none is read)."""
    return [{
        "name": c.name, "upstream": c.origin + c.base_path,
        "secret_from": (f"environment variable {c.from_env}" if c.from_env else
                        f"file {c.from_file}" if c.from_file else "the Python API argument"),
        "attached_as": (f"header {c.header}: {c.format}" if c.header
                        else f"query parameter {c.query}"),
        "methods": list(c.methods) or "any",
        "paths": list(c.path_globs), "deny": [r.text for r in c.deny],
        "tool_gets": {k: v for k, v in (("placeholder in", c.env),
                                        ("route URL in", c.base_url_env)) if v},
        "grant": "TCP connect to the route's 127.0.0.1 port, chosen when the run starts "
                 "(granted for that run only: a Landlock port rule, and TCP sockets in the "
                 "seccomp filter)",
        "verify": c.ca_file or "system trust store",
    } for c in credentials]
