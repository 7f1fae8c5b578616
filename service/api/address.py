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
    service.server.Endpoint).

    Made with proto IPPROTO_TCP, not socket.create_server's 0: the connections it accepts inherit
    it, and asyncio turns Nagle off (TCP_NODELAY) only on sockets of proto IPPROTO_TCP. With 0
    every small answer (a shared-memory reply, T=8) waited ~40 ms for the client's delayed ACK."""
    v6 = ":" in host
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds past TIME_WAIT
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if v6:
            dual = ipaddress.ip_address(host).is_unspecified
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual else 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


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

