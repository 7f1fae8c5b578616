"""The addresses the servers listen on: `--host` (an IPv4 or IPv6 address, or a host name; see
service.config.Settings) with a port, written and bound the same way for HTTP, gRPC and the checks."""

from __future__ import annotations

import ipaddress
import socket


def host_port(host: str, port: int) -> str:
    """`host:port` as an address is written for a connection or a bind (grpc, URLs, logs): an IPv6
    address in brackets, `[::1]:8001` (bare, grpc reads `::1:8001` as host `::1:8001`, port 443)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int, backlog: int = 128, reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on host:port, bound as gRPC binds its own: an IPv6 address is IPv6
    (`::` takes IPv4 connections too, dual-stack), anything else IPv4; SO_REUSEPORT only with
    `reuse_port` (the front ends of one fleet, service.server.Endpoint)."""
    v6 = ":" in host
    return socket.create_server((host, port), family=socket.AF_INET6 if v6 else socket.AF_INET, backlog=backlog,
                                reuse_port=reuse_port, dualstack_ipv6=v6 and ipaddress.ip_address(host).is_unspecified)


def bind_error(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on, as the OS says it, or None when it can: a plain bind (no
    SO_REUSEPORT) fails on a port that any other socket holds, whatever that one's options. The
    check of a fleet's ports before it binds them with SO_REUSEPORT, and the reason of a bind that
    failed without one (grpc's)."""
    if port == 0:
        return None
    try:
        with listen_socket(host, port):
            return None
    except OSError as err:
        return str(err)
