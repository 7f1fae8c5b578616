"""HTTP connections with bounds: uvicorn's HTTP protocols (httptools or h11) plus the two limits they lack.

uvicorn closes a keep-alive connection `timeout_keep_alive` after a response, but a connection
that never sends a request, or trickles its headers a byte at a time, stays open forever, and
there is no cap on how many stay open (256 idle sockets starved /v2/health/live; at the process's
file limit every accept() failed and was logged). Here:
- a connection with no request in flight is closed `idle_timeout_s` after it opened or after its
  last response (a request in flight is bounded by its deadline: see http.read_body);
- at `max_connections` a new connection closes the longest-idle one to make room; when every one
  has a request in flight, the new one is closed instead.
uvicorn's `limit_concurrency` is not used: it answers 503 to every request while idle sockets
fill the limit, health checks included. The bounds are one mixin, `ConnectionBounds`, on either
protocol: both keep the request being answered as `self.cycle` (httptools: the newest one, a
pipelined request behind it waits in `self.pipeline` and is answered after it), so "busy" means
the same on both. `ensure_file_limit` raises the process's descriptor limit
so that both protocols' caps fit under it: past it every accept() fails (and logs).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors besides client connections: slots, rank pipes, the store, logs, grpc


def ensure_file_limit(max_connections: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit towards what two protocols' caps need (up to the hard
    limit); warn if that is still short. Returns the soft limit now in force."""
    need = 2 * max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft < need:
        log.warning("max_connections=%d per protocol needs about %d file descriptors, the limit is %d "
                    "(ulimit -n): lower max_connections or raise the limit", max_connections, need, soft)
    return soft


class ConnectionBounds:
    """The idle timer and the connection cap, mixed in before a uvicorn HTTP protocol class."""

    # Provided by the uvicorn protocol it is mixed into.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    connections: set
    cycle: Any

    def __init__(self, *args, idle_timeout_s: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.idle_timeout_s, self.max_connections = idle_timeout_s, max_connections
        self._idle_since = self.loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.max_connections:
            idle = [c for c in self.connections if isinstance(c, ConnectionBounds) and c is not self and not c.busy
                    and not c.transport.is_closing()]
            victim = min(idle, key=lambda c: c._idle_since) if idle else self
            log.warning("%d HTTP connections open (max_connections): closing %s", len(self.connections),
                        "the longest-idle one" if idle else "the new one, every other one is busy")
            victim.transport.close()
        self._arm()

    @property
    def busy(self) -> bool:
        """A request is in flight: its headers have arrived and its response is not complete."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_since = self.loop.time()
        self._idle_timer = self.loop.call_later(self.idle_timeout_s, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if not self.busy and not self.transport.is_closing():
            log.debug("closing an HTTP connection idle for %.0f s", self.idle_timeout_s)
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


def bounded_protocol(http_impl: str) -> type[asyncio.Protocol]:
    """uvicorn's protocol class for `http_impl` (Settings.http_impl) with the bounds mixed in.
    httptools is imported here, only when asked for: without it h11 still works."""
    base: type[asyncio.Protocol]
    if http_impl == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    elif http_impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    else:
        raise ValueError(f"http_impl must be httptools or h11, got {http_impl!r}")
    return type(f"Bounded{base.__name__}", (ConnectionBounds, base), {})
