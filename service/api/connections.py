"""HTTP connections with bounds: uvicorn's HTTP protocols (httptools or h11) plus the two limits they lack.

uvicorn closes a keep-alive connection `timeout_keep_alive` after a response (the server sets it
to `idle_timeout_s`, so both bounds are one), but a connection that never sends a request, or
trickles its headers a byte at a time, stays open forever, and there is no cap on how many stay
open (256 idle sockets starved /v2/health/live; at the process's file limit every accept() failed
and was logged). Here:
- a connection with no request in flight is closed `idle_timeout_s` after it opened or after its
  last response (a request in flight is bounded by its deadline: see http.read_body);
- at `max_connections` a new connection closes the longest-idle one to make room; when every one
  has a request in flight, the new one is answered 503 (Retry-After: 1, `Connection: close`)
  without reading its request, and closed once the client has read it (a close with its request
  unread in the socket would send a reset that can destroy the answer in flight: its bytes are read
  and dropped until the client closes, at most `REFUSED_LINGER_S`).
uvicorn's `limit_concurrency` is not used: it answers 503 to every request while idle sockets
fill the limit, health checks included. The bounds are one mixin, `ConnectionBounds`, on either
protocol: both keep the request being answered as `self.cycle` (httptools: the newest one, a
pipelined request behind it waits in `self.pipeline` and is answered after it), so "busy" means
the same on both. `ensure_file_limit` raises the process's descriptor limit
so that both protocols' caps fit under it: past it every accept() fails (and logs).

On httptools a large body with a Content-Length is read straight into one buffer (`DirectBody`):
uvicorn would pause reading every 64 KiB until the app asks for more, and copy each chunk three
times (asyncio's bytes, httptools' bytes, its own bytearray, then bytes() of that) before the
decoder joins them (bench/NOTES.md, issue 11a). A v2 binary inference body goes into a block of the
front end's wire arena where there is one (service.api.arena): the ranks read its rows there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from service.api.arena import WireArena
from service.api.send_thread import ThreadedWrites

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors besides client connections: slots, rank pipes, the store, logs, grpc
# The ASGI scope's key for the time (time.perf_counter) the request's first byte was read: where the
# server's books start (service.api.http); absent for a request pipelined behind another.
FIRST_BYTE = "moe.first_byte"
# The ASGI scope's key for the connection's ThreadedWrites (service.api.send_thread; only with send
# threads): a response asks it when its last bytes reached the kernel (PartsResponse's send time).
WRITER = "moe.writer"
# The ASGI scope's key for a body read straight into one buffer (DirectBody): how much of it has
# arrived (`.filled`), for read_body's 408, which sees the body only once it is all in.
BODY = "moe.body"
HEADER_LENGTH = "inference-header-content-length"  # a v2 binary body's JSON header length (service.api.http)
REFUSED_LINGER_S = 1.0  # a refused connection's client gets this long to read its 503 and close
_REFUSED_BODY = b'{"error": "too many connections (max_connections): every one has a request in flight"}'
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
           b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


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
        self._first_byte: float | None = None  # of the request whose headers are being read
        self._arrived = 0.0  # when the bytes being read arrived
        self._refused = False  # answered 503 at the cap: what it sends is dropped

    send_threads = 0  # set by bounded_protocol (Settings.send_threads)

    def connection_made(self, transport: asyncio.Transport) -> None:
        if self.send_threads:  # large writes leave the loop (service.api.send_thread)
            transport = ThreadedWrites(transport, self.loop, self.send_threads)  # type: ignore[assignment]
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.max_connections:
            idle = [c for c in self.connections if isinstance(c, ConnectionBounds) and c is not self and not c.busy
                    and not c.transport.is_closing()]
            victim = min(idle, key=lambda c: c._idle_since) if idle else self
            log.warning("%d HTTP connections open (max_connections): %s", len(self.connections),
                        "closing the longest-idle one" if idle else "answering 503 to the new one, every other "
                        "one is busy")
            if idle:
                victim.transport.close()
            else:
                self._refused = True
                self.transport.write(REFUSED)
                self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
                return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._arrived = time.perf_counter()
        if self._first_byte is None and not self.busy and (self.cycle is None or not self.cycle.more_body):
            # the first bytes of a request (not the tail of a body answered before it was read: a
            # stamp from that would wait for the next request and count the idle gap as its own)
            self._first_byte = self._arrived
        super().data_received(data)  # type: ignore[misc]
        if self._first_byte is not None and self.busy:  # its headers are in: the request has a scope
            self.cycle.scope.setdefault(FIRST_BYTE, self._first_byte)
            self._first_byte = None
        if self.cycle is not None and isinstance(self.transport, ThreadedWrites):
            self.cycle.scope.setdefault(WRITER, self.transport)

    def on_message_begin(self) -> None:
        """httptools' parser callback: a request begins in the bytes being read, so this is its first
        byte's time, exactly (also for pipelined requests and after a body answered early, where
        data_received's stamp above is missing); self.scope is the new request's. h11 has no such
        callback: there that stamp stands."""
        super().on_message_begin()  # type: ignore[misc]
        self.scope[FIRST_BYTE] = self._arrived  # type: ignore[attr-defined]
        if isinstance(self.transport, ThreadedWrites):
            self.scope[WRITER] = self.transport  # type: ignore[attr-defined]

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

    def eof_received(self) -> bool | None:
        """The client half-closed (shutdown(SHUT_WR)). uvicorn's protocols return None, and asyncio
        then closes the real transport at once: with a thread send under way its buffer is empty, so
        the connection would be lost with the thread's unsent rest never written (a truncated answer).
        With send threads the close is the ThreadedWrites' own, deferred until the thread's bytes are
        handed back to the transport, which then drains them; the transport is kept open until then."""
        keep_open = super().eof_received()  # type: ignore[misc]
        if keep_open or not isinstance(self.transport, ThreadedWrites):
            return keep_open
        self.transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


# Bodies from this size on are read directly: uvicorn's HIGH_WATER_LIMIT, below which it never pauses.
DIRECT_BODY_MIN = 1 << 16


class _Body:
    """One request body being read into its own buffer: `view` (a block of the wire arena), or else
    numpy's empty(), which leaves the pages untouched until data lands in them, so a declared length
    costs memory only as the bytes arrive."""

    def __init__(self, cycle: Any, length: int, view: memoryview | None = None):
        self.cycle = cycle
        self.view = np.empty(length, dtype=np.uint8).data if view is None else view  # writable, contiguous bytes
        self.filled = 0

    @property
    def complete(self) -> bool:
        return self.filled == len(self.view)


class _BodyReader(asyncio.BufferedProtocol):
    """Stands in for the HTTP protocol on the transport while the rest of a body is read: the
    transport recv_into()s the buffer's unfilled part, so no more bytes than the body are taken
    (a pipelined request behind it stays in the socket for the parser)."""

    def __init__(self, http: DirectBody):
        self.http: Any = http  # a DirectBody mixed into an asyncio.Protocol

    def get_buffer(self, sizehint: int) -> memoryview:
        body = self.http._body
        assert body is not None and not body.complete
        return body.view[body.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.http._body_received(nbytes)

    def eof_received(self) -> bool | None:
        return self.http.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()


class DirectBody:
    """Mixed in before uvicorn's httptools protocol: a body of DIRECT_BODY_MIN to max_body_bytes
    bytes with a Content-Length is read into one buffer and handed to the app as one message.

    What the parser delivers with the headers is copied in by on_body; the rest is read by a
    `_BodyReader` that replaces this protocol on the transport until the buffer is full (no flow
    control pauses: the buffer is bounded by the length, itself bounded by max_body_bytes). The
    parser, which saw only part of the body, is then replaced by a fresh one, and the request is
    complete as if the parser had seen it end. A response sent before its body has arrived (408,
    413, an error) says `Connection: close` and closes the connection: the rest of the body is never
    read. Larger bodies,
    chunked ones and pipelined requests take uvicorn's own path."""

    # Provided by the uvicorn protocol it is mixed into.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    scope: Any
    headers: list[tuple[bytes, bytes]]
    pipeline: Any
    parser: Any
    max_body_bytes = 0  # set by bounded_protocol
    arena: WireArena | None = None  # set by bounded_protocol
    on_arena_full: Callable[[], None] | None = None  # ... and called when a body does not fit in it

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._body: _Body | None = None

    def _declared_length(self) -> int | None:
        lengths = [v for n, v in self.headers if n == b"content-length"]
        if len(lengths) != 1 or any(n == b"transfer-encoding" for n, _ in self.headers):
            return None
        return int(lengths[0]) if lengths[0].isdigit() else None

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        cycle = self.cycle
        # No cycle of this request (an upgrade), or it waits behind another (pipelined): uvicorn's path.
        if cycle is None or cycle.scope is not self.scope or self.pipeline:
            return
        length = self._declared_length()
        if length is None or not DIRECT_BODY_MIN <= length <= self.max_body_bytes:
            return
        body = self._body = _Body(cycle, length, self._arena_buffer(length))
        self.scope[BODY] = body  # (its buffer is let go at the hand-over or the drop, as below)
        receive = cycle.receive

        async def receive_body() -> dict:
            message = await receive()
            if message["type"] == "http.request" and not message["more_body"] and body.complete:
                # Handed over: the app's message holds the buffer now, and nothing here keeps it (this
                # closure, the body and the cycle refer to each other, and a wire arena block held by
                # them would wait for the cyclic collector instead of returning when the request ends).
                message["body"], body.view = body.view, memoryview(b"")
            return message

        cycle.receive = receive_body  # run_asgi looks it up when the request's task starts
        send = cycle.send

        async def send_closing(message: dict) -> None:
            if message["type"] == "http.response.start" and self._body is body:
                # Answered before its body has all arrived (a 415, a 404, a 408...): the connection
                # closes after the answer (on_response_complete), and the answer says so; a client
                # that kept it alive sent its next request into a reset. (A 408 or 413 says it already.)
                headers = list(message.get("headers", ()))
                if not any(n.lower() == b"connection" and b"close" in v.lower() for n, v in headers):
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        cycle.send = send_closing

    def _arena_buffer(self, length: int) -> memoryview | None:
        """A block of the wire arena for a v2 binary inference body (POST .../infer with its JSON
        header's length, sent uncompressed), its binary part (after that header) on a cache line;
        None for other bodies and when the arena has no room (the copies then serve it)."""
        if self.arena is None or self.scope["method"] != "POST" or not self.scope["path"].endswith("/infer"):
            return None
        header = [v for n, v in self.headers if n == HEADER_LENGTH.encode()]
        if len(header) != 1 or not header[0].isdigit() or not 0 < int(header[0]) <= length:
            return None
        if any(n == b"content-encoding" and v.strip().lower() != b"identity" for n, v in self.headers):
            return None
        view = self.arena.buffer(length, lead=int(header[0]))
        if view is None and self.on_arena_full is not None:
            self.on_arena_full()
        return view

    def on_body(self, body: bytes) -> None:
        direct = self._body
        if direct is None or direct.cycle is not self.cycle:
            return super().on_body(body)  # type: ignore[misc]
        if not direct.cycle.response_complete:
            direct.view[direct.filled:direct.filled + len(body)] = body
            direct.filled += len(body)

    def on_message_complete(self) -> None:
        if self._body is not None and self._body.cycle is self.cycle:
            self._finish_body()  # the whole body came with the headers' data
        else:
            super().on_message_complete()  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._body is not None and not self._body.complete and not self.transport.is_closing():
            self.transport.set_protocol(_BodyReader(self))

    def _body_received(self, nbytes: int) -> None:
        body = self._body
        assert body is not None
        body.filled += nbytes
        if body.complete:
            self.transport.set_protocol(self)  # type: ignore[arg-type]
            self.parser = self._new_parser()
            self._finish_body()

    def _new_parser(self):
        """A parser for the next request, made as uvicorn's HttpToolsProtocol.__init__ makes it."""
        import httptools

        parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        return parser

    def _finish_body(self) -> None:
        body, self._body = self._body, None
        assert body is not None
        if not body.cycle.response_complete:
            body.cycle.more_body = False
            body.cycle.message_event.set()

    def on_response_complete(self) -> None:
        if self._body is not None and self._body.cycle is self.cycle:  # answered before its body arrived
            self._drop_body()
            self.transport.close()
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop_body()
        super().connection_lost(exc)  # type: ignore[misc]

    def _drop_body(self) -> None:
        """Forget a body that will never be handed over, and its buffer with it: the request's closure
        still refers to the body (a cycle), and a wire arena block it kept would wait for the collector."""
        if self._body is not None:
            self._body.view = memoryview(b"")
            self._body = None


def bounded_protocol(http_impl: str, max_body_bytes: int = 0, send_threads: int = 0, arena: WireArena | None = None,
                     on_arena_full: Callable[[], None] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's protocol class for `http_impl` (Settings.http_impl) with the bounds mixed in, on
    httptools the direct read of bodies up to `max_body_bytes` (Settings.max_request_bytes; 0: none),
    v2 binary inference bodies into `arena` (the wire arena, service.api.arena; `on_arena_full()` for
    each that does not fit), and with `send_threads` > 0 (Settings.send_threads) large writes by that
    many send threads. httptools is imported here, only when asked for: without it h11 still works
    (and reads no body into the arena)."""
    if http_impl == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return type("BoundedH11Protocol", (ConnectionBounds, H11Protocol), {"send_threads": send_threads})
    if http_impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return type("BoundedHttpToolsProtocol", (DirectBody, ConnectionBounds, HttpToolsProtocol),
                    {"max_body_bytes": max_body_bytes, "send_threads": send_threads, "arena": arena,
                     "on_arena_full": staticmethod(on_arena_full) if on_arena_full is not None else None})
    raise ValueError(f"http_impl must be httptools or h11, got {http_impl!r}")
