"""A connection to the run's credential route, made for its tool by the connect gate
(:mod:`sandlock.net.connect`) or the proxy (:mod:`sandlock.net.proxy`): the route server
serves it only once it is told the connection is that run's
(:meth:`sandlock.net.routes.RouteServer.admit`). A placeholder alone is no key to the
route: a tool may leave it where others read it (its command line in /proc), and every
call of a Sandbox, and every local process, reaches the route's port."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from typing import Protocol


class Route(Protocol):
    """The run's credential route as its gate and proxy see it
    (:class:`sandlock.net.routes.Routes` in `sandlock run`; a call's in the API's mediator
    process, :class:`sandlock.net.mediator._CallRoute`)."""

    @property
    def port(self) -> int:
        """Where the route server listens (on 127.0.0.1)."""

    def admit(self, peer: tuple[str, int], since: int) -> bool:
        """Tell the route server this run's tool made the connection from ``peer``, begun
        at ``since`` (CLOCK_MONOTONIC, ns: a connection from that address that ended later
        was this one, and is not admitted)."""


def is_route(route: Route | None, address: str, port: int) -> bool:
    return route is not None and (address, port) == ("127.0.0.1", route.port)


def began() -> int:
    """When a connection to the route begins (taken before its connect: :func:`admitted`)."""
    return time.monotonic_ns()


def admitted(route: Route, fd: int, result: int, since: int) -> int:
    """``result`` of a connect on ``fd`` to ``route`` made for the tool (0 or -errno), begun
    at ``since`` (:func:`began`), once the route server knows the connection is this run's;
    else the connection is cut and refused (EACCES)."""
    if result in (0, -errno.EINPROGRESS):
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                host, port = sock.getsockname()[:2]
            address = ipaddress.ip_address(host)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                host = str(address.ipv4_mapped)  # as the route's IPv4 listener sees the peer
            if route.admit((host, port), since):
                return result
        except (OSError, ValueError):
            pass
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    return result if result < 0 and result != -errno.EINPROGRESS else -errno.EACCES
