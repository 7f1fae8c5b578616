"""The httptools protocol's direct body read (service.api.connections.DirectBody) on a real uvicorn
server with a small ASGI app: a large body arrives as one message whatever way it is sent, the
next request on the connection (sent behind it, or pipelined in the same write) is parsed intact,
and a body that stops, a client that leaves and an answer sent before the body all end cleanly.
Each body is fresh random bytes; the app answers with their length, the number of messages they
came in and their SHA-256."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import socket
import time

import numpy as np
import pytest

from service.api.connections import DIRECT_BODY_MIN, FIRST_BYTE, bounded_protocol
from tests.api.common import http_answers as answers
from tests.api.common import uvicorn_serving

MAX_BODY = 8 << 20
EVENTS: list[str] = []  # what the app saw: "disconnect" when a body ended with the client gone


async def app(scope, receive, send) -> None:
    """POST /echo: the body's length, messages and digest. POST /refuse: 413 without reading.
    GET /age: seconds since the request's first byte as the connection stamped it."""
    if scope["path"] == "/age":
        age = f"{time.perf_counter() - scope[FIRST_BYTE]:.3f}".encode() if FIRST_BYTE in scope else b"none"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(age)).encode())]})
        await send({"type": "http.response.body", "body": age})
        return
    if scope["path"] == "/refuse":
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"nope"})
        return
    digest, size, messages = hashlib.sha256(), 0, 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            EVENTS.append("disconnect")
            return
        messages += 1
        digest.update(message["body"])
        size += len(message["body"])
        if not message.get("more_body", False):
            break
    answer = f"{size} {messages} {digest.hexdigest()}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def port():
    protocol = functools.partial(bounded_protocol("httptools", MAX_BODY), idle_timeout_s=30, max_connections=64)
    with uvicorn_serving(app, protocol) as port:
        yield port


def body(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def request(data: bytes, path: str = "/echo", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n{extra}\r\n").encode() + data


def echoed(data: bytes) -> tuple[int, int, str]:
    return len(data), 1, hashlib.sha256(data).hexdigest()


def parse(answer: bytes) -> tuple[int, int, str]:
    size, messages, digest = answer.decode().split()
    return int(size), int(messages), digest


@pytest.mark.parametrize("n", [DIRECT_BODY_MIN, 3 * DIRECT_BODY_MIN + 17, 4 << 20, MAX_BODY])
def test_a_large_body_arrives_as_one_message(port, n):
    data = body(n, seed=n)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(request(data))
        [(status, answer)] = answers(s, 1)
    assert status == 200 and parse(answer) == echoed(data)


def test_bodies_below_the_threshold_or_over_the_limit_take_uvicorns_path(port):
    small, large = body(DIRECT_BODY_MIN - 1, 1), body(MAX_BODY + 1, 2)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(request(small))
        s.sendall(request(large))
        (st1, a1), (st2, a2) = answers(s, 2)
    assert st1 == st2 == 200
    assert parse(a1)[::2] == echoed(small)[::2]
    assert parse(a2)[::2] == echoed(large)[::2] and parse(a2)[1] > 1  # uvicorn's chunks


def test_a_body_trickled_in_pieces_then_the_next_request_on_the_connection(port):
    first, second = body(1 << 20, 3), body(200_000, 4)
    raw = request(first)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        for at in range(0, len(raw), 99_991):  # odd pieces, the headers split from most of the body
            s.sendall(raw[at:at + 99_991])
            time.sleep(0.002)
        [(status, answer)] = answers(s, 1)
        assert status == 200 and parse(answer) == echoed(first)
        s.sendall(request(second))
        [(status, answer)] = answers(s, 1)
    assert status == 200 and parse(answer) == echoed(second)


def test_pipelined_requests_behind_a_large_body_are_parsed_intact(port):
    bodies = [body(n, 10 + i) for i, n in enumerate((700_001, 5, 300_000, 1))]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"".join(request(b) for b in bodies))  # one write: a request's tail shares a segment
        got = answers(s, len(bodies))
    for data, (status, answer) in zip(bodies, got, strict=True):
        assert status == 200 and parse(answer)[::2] == echoed(data)[::2]


def test_expect_100_continue(port):
    data = body(500_000, 5)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(request(b"", extra="Expect: 100-continue\r\n").replace(b"Content-Length: 0",
                                                                          f"Content-Length: {len(data)}".encode()))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(data)
        [(status, answer)] = answers(s, 1)
    assert status == 200 and parse(answer) == echoed(data)


def test_a_client_gone_mid_body_is_a_disconnect_and_the_server_goes_on(port):
    before = EVENTS.count("disconnect")
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(request(body(1 << 20, 6))[:300_000])
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while EVENTS.count("disconnect") == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert EVENTS.count("disconnect") == before + 1
    test_a_large_body_arrives_as_one_message(port, 1 << 20)


def test_an_answer_before_the_body_closes_the_connection(port):
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(request(body(1 << 20, 7), path="/refuse")[:100_000])
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(1 << 16)
            assert chunk, got
            got += chunk
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 ") and rest == b"nope"[:len(rest)], got
        # The app's answer did not say so; the connection that closes does (a client keeping the
        # connection sent its next request into a reset)
        assert b"\r\nconnection: close" in head.lower(), head
        s.settimeout(5)
        while chunk := s.recv(1 << 16):
            rest += chunk
        assert rest == b"nope", "the connection stayed open with the body half read"


def test_read_body_hands_a_one_message_body_over_as_it_came():
    """Starlette's stream ends with an empty chunk; read_body drops it, so the decoder gets the
    direct buffer itself and never joins (before: [buffer, b""], a 4 MiB copy per request)."""
    from starlette.requests import Request

    from service.api.http import read_body

    view = np.frombuffer(bytearray(body(300_000, 8)), dtype=np.uint8).data
    messages = [{"type": "http.request", "body": view, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"300000")]}
    chunks = asyncio.run(read_body(Request(scope, receive), limit=MAX_BODY, timeout_s=5))
    assert len(chunks) == 1 and chunks[0] is view


def test_the_tail_of_a_body_answered_early_is_not_the_next_requests_first_byte(port):
    """A small body refused before it was read: its tail arrives after the answer and the connection
    stays open; the next request's books start at its own first byte, not at that tail (the idle gap
    counted as the next request's receive before)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        data = body(1000, 8)
        whole = request(data, path="/refuse")
        s.sendall(whole[:-990])
        [(status, _)] = answers(s, 1)
        assert status == 413
        s.sendall(whole[-990:])  # the rest of the refused body
        gap_s = 2.0  # counted from the tail, the age would be at least this; a stall of the server's
        time.sleep(gap_s)  # thread under load adds to the true age, so the bound is half of it
        s.sendall(b"GET /age HTTP/1.1\r\nHost: x\r\n\r\n")  # one packet
        [(status, age)] = answers(s, 1)
        assert status == 200 and age != b"none" and float(age) < gap_s / 2, age
