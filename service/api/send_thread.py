"""Large HTTP writes handed to the kernel by a worker thread, not by the event loop.

On loopback TCP the kernel does a send's whole transmit in the sender's call: asyncio's
transport.write of a 4 MiB answer took 1.6 ms of the loop on the 2-core VM (a memcpy of the same
bytes: 0.3 ms; the whole answer went in one send(), nothing was left buffered) and ~1.1 ms on the
H200 host (moe_response_send_seconds). For that time no other connection of the front end is read,
parsed or answered (bench/NOTES.md, "Issue 11r"). With `--send-threads N` a write of SEND_THREAD_MIN
bytes or more on a connection with nothing else waiting is passed to send() in one of N threads
(send() releases the GIL) on a duplicate of the socket's descriptor made before the hand-off, so a
close or an abort of the connection meanwhile can never let the thread write into another
connection that reuses the number.
The thread sends what the socket takes now and never waits for a slow reader: whatever is left is
handed to the transport, which buffers and drains it as before. Writes made meanwhile wait in order
behind it, and a close waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

SEND_THREAD_MIN = 1 << 20  # below this a send costs the loop less than the hop to a thread and back (~0.1 ms)
_pool: ThreadPoolExecutor | None = None  # the process's send threads (Settings.send_threads; one front end each)


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(threads, thread_name_prefix="moe-send")
    return _pool


def _send_now(sock: socket.socket, data: memoryview) -> tuple[int, float]:
    """Send as much of `data` as the socket takes without waiting, then close `sock` (a duplicate:
    the connection stays open); the bytes sent (a failure is left to the transport, which meets it
    on its own next send and closes the connection) and when the last send returned (perf_counter)."""
    sent = 0
    try:
        while sent < len(data):
            sent += sock.send(data[sent:])
    except OSError:  # BlockingIOError: the socket is full; the rest goes through the transport
        pass
    finally:
        try:
            sock.close()
        except OSError as e:  # what was sent is in the kernel all the same: never sent twice
            log.debug("closing a send thread's duplicate descriptor: %s", e)
    return sent, time.perf_counter()


class ThreadedWrites:
    """Stands in for a connection's asyncio transport: large writes go to a worker thread; write,
    writelines, write_eof and close keep their order behind a thread send; the rest of the
    transport's interface is the transport's own.

    abort() is the transport's at once: a thread send under way finishes on its duplicate descriptor
    (what the socket takes now: it never waits), so the client may get a longer prefix of the answer
    before the connection ends; the answer is cut short either way, and the writes waiting behind the
    send are dropped, as the transport drops its buffer."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, threads: int):
        self._transport, self._loop, self._threads = transport, loop, threads
        self._fd = transport.get_extra_info("socket").fileno()
        self._waiting: list = []  # writes made while a thread sends, in order
        self._sending = False
        self._close = False  # close() was called while a thread sends
        self._eof = False  # write_eof() was called (while a thread sends: deferred like close)
        self._written: list[Callable[[float], None]] = []  # when_written callbacks
        self._sent_at = 0.0  # when the last thread send returned

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data) -> None:
        if self._eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        self._write(data)

    def writelines(self, list_of_data) -> None:
        for data in list_of_data:
            self.write(data)

    def _write(self, data) -> None:
        if self._sending:
            self._waiting.append(data)
        elif (len(data) >= SEND_THREAD_MIN and self._transport.get_write_buffer_size() == 0
              and not self._transport.is_closing()):
            try:  # duplicated here, while the number is surely this connection's: a thread that
                # duplicated it later could get another connection's socket if this one closed meanwhile
                sock = socket.socket(fileno=os.dup(self._fd))
            except OSError:  # (out of descriptors) the transport sends it
                self._transport.write(data)
                return
            # The descriptor is non-blocking already (one open file with the transport's), but a socket
            # object takes Python's default timeout (socket.setdefaulttimeout), under which send() would
            # wait for a slow reader: the thread must never wait.
            sock.setblocking(False)
            self._sending = True
            view = memoryview(data).cast("B")
            future = asyncio.wrap_future(_executor(self._threads).submit(_send_now, sock, view), loop=self._loop)
            future.add_done_callback(lambda f: self._sent(view, *self._outcome(f)))
        else:
            self._transport.write(data)

    @staticmethod
    def _outcome(future: asyncio.Future) -> tuple[int, float]:
        """What _send_now returned; nothing sent if it failed (the transport then sends it all)."""
        if future.cancelled() or future.exception() is not None:
            return 0, time.perf_counter()
        return future.result()

    def _sent(self, view: memoryview, sent: int, at: float) -> None:
        self._sending, self._sent_at = False, at
        log.debug("a send thread sent %d of %d bytes (the rest: the transport's)", sent, len(view))
        try:
            if sent < len(view):
                self._transport.write(view[sent:])
            waiting, self._waiting = self._waiting, []
            for data in waiting:
                self._write(data)  # (may start the next thread send: the rest waits behind it again)
        finally:
            if not self._sending:
                self._all_written()

    def _all_written(self) -> None:
        """Every write is in the kernel or the transport's buffer: the callbacks, then what was
        deferred (a failing callback is logged, and skips neither the others nor the close)."""
        callbacks, self._written = self._written, []
        try:
            for callback in callbacks:
                try:
                    callback(self._sent_at)
                except Exception:
                    log.exception("a when_written callback failed")
        finally:
            if self._eof:
                self._transport.write_eof()
            if self._close:
                self._transport.close()

    def when_written(self, callback: Callable[[float], None]) -> None:
        """Call `callback(at)` once every write so far is in the kernel or the transport's buffer:
        `at` is when (time.perf_counter) the last thread send returned, or now if none is under way
        (the loop's delay in running the callback is not the send's)."""
        if self._sending:
            self._written.append(callback)
        else:
            callback(time.perf_counter())

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._waiting)

    def is_closing(self) -> bool:
        return self._close or self._transport.is_closing()

    def close(self) -> None:
        if self._sending:
            self._close = True
        else:
            self._transport.close()

    def write_eof(self) -> None:
        self._eof = True
        if not self._sending:
            self._transport.write_eof()

    def abort(self) -> None:
        self._waiting.clear()
        self._transport.abort()
