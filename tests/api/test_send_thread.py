"""Large writes sent by a worker thread (service.api.send_thread.ThreadedWrites): bytes arrive whole
and in the order written (small writes behind a large one wait for it), a close waits for them, a
client that does not read never holds a send thread, and through uvicorn (both protocols, with the
direct body read) every answer of pipelined and concurrent requests is its own request's bytes.
Every payload is fresh random bytes of an odd size."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import socket
import threading
import time

import numpy as np
import pytest

from service.api import send_thread
from service.api.connections import bounded_protocol
from service.api.send_thread import SEND_THREAD_MIN, ThreadedWrites
from tests.api.common import http_answers, uvicorn_serving

MAX_BODY = 16 << 20
THREADS = 3  # send threads (Settings.send_threads) in these tests


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def connect(port: int, small: bool = False) -> socket.socket:
    """A client connection whose every wait ends in 10 s (a regression fails the test, never hangs it);
    `small`: a fixed 64 KiB receive buffer (no autotuning), so what the connection holds does not
    depend on the host's tcp_rmem/tcp_wmem."""
    sock = socket.socket()
    sock.settimeout(10)
    if small:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # (before connect: the window)
    sock.connect(("127.0.0.1", port))
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (10 s at most for each recv)."""
    sock.settimeout(10)
    chunks = []
    while chunk := sock.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


_on_connect_failures: list[BaseException] = []  # asyncio only logs a protocol's exceptions


@pytest.fixture(autouse=True)
def on_connect_failures():
    """A test fails if its `serve_writes` on_connect raised (an assertion in it, say)."""
    _on_connect_failures.clear()
    yield
    assert not _on_connect_failures, _on_connect_failures


async def serve_writes(on_connect) -> tuple[asyncio.Server, int]:
    """A server whose connections get a ThreadedWrites and are handed to `on_connect(writes)`."""
    loop = asyncio.get_running_loop()

    class Proto(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            try:
                on_connect(ThreadedWrites(transport, loop, THREADS))
            except BaseException as e:
                _on_connect_failures.append(e)
                raise

    server = await loop.create_server(Proto, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def serve_and_read(on_connect) -> bytes:
    """Everything a client reads (until the server closes, 10 s at most) from a `serve_writes` server."""
    async def main() -> bytes:
        server, port = await serve_writes(on_connect)
        got = await asyncio.to_thread(lambda: read_all(connect(port)))
        server.close()
        return got

    return asyncio.run(main())


def test_writes_arrive_whole_and_in_order_and_close_waits_for_them():
    parts = [payload(n, seed) for seed, n in enumerate(
        [17, 3 * SEND_THREAD_MIN + 5, 1, SEND_THREAD_MIN, 4099, 2 * SEND_THREAD_MIN + 1, 3])]
    events: list[str] = []

    def on_connect(w: ThreadedWrites) -> None:
        for p in parts:
            w.write(memoryview(p) if len(p) >= SEND_THREAD_MIN else p)
        w.when_written(lambda at: events.append("written"))
        w.close()
        assert w.is_closing()
        events.append("closed")

    got = serve_and_read(on_connect)
    assert got == b"".join(parts)  # EOF came after the last byte: the close waited
    assert events == ["closed", "written"]  # the callback ran once the thread's sends were done


def test_a_client_that_does_not_read_holds_no_send_thread(monkeypatch):
    """THREADS + 2 clients that do not read get answers far larger than a socket holds: the
    threads send what fits and return, so one more client that reads gets its answer at once."""
    big = payload(48 << 20, 1)
    small = payload(SEND_THREAD_MIN + 3, 2)
    monkeypatch.setattr(send_thread, "_pool", None)  # this process's pool, made with THREADS threads

    async def main() -> tuple[bytes, float]:
        idle: list[socket.socket] = []
        writers: list[ThreadedWrites] = []
        server, port = await serve_writes(writers.append)
        for _ in range(THREADS + 2):
            idle.append(connect(port, small=True))  # 48 MiB is far more than the connection holds
        while len(writers) < len(idle):
            await asyncio.sleep(0.01)
        for w in writers:
            w.write(memoryview(big))
        deadline = time.monotonic() + 10
        while any(w._sending for w in writers):  # each thread send returns once its socket is full
            assert time.monotonic() < deadline, "a send thread still sends to a client that does not read"
            await asyncio.sleep(0.01)
        assert all(w._transport.get_write_buffer_size() > 0 for w in writers)  # the rest: the transport's
        reader = connect(port)  # a held thread: a timeout, no hang
        while len(writers) < len(idle) + 1:
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        writers[-1].write(memoryview(small))
        writers[-1].close()
        got = await asyncio.to_thread(read_all, reader)
        took = time.perf_counter() - start
        for s in idle + [reader]:
            s.close()
        server.close()
        return got, took

    got, took = asyncio.run(main())
    assert got == small
    assert took < 5.0  # (a thread waiting for a reader would hold it until that client reads: never)


def test_a_connection_reset_during_a_thread_send_ends_cleanly(monkeypatch, caplog):
    """The client resets the connection while the thread send is held: the transport sees the reset
    at once; a write and a close made meanwhile wait behind the send; once the thread's send has
    failed, the close reaches the transport (once, after the send), and nothing is logged as an error."""
    entered, gate, done = gate_sends(monkeypatch)
    big = payload(32 << 20, 3)

    async def main() -> list[bool]:
        writers: list[ThreadedWrites] = []
        server, port = await serve_writes(writers.append)
        client = connect(port)
        while not writers:
            await asyncio.sleep(0.01)
        w, closes = writers[0], []
        real_close = w._transport.close
        w._transport.close = lambda: closes.append(w._sending) or real_close()  # type: ignore[method-assign]
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        w.write(memoryview(big))
        assert await asyncio.to_thread(entered.wait, 10)
        client.close()  # a reset mid-send
        for _ in range(200):
            if w._transport.is_closing():
                break
            await asyncio.sleep(0.01)
        assert w._transport.is_closing() and w._sending  # the loop saw the reset, the thread is held
        w.write(b"after")
        w.close()
        assert closes == [] and w.is_closing()  # deferred
        gate.set()
        assert await asyncio.to_thread(done.wait, 10)
        for _ in range(200):
            if not w._sending:
                break
            await asyncio.sleep(0.01)
        assert not w._sending
        server.close()
        return closes

    assert asyncio.run(main()) == [False]  # closed once, after the thread's send
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_send_thread_never_writes_into_a_connection_that_reuses_the_descriptor(monkeypatch):
    """The connection is aborted while its thread send waits for the GIL (held here at a gate) and
    the next accepted connection gets the same descriptor number: the answer must not reach it (a
    thread that duplicated the number only when it ran would send it there)."""
    gate = threading.Event()
    real = send_thread._send_now
    monkeypatch.setattr(send_thread, "_send_now", lambda sock, data: gate.wait(10) and real(sock, data))
    big = payload(3 * SEND_THREAD_MIN + 1, 4)

    async def main() -> tuple[int, int, bytes]:
        writers: list[ThreadedWrites] = []
        server, port = await serve_writes(writers.append)
        first = connect(port)
        while not writers:
            await asyncio.sleep(0.01)
        fd = writers[0]._fd
        second = socket.socket()  # its number taken now, so that the server's next accept gets `fd`
        second.settimeout(10)
        writers[0].write(memoryview(big))
        writers[0].abort()  # its descriptor is closed at the loop's next turn
        await asyncio.sleep(0.05)
        second.connect(("127.0.0.1", port))
        while len(writers) < 2:
            await asyncio.sleep(0.01)
        gate.set()
        while writers[0]._sending:
            await asyncio.sleep(0.01)
        second.settimeout(0.3)
        try:
            leaked = second.recv(1 << 16)
        except TimeoutError:
            leaked = b""
        first.close()
        second.close()
        server.close()
        return fd, writers[1]._fd, leaked

    fd, reused, leaked = asyncio.run(main())
    assert reused == fd  # (else this run proves nothing: Linux gives the lowest free number)
    assert leaked == b""


def test_a_failed_duplicate_falls_back_to_the_transport(monkeypatch):
    def no_descriptors(fd):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(send_thread.os, "dup", no_descriptors)
    big = payload(2 * SEND_THREAD_MIN + 3, 5)

    def on_connect(w: ThreadedWrites) -> None:
        w.write(memoryview(big))
        assert not w._sending
        w.close()

    assert serve_and_read(on_connect) == big


def gate_sends(monkeypatch) -> tuple[threading.Event, threading.Event, threading.Event]:
    """(entered, gate, done): every thread send sets `entered`, waits (10 s at most) for `gate`,
    sends, then sets `done`."""
    entered, gate, done = threading.Event(), threading.Event(), threading.Event()
    real = send_thread._send_now

    def gated(sock, data):
        entered.set()
        gate.wait(10)
        try:
            return real(sock, data)
        finally:
            done.set()

    monkeypatch.setattr(send_thread, "_send_now", gated)
    return entered, gate, done


def test_a_failing_when_written_callback_skips_neither_the_others_nor_the_close(caplog):
    big = payload(3 * SEND_THREAD_MIN + 7, 11)
    ran: list[float] = []

    def fails(at: float) -> None:
        raise ValueError("a callback's bug")

    def on_connect(w: ThreadedWrites) -> None:
        w.write(memoryview(big))
        w.when_written(fails)
        w.when_written(ran.append)
        w.close()

    assert serve_and_read(on_connect) == big  # (a close skipped: the read times out)
    assert len(ran) == 1
    assert any("when_written" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_failing_close_of_the_duplicate_never_sends_bytes_twice(monkeypatch):
    real = socket.socket

    class CloseFails(real):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            super().close()
            raise OSError(9, "Bad file descriptor")

    big = payload(2 * SEND_THREAD_MIN + 5, 12)

    def on_connect(w: ThreadedWrites) -> None:
        with monkeypatch.context() as m:  # only the duplicate made by this write
            m.setattr(socket, "socket", CloseFails)
            w.write(memoryview(big))
        assert w._sending
        w.close()

    assert serve_and_read(on_connect) == big


def test_a_default_socket_timeout_never_makes_a_send_thread_wait():
    """With socket.setdefaulttimeout(t) the duplicate would wait up to t for a client that does not
    read; the thread must send what the socket takes and return at once."""
    big = payload(48 << 20, 13)

    async def main() -> float:
        writers: list[ThreadedWrites] = []
        server, port = await serve_writes(writers.append)
        client = connect(port)  # and never reads
        while not writers:
            await asyncio.sleep(0.01)
        socket.setdefaulttimeout(3.0)
        try:
            start = time.perf_counter()
            writers[0].write(memoryview(big))
            while writers[0]._sending:
                await asyncio.sleep(0.005)
            took = time.perf_counter() - start
        finally:
            socket.setdefaulttimeout(None)
        writers[0].abort()
        client.close()
        server.close()
        return took

    assert asyncio.run(main()) < 1.5  # (a waiting thread: 3 s)


def test_writelines_and_write_eof_keep_their_place_behind_a_thread_send(monkeypatch):
    _, gate, _ = gate_sends(monkeypatch)  # the thread sends only once every write below is made
    parts = [payload(n, 20 + seed) for seed, n in enumerate([2 * SEND_THREAD_MIN + 3, 19, SEND_THREAD_MIN + 1, 7])]
    tail = payload(5, 30)

    def on_connect(w: ThreadedWrites) -> None:
        w.write(memoryview(parts[0]))
        assert w._sending
        w.writelines([parts[1], memoryview(parts[2]), parts[3]])
        w.write_eof()  # after every byte above, not at once
        with pytest.raises(RuntimeError):
            w.write(tail)
        assert not w.is_closing()  # (a half-close: the server may still read)
        gate.set()

    assert serve_and_read(on_connect) == b"".join(parts)


def test_an_abort_during_a_thread_send_ends_the_connection(monkeypatch):
    """An abort while the thread send is held: the client sees a prefix of the answer, then the end
    of the connection; nothing waits, the writes behind the send are dropped. The send under way
    finishes on its duplicate descriptor, taking what the socket takes without waiting: the whole
    answer if the client reads as fast as the thread sends (seen in CI when it read meanwhile), so
    here it reads only once the send has returned, through small fixed buffers on both sides."""
    entered, gate, done = gate_sends(monkeypatch)
    big = payload(32 << 20, 14)
    state: list[ThreadedWrites] = []

    async def main() -> bytes:
        server, port = await serve_writes(state.append)
        client = connect(port, small=True)
        while not state:
            await asyncio.sleep(0.01)
        w = state[0]
        w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 << 10)
        w.write(memoryview(big))
        w.write(b"behind")
        await asyncio.to_thread(entered.wait, 10)
        w.abort()
        assert w.is_closing()
        gate.set()
        assert await asyncio.to_thread(done.wait, 10)  # the send returned: what it sent is all there is
        try:
            got = await asyncio.to_thread(read_all, client)
        except ConnectionResetError:
            got = b""
        await asyncio.to_thread(done.wait, 10)
        for _ in range(100):
            if not w._sending:
                break
            await asyncio.sleep(0.01)
        assert not w._sending and not w._waiting
        client.close()
        server.close()
        return got

    got = asyncio.run(main())
    assert len(got) < len(big) and big.startswith(got), len(got)  # cut short; never "behind"


# ---- through uvicorn ----------------------------------------------------------------------


async def echo_app(scope, receive, send) -> None:
    """POST /echo: the body back, as it came, in one body message (a large one: a thread send)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunks.append(bytes(message["body"]))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": memoryview(body)})


