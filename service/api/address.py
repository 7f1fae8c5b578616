"""The addresses the servers listen on: `--host` (an IPv4 or IPv6 address, or a host name; see
service.config.Settings) with a port, written and bound the same way for HTTP, gRPC and the checks."""

from __future__ import annotations

import errno
import ipaddress
import socket


def host_port(host: str, port: int) -> str:
    """`host:port` as an address is written for a connection or a bind (grpc, URLs, logs): an IPv6
    address in brackets, `[::1]:8001` (bare, grpc reads `::1:8001` as host `::1:8001`, port 443)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int, backlog: int = 128, reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on host:port: an IPv6 address is IPv6 (`::` takes IPv4 connections
    too, dual-stack), anything else IPv4 (0.0.0.0 is every IPv4 address only; gRPC binds more for
    it: `grpc_addresses`); SO_REUSEPORT only with `reuse_port` (the front ends of one fleet,
    service.server.Endpoint)."""
    v6 = ":" in host
    return socket.create_server((host, port), family=socket.AF_INET6 if v6 else socket.AF_INET, backlog=backlog,
                                reuse_port=reuse_port, dualstack_ipv6=v6 and ipaddress.ip_address(host).is_unspecified)


def bind_error(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on, as the OS says it, or None when it can: a plain bind (no
    SO_REUSEPORT) fails on a port that any other socket holds, whatever that one's options. The
    check of a fleet's ports before it binds them with SO_REUSEPORT, and the reason of a bind that
    failed without one (grpc's)."""
    err = _bind_failure(host, port)
    return None if err is None else str(err)


def _bind_failure(host: str, port: int) -> OSError | None:
    """A plain bind of host:port's error, or None when it binds (port 0 always does)."""
    if port == 0:
        return None
    try:
        with listen_socket(host, port):
            return None
    except OSError as err:
        return err


def grpc_addresses(host: str) -> list[str]:
    """The addresses grpc binds for `host`: it binds each and starts if any one binds, so a port
    another process holds on one of them would be shared (clients of that address reach the other
    server). 0.0.0.0 is also `::` (grpc listens dual-stack on it), `localhost` both loopbacks
    (grpc binds them whatever /etc/hosts says), another name every address it resolves to."""
    try:
        ipaddress.ip_address(host)
        return [host, "::"] if host == "0.0.0.0" else [host]
    except ValueError:
        pass
    found = {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    if host == "localhost":
        found |= {"127.0.0.1", "::1"}
    return sorted(found)


def grpc_port_taken(host: str, port: int) -> str | None:
    """Why `port` cannot be grpc's on `host`: another socket holds it on one of the addresses grpc
    binds (`grpc_addresses`): the OS's reason, naming that address when it is not `host` itself;
    None when none is held. Only "in use" counts: an address this machine cannot bind (no IPv6)
    grpc skips too."""
    for address in grpc_addresses(host):
        err = _bind_failure(address, port)
        if err is not None and err.errno == errno.EADDRINUSE:
            return str(err) if address == host else f"another socket holds {host_port(address, port)}: {err}"
    return None

