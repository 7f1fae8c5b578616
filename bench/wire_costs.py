"""The v2 HTTP wire's receive and send of one large body, timed alone against their floors.

    python bench/wire_costs.py [--mib 4,16] [--reps 200]

Per size, in one run, interleaved (every rep times each variant once, in turn):
- memcpy: numpy copy of the bytes into a buffer (the floor the brief compared with);
- tcp: one loopback TCP transfer, a blocking sendall() in a thread to a blocking recv_into() of one
  buffer in another: send start -> the last byte received (the wire's floor: the kernel's copies and
  its TCP work, no event loop);
- receive: an asyncio BufferedProtocol reading the body into one buffer (what DirectBody does),
  the client's send start -> the body complete on the loop, and the loop thread's CPU time from
  its first read of the body to its last ("loop cpu");
- send (transport / threaded): the loop answers a 1-byte request with the body through the
  transport as it is, or through service.api.send_thread.ThreadedWrites: the loop's time inside
  write() ("loop") and the client's request -> the last answer byte read ("client").
The client is a thread of this process on its own connection (its recv releases the GIL). Medians,
us; the ratio column is the variant over the tcp floor measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from service.api.send_thread import ThreadedWrites  # noqa: E402

SEND_THREADS = 4  # --send-threads of the threaded variant


def median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def tcp_floor(data: memoryview, reps: int) -> list[float]:
    """Blocking loopback transfers of `data` on one connection: send start -> last byte received (s)."""
    with socket.create_server(("127.0.0.1", 0)) as ls:
        port = ls.getsockname()[1]
        done: list[float] = []

        def receive() -> None:
            conn, _ = ls.accept()
            with conn:
                buf = memoryview(bytearray(len(data)))
                for _ in range(reps):
                    got = 0
                    while got < len(data):
                        got += conn.recv_into(buf[got:])
                    done.append(time.perf_counter())
                    conn.sendall(b"k")

        th = threading.Thread(target=receive)
        th.start()
        starts: list[float] = []
        client_sends(port, data, reps, starts)
        th.join()
    return [d - a for d, a in zip(done, starts, strict=True)][2:]


class Answer(asyncio.Protocol):
    """Answers each 1-byte request with the prepared body, through the transport or ThreadedWrites."""

    body = memoryview(b"")
    threaded = False
    loop_s: list[float] = []

    def connection_made(self, transport) -> None:
        self.t = ThreadedWrites(transport, asyncio.get_running_loop(), SEND_THREADS) if self.threaded else transport

    def data_received(self, data: bytes) -> None:
        start = time.perf_counter()
        self.t.write(self.body)
        self.loop_s.append(time.perf_counter() - start)


class Receive(asyncio.BufferedProtocol):
    """Reads one body of a known size into one buffer, then answers one byte."""

    size = 0
    done_at: list[float] = []
    cpu_s: list[float] = []

    def connection_made(self, transport) -> None:
        self.t, self.buf, self.got = transport, memoryview(bytearray(self.size)), 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.got == 0:
            self.cpu0 = time.thread_time()
        return self.buf[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got == self.size:
            self.done_at.append(time.perf_counter())
            self.cpu_s.append(time.thread_time() - self.cpu0)
            self.got = 0
            self.t.write(b"k")


def client_answers(port: int, size: int, reps: int, out: list[float]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(size))
        for _ in range(reps):
            start = time.perf_counter()
            s.sendall(b"x")
            got = 0
            while got < size:
                got += s.recv_into(buf[got:])
            out.append(time.perf_counter() - start)


def client_sends(port: int, data: memoryview, reps: int, out: list[float]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            out.append(time.perf_counter())
            s.sendall(data)
            s.recv(1)


async def in_thread(target, *args) -> None:
    th = threading.Thread(target=target, args=args)
    th.start()
    while th.is_alive():
        await asyncio.sleep(0.001)


async def send_once(data: memoryview, threaded: bool, reps: int) -> tuple[list[float], list[float]]:
    Answer.body, Answer.threaded, Answer.loop_s = data, threaded, []
    server = await asyncio.get_running_loop().create_server(Answer, "127.0.0.1", 0)
    client: list[float] = []
    await in_thread(client_answers, server.sockets[0].getsockname()[1], len(data), reps, client)
    server.close()
    return Answer.loop_s, client


async def receive_once(data: memoryview, reps: int) -> tuple[list[float], list[float]]:
    Receive.size, Receive.done_at, Receive.cpu_s = len(data), [], []
    server = await asyncio.get_running_loop().create_server(Receive, "127.0.0.1", 0)
    starts: list[float] = []
    await in_thread(client_sends, server.sockets[0].getsockname()[1], data, reps, starts)
    server.close()
    return [d - s for d, s in zip(Receive.done_at, starts, strict=True)], Receive.cpu_s


async def measure(mib: int, reps: int, rounds: int) -> list[str]:
    size = mib << 20
    data = memoryview(np.random.default_rng(mib).integers(0, 256, size, dtype=np.uint8).tobytes())
    dst = np.empty(size, np.uint8)
    src = np.frombuffer(data, np.uint8)
    res: dict[str, list[float]] = {k: [] for k in (
        "memcpy", "tcp", "receive", "receive loop cpu", "send transport loop", "send transport client",
        "send threaded loop", "send threaded client")}
    per = max(reps // rounds, 5)
    for _ in range(rounds):  # interleaved: each round times every variant
        for _ in range(per):
            t0 = time.perf_counter()
            dst[:] = src
            res["memcpy"].append(time.perf_counter() - t0)
        res["tcp"] += tcp_floor(data, per)
        wall, cpu = await receive_once(data, per)
        res["receive"] += wall[2:]
        res["receive loop cpu"] += cpu[2:]
        for threaded, name in ((False, "transport"), (True, "threaded")):
            loop_s, client = await send_once(data, threaded, per)
            res[f"send {name} loop"] += loop_s[2:]
            res[f"send {name} client"] += client[2:]
    floor = median_us(res["tcp"])
    rows = [f"| {mib} MiB {k} | {median_us(v):,.0f} | {median_us(v) / floor:.2f} | {len(v)} |" for k, v in res.items()]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", default="4,16")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"# load average {os.getloadavg()[0]:.1f}; medians")
    print("| what | us | / tcp floor | n |\n|---|---|---|---|")
    for mib in map(int, args.mib.split(",")):
        for row in asyncio.run(measure(mib, args.reps, args.rounds)):
            print(row, flush=True)
    print(f"# load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