@pytest.fixture(scope="module", params=[("httptools", THREADS), ("h11", THREADS), ("httptools", 0)],
                ids=["httptools", "h11", "no-send-threads"])
def served(request):
    """(port, send threads) of a uvicorn server of `echo_app` on a bounded protocol."""
    http_impl, threads = request.param
    protocol = functools.partial(bounded_protocol(http_impl, MAX_BODY, threads), idle_timeout_s=30,
                                 max_connections=64)
    with uvicorn_serving(echo_app, protocol) as port:
        yield port, threads


def request(data: bytes) -> bytes:
    return f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data


def answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` answers' bodies off `sock`, each a 200."""
    got = http_answers(sock, count)
    assert [status for status, _ in got] == [200] * count
    return [body for _, body in got]


def test_pipelined_large_answers_come_back_in_order(served):
    port, _ = served
    bodies = [payload(n, 10 + i) for i, n in enumerate([SEND_THREAD_MIN + 1, 5, 3 * SEND_THREAD_MIN - 7,
                                                        SEND_THREAD_MIN - 1, 2 * SEND_THREAD_MIN + 9])]
    with connect(port) as s:
        s.sendall(b"".join(map(request, bodies)))  # pipelined: every request in one go
        assert answers(s, len(bodies)) == bodies
        again = payload(4 * SEND_THREAD_MIN + 1, 20)  # the connection is still good
        s.sendall(request(again))
        assert answers(s, 1) == [again]


def test_concurrent_connections_get_their_own_answers(served):
    port, _ = served
    results: dict[int, list[bool]] = {}

    def client(i: int) -> None:
        with connect(port) as s:
            ok = []
            for r in range(4):
                data = payload(SEND_THREAD_MIN + 1000 * i + r, 100 * i + r)
                s.sendall(request(data))
                ok.append(answers(s, 1) == [data])
            results[i] = ok

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: [True] * 4 for i in range(6)}


def test_send_threads_are_used_exactly_when_set(served, monkeypatch):
    """A large answer goes through a send thread with send threads set, and never without."""
    port, threads = served
    calls = []
    real = send_thread._send_now
    monkeypatch.setattr(send_thread, "_send_now", lambda sock, data: calls.append(len(data)) or real(sock, data))
    data = payload(2 * SEND_THREAD_MIN + 11, 7)
    with connect(port) as s:
        s.sendall(request(data))
        assert answers(s, 1) == [data]
    assert calls == ([len(data)] if threads else [])


def test_a_client_that_half_closes_during_a_thread_send_gets_the_whole_answer(served, monkeypatch):
    """The client sends its request, then shutdown(SHUT_WR) while the answer's thread send is held:
    the EOF must not close the connection under the thread (the rest it hands back to the transport
    would be dropped: a truncated answer); the whole answer arrives, then the connection closes."""
    port, threads = served
    entered, gate, _ = gate_sends(monkeypatch)
    data = payload(MAX_BODY - 13, 8)  # far more than the socket's buffers hold
    with connect(port) as s:
        s.sendall(request(data))
        assert not threads or entered.wait(10)  # (with no send threads the transport sends it)
        s.shutdown(socket.SHUT_WR)
        time.sleep(0.2)  # the server's loop sees the EOF while the thread is held
        gate.set()
        assert answers(s, 1) == [data]
        assert s.recv(1) == b""  # and then the server closes


def test_a_connection_reset_during_a_served_thread_send_breaks_nothing(served, monkeypatch, caplog):
    """The client resets its connection while the answer's thread send is held: the thread's send
    fails, its rest goes to a transport that is gone; nothing is raised or logged as an error, and
    the server answers the next connection."""
    port, threads = served
    if not threads:
        pytest.skip("no thread send to interrupt")
    entered, gate, done = gate_sends(monkeypatch)
    data = payload(MAX_BODY - 29, 9)
    with connect(port) as s:
        s.sendall(request(data))
        assert entered.wait(10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    time.sleep(0.2)  # the server's loop sees the reset (connection_lost) while the thread is held
    gate.set()
    assert done.wait(10)
    monkeypatch.undo()
    again = payload(SEND_THREAD_MIN + 17, 10)
    with connect(port) as s:
        s.sendall(request(again))
        assert answers(s, 1) == [again]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# ---- the served path: python -m service --send-threads 2 ------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from tests.serverproc import ServerProcess

    with ServerProcess.serving(tmp_path_factory.mktemp("send") / "server.log", "--send-threads", "2",
                               "--max-request-bytes", str(MAX_BODY), env={"MOE_LOG_LEVEL": "DEBUG"}) as proc:
        yield proc


def test_served_large_answers_with_send_threads_are_each_requests_own(service):
    """Concurrent v2 binary requests whose answers are over SEND_THREAD_MIN (fp32, H=256: 1 KiB a
    row), odd T over several steps, with a small one and a bad row among them: every answer is its
    own request's layer output, the bad row gets its own 400, the send book counts each answer, and
    each large answer went through a send thread (its debug line: not seen when server.py does not
    pass --send-threads on to the protocol)."""
    import httpx
    import torch
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from tests.api.common import check, inputs
    from tests.api.test_e2e import scrape, triton_inputs, value

    cases = [(1025, 1), (1537, 2), (3, 3), (1031, 4), (1100, 5)]
    with httpx.Client(base_url=service.url, timeout=60) as http:
        before, threaded_before = scrape(http), service.log().count("a send thread sent ")

        def one(case):
            T, seed = case
            x, ids, w = inputs(T, seed=seed, kind=("balanced", "skewed", "empty_expert")[seed % 3])
            if seed == 5:
                x[T // 2, 7] = float("nan")
            client = httpclient.InferenceServerClient(service.http_hostport, network_timeout=60)
            try:
                result = client.infer("moe", triton_inputs(httpclient, x, ids, w))
            except InferenceServerException as e:
                return T, seed, str(e)
            check(torch.from_numpy(result.as_numpy("output").copy()), x, ids, w)
            return T, seed, None

        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            outcomes = list(pool.map(one, cases))
        after = scrape(http)
    assert [o[2] is None for o in outcomes] == [True, True, True, True, False]
    assert outcomes[-1][2].startswith("[400]") and "(row 550)" in outcomes[-1][2], outcomes[-1][2]
    sent = (value(after["moe_response_send_seconds"], "moe_response_send_seconds_count", protocol="v2_binary")
            - value(before["moe_response_send_seconds"], "moe_response_send_seconds_count", protocol="v2_binary"))
    assert sent == 4  # every answer's book came back from its send thread (the 400 is not sent in parts)
    assert "2 send thread(s)" in service.log()
    large = sum(T * 256 * 4 >= SEND_THREAD_MIN for T, seed in cases if seed != 5)
    assert service.log().count("a send thread sent ") - threaded_before == large == 3
