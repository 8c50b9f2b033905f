"""Host allowlist rules of ``[network] allow / deny / hosts``: parsing and matching.

Pure data and pure functions: nothing here resolves a name or opens a socket.
The proxy (:mod:`sandlock.net.proxy`) asks :meth:`NetRules.check_name` before it
resolves anything and :meth:`NetRules.check_address` for every address it would
connect to, so a name that resolves to a private address (DNS rebinding) is
refused unless the policy pinned that name or allowed that address.

Rule syntax (one string each):

- ``api.github.com`` exact host; ``*.npmjs.org`` every subdomain, not the apex;
- ``203.0.113.7``, ``203.0.113.0/24``, ``[2001:db8::1]``, ``[2001:db8::/32]``;
- an optional ``:port`` or ``:low-high`` suffix. Without one, an ``allow`` rule
  means ports 80 and 443 and a ``deny`` rule means every port.

Refused with a clear message: ``*`` and ``*.com`` (one label after the
wildcard), wildcards anywhere but a leading ``*.``, CIDRs broader than /8
(IPv4) or /16 (IPv6), URLs (``https://...``) and paths (``host/path``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable, Optional, Union

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

DEFAULT_ALLOW_PORTS = ((80, 80), (443, 443))
ALL_PORTS = ((1, 65535),)
#: Narrowest prefix a CIDR rule may have: anything broader is "most of the internet".
MIN_PREFIX = {4: 8, 6: 16}
#: ``hosts = { "mirror.internal" = "system" }``: resolve that one name with the system
#: resolver (``/etc/hosts``, the local DNS) and accept its private or loopback answers.
SYSTEM = "system"
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


class RuleError(ValueError):
    """A rule that cannot be parsed; ``index`` is its position in the list (or a pin name)."""

    def __init__(self, message: str, index: Union[int, str]) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class HostRule:
    """One ``allow`` or ``deny`` entry."""

    text: str  #: as written, for messages
    where: str  #: "allow[2]" or "deny[0]"
    name: Optional[str] = None  #: exact host, or the suffix after "*." when ``wildcard``
    wildcard: bool = False
    net: Optional[IPNetwork] = None
    ports: tuple[tuple[int, int], ...] = DEFAULT_ALLOW_PORTS

    def __str__(self) -> str:
        return f"{self.where} {self.text!r}"

    def has_port(self, port: int) -> bool:
        return any(low <= port <= high for low, high in self.ports)

    def matches_name(self, host: str, port: int) -> bool:
        if self.name is None or not self.has_port(port):
            return False
        return host.endswith("." + self.name) if self.wildcard else host == self.name

    def matches_address(self, address: IPAddress, port: int) -> bool:
        return (self.net is not None and self.has_port(port)
                and address.version == self.net.version and address in self.net)


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check; ``reason`` names the rule that decided."""

    allowed: bool
    reason: str

    def __bool__(self) -> bool:
        return self.allowed


@dataclass(frozen=True)
class NetRules:
    """The effective allow/deny lists and pins of one policy."""

    allow: tuple[HostRule, ...] = ()
    deny: tuple[HostRule, ...] = ()
    hosts: tuple[tuple[str, str], ...] = ()  #: (name, address); a later pin of a name wins

    def _pinned(self, host: str) -> Optional[str]:
        found = None
        for name, address in self.hosts:
            if name == host:
                found = address
        return found

    def pin(self, host: str) -> Optional[IPAddress]:
        found = self._pinned(host)
        return ipaddress.ip_address(found) if found not in (None, SYSTEM) else None

    def trusts_resolver(self, host: str) -> bool:
        """``host = "system"`` in ``hosts``: the system resolver's answer for it is trusted."""
        return self._pinned(normalize_host(host)) == SYSTEM

    def check_name(self, host: str, port: int) -> Verdict:
        """May the tool ask for ``host:port`` (a name or an IP literal)? Deny wins. A name
        that is neither (a NUL, a space, a control or non-ASCII character, an empty
        label) matches no rule: a resolver reads ``8.8.8.8\\0.allowed.test`` as 8.8.8.8."""
        host = normalize_host(host)
        literal = as_address(host)
        if literal is None and not is_host_name(host):
            return Verdict(False, f"{format_target(host, port)} is not a host name (a DNS name "
                                  "or an IP address)")
        for rule in self.deny:
            if rule.matches_name(host, port) or (literal and rule.matches_address(literal, port)):
                return Verdict(False, f"denied by {rule}")
        for rule in self.allow:
            if rule.matches_name(host, port) or (literal and rule.matches_address(literal, port)):
                return Verdict(True, f"allowed by {rule}")
        return Verdict(False, f"no allow rule matches {format_target(host, port)}")

    def check_address(self, host: str, address: IPAddress, port: int) -> Verdict:
        """May the proxy connect to ``address``, which ``host`` resolved to?

        Deny rules on addresses win. A private, loopback or link-local result, or any
        address of this host's own interfaces (a global one too), is refused unless ``host``
        is pinned in ``hosts`` (to that address, or to ``"system"``: whatever the system
        resolver answers) or an allow rule names the address (DNS rebinding: a public name
        must not lead into the local network).
        """
        address = unmap(address)
        for rule in self.deny:
            if rule.matches_address(address, port):
                return Verdict(False, f"{address} is denied by {rule}")
        if address.is_global and not address.is_multicast and address not in local_addresses():
            return Verdict(True, "public address")
        host = normalize_host(host)
        if self.pin(host) == address:
            return Verdict(True, f"pinned in hosts: {host} = {address}")
        if self.trusts_resolver(host):
            return Verdict(True, f'{host} resolved to {address} by the system resolver, trusted '
                                 f'in hosts: {host} = "{SYSTEM}"')
        for rule in self.allow:
            if rule.matches_address(address, port):
                return Verdict(True, f"allowed by {rule}")
        return Verdict(False, f"{host} resolved to non-public address {address} (refused against "
                              "DNS rebinding; pin the name in [network] hosts or allow the "
                              "address)")


def local_addresses() -> frozenset[IPAddress]:
    """Every address of this host's interfaces, as the kernel lists them now (IPv4:
    /proc/net/fib_trie's "/32 host LOCAL" entries; IPv6: /proc/net/if_inet6). A name
    that resolves to one of them leads to this host's own services, whatever the
    address's scope. Read per check: addresses come and go."""
    found: set[IPAddress] = set()
    try:
        with open("/proc/net/fib_trie") as trie:
            last = ""
            for line in trie:
                text = line.strip()
                if text.startswith(("|--", "+--")):
                    last = text[3:].split()[0]
                elif text.startswith("/32 host LOCAL") and last:
                    found.add(ipaddress.ip_address(last))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                raw = line.split()[0] if line.strip() else ""
                if len(raw) == 32:
                    found.add(ipaddress.IPv6Address(int(raw, 16)))
    except (OSError, ValueError):
        pass
    return frozenset(found)


def is_host_name(host: str) -> bool:
    """``host`` (normalized) is a DNS name as rules name them (``_LABEL``): ASCII labels of
    letters, digits, ``-`` and ``_``, none empty, 253 characters at most."""
    return 0 < len(host) <= 253 and all(_LABEL.fullmatch(label) for label in host.split("."))


def normalize_host(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.removesuffix(".")


def as_address(host: str) -> Optional[IPAddress]:
    try:
        return unmap(ipaddress.ip_address(host))
    except ValueError:
        return None


def unmap(address: IPAddress) -> IPAddress:
    """``::ffff:1.2.3.4`` is 1.2.3.4: compare IPv4-mapped IPv6 as the IPv4 it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def format_target(host: str, port: int) -> str:
    """``host:port`` for a message; a name the tool chose, with no raw control character."""
    if not host.isprintable() or not host.isascii():
        host = ascii(host)[1:-1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ----------------------------------------------------------------------------
# Parsing


def parse_rules(items: Iterable[str], kind: str) -> tuple[HostRule, ...]:
    """Parse ``allow`` (``kind="allow"``) or ``deny`` entries; raise :class:`RuleError`."""
    default = DEFAULT_ALLOW_PORTS if kind == "allow" else ALL_PORTS
    out = []
    for index, text in enumerate(items):
        try:
            out.append(parse_rule(text, f"{kind}[{index}]", default))
        except ValueError as exc:
            raise RuleError(str(exc), index) from None
    return tuple(out)


def parse_rule(text: str, where: str, default_ports: tuple[tuple[int, int], ...]) -> HostRule:
    raw = text.strip()
    if not raw:
        raise ValueError("empty rule")
    if "://" in raw:
        raise ValueError(f"{text!r} is a URL; write host[:port], e.g. 'api.github.com:443'")
    host, ports = _split_port(raw, text)
    if "/" in host:
        return HostRule(text, where, net=_network(host, text), ports=ports or default_ports)
    literal = as_address(host)
    if literal is not None:
        return HostRule(text, where, net=ipaddress.ip_network(literal),
                        ports=ports or default_ports)
    name = check_hostname(host, wildcard_ok=True)
    wildcard = name.startswith("*.")
    return HostRule(text, where, name=name[2:] if wildcard else name, wildcard=wildcard,
                    ports=ports or default_ports)


def _split_port(raw: str, text: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``host[:port]``; IPv6 needs brackets when a port follows (``[::1]:443``)."""
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise ValueError(f"{text!r}: missing ']' after an IPv6 address")
        host, rest = raw[1:end], raw[end + 1:]
        if as_address(host.split("/")[0]) is None:
            raise ValueError(f"{text!r}: only IPv6 addresses go in brackets")
        if not rest:
            return host, ()
        if not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected ':port' after ']'")
        return host, (_ports(rest[1:], text),)
    if raw.count(":") > 1:  # a bare IPv6 address or network, no port
        return raw, ()
    host, sep, port = raw.partition(":")
    return host, ((_ports(port, text),) if sep else ())


def _ports(spec: str, text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", spec.strip())
    if not match:
        raise ValueError(f"{text!r}: bad port {spec!r} (a number or low-high range)")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"{text!r}: ports are 1-65535 with low <= high")
    return (low, high)


def _network(spec: str, text: str) -> IPNetwork:
    address, _, prefix = spec.partition("/")
    if as_address(address) is None or not prefix.isdigit():
        raise ValueError(f"{text!r}: paths are not rules; write a host name, an IP address or a "
                         "CIDR such as 203.0.113.0/24")
    try:
        net = ipaddress.ip_network(spec)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    if net.prefixlen < MIN_PREFIX[net.version]:
        raise ValueError(f"{text!r} is over-broad (a /{net.prefixlen}); the broadest allowed is "
                         f"/{MIN_PREFIX[net.version]}")
    return net


def check_hostname(host: str, *, wildcard_ok: bool) -> str:
    """A lower-case ASCII host name (IDN converted to punycode), or ValueError."""
    name = normalize_host(host)
    if name == "*":
        raise ValueError("'*' would allow every host; list the hosts the tool needs")
    body = name[2:] if wildcard_ok and name.startswith("*.") else name
    if "*" in body:
        raise ValueError(f"{host!r}: the only wildcard is a leading '*.' (e.g. '*.example.com')")
    try:
        body = body.encode("idna").decode("ascii") if not body.isascii() else body
    except UnicodeError:
        raise ValueError(f"{host!r} is not a valid host name") from None
    labels = body.split(".")
    if len(body) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{host!r} is not a valid host name")
    if name.startswith("*.") and len(labels) < 2:
        raise ValueError(f"{host!r} is over-broad (a whole top-level domain); name a domain "
                         "such as '*.example.com'")
    return ("*." + body) if name.startswith("*.") else body


def parse_pins(table: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """``hosts = { "api.internal.test" = "127.0.0.1", "mirror.internal" = "system" }``
    (:data:`SYSTEM`: the system resolver's answer is trusted); raise :class:`RuleError`."""
    out = []
    for name, value in table.items():
        try:
            host = check_hostname(name, wildcard_ok=False)
        except ValueError as exc:
            raise RuleError(str(exc), name) from None
        if value == SYSTEM:
            out.append((host, SYSTEM))
            continue
        if not isinstance(value, str) or as_address(normalize_host(value)) is None:
            raise RuleError(f'expected an IP address string or "{SYSTEM}", got {value!r}', name)
        out.append((host, str(as_address(normalize_host(value)))))
    return tuple(out)

