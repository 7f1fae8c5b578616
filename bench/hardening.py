"""Issue 14's figures: a real CPU server attacked, what it answers and what it costs.

    python3 bench/hardening.py [--root DIR] [--old]

`--root` picks the tree whose `service` and `tests` packages run (default: this checkout), so the
same attack runs against an older commit unpacked elsewhere; `--old` leaves out the flags that
tree lacks. Prints: the corpus (inputs tried, answers that were not a named 4xx, 5xx among
them, per protocol), memory and /v2/health/live latency around oversized gRPC messages, an idle
connection flood, and the seconds from SIGSTOP on a rank to readiness false and back to ready.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]  # bench/service.py shadows `service`

IDLE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 64
FLOOD = 256              # idle sockets per protocol (the figure)
OVERSIZED = 12           # gRPC messages declaring [1, H], carrying 48 MiB of fp32 values


def probe_live(url: str, stop: threading.Event, out: list[float]) -> None:
    import httpx

    while not stop.is_set():
        t0 = time.monotonic()
        try:
            httpx.get(url + "/v2/health/live", timeout=30)
            out.append(time.monotonic() - t0)
        except httpx.HTTPError:
            out.append(float("inf"))
        time.sleep(0.05)


def while_probing(url: str, work) -> float:
    """Run work() while /v2/health/live is polled; the slowest answer in seconds."""
    lat: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=probe_live, args=(url, stop, lat))
    t.start()
    try:
        work()
    finally:
        stop.set()
        t.join()
    return max(lat) if lat else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.dirname(_HERE))
    ap.add_argument("--old", action="store_true", help="the tree has no --idle-timeout-s / --max-connections")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = root  # the server process imports the same tree
    import httpx
    import numpy as np

    from tests.api import corpus
    from tests.api.common import CFG
    from tests.serverproc import LOOPBACK, ServerProcess, descendants, listening, rss_bytes

    flags = ["--grpc-max-message-bytes", str(64 << 20), "--max-request-bytes", str(4 << 20)]
    if not args.old:
        flags += ["--idle-timeout-s", str(IDLE_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]
    log = os.path.join(tempfile.mkdtemp(), "server.log")
    server = ServerProcess([sys.executable, "-m", "service", *flags], log, cwd=root,  # -m imports from cwd
                           env=ServerProcess.loopback_env(dict(os.environ)))
    try:
        server.wait_ready()
        print(f"tree {root}; server pid {server.pid}; flags {' '.join(flags)}")
        addresses = listening({server.pid, *descendants(server.pid)})
        beyond = [a for a in addresses if not a.startswith(LOOPBACK)]
        print(f"listening: {len(addresses)} sockets, beyond loopback: {beyond or 'none'}")

        tried, bad, fivexx = collections.Counter(), collections.Counter(), collections.Counter()
        examples = []
        t0 = time.monotonic()
        for name, protocol, send in corpus.cases():
            status, text = send(server)
            tried[protocol] += 1
            if not corpus.acceptable(protocol, status, text):
                bad[protocol] += 1
                examples.append(f"{protocol}/{name}: {status} {text[:80]!r}")
            if status in ("INTERNAL", "UNKNOWN") or (isinstance(status, int) and status >= 500):
                fivexx[protocol] += 1
        print(f"corpus: {sum(tried.values())} inputs in {time.monotonic() - t0:.1f} s; not a named 4xx: "
              f"{sum(bad.values())}; 5xx/INTERNAL/UNKNOWN: {sum(fivexx.values())}")
        for p in tried:
            print(f"  {p:17s} tried {tried[p]:3d}  not-4xx {bad[p]:3d}  5xx {fivexx[p]:3d}")
        for e in examples[:12]:
            print("   ", e)
        ready = httpx.get(server.url + "/v2/health/ready", timeout=5).status_code
        print(f"after the corpus: ready {ready}")

        values = np.random.default_rng(5).standard_normal(12 << 20).astype(np.float32)
        req = corpus._grpc_request(raw=False)
        req.inputs[0].shape[:] = [1, CFG.H]
        req.inputs[0].contents.fp32_contents[:] = values
        data = req.SerializeToString()
        before = rss_bytes(server.pid)
        codes = []
        worst = while_probing(server.url, lambda: codes.extend(
            corpus.grpc_send(server.grpc_url, data)[0] for _ in range(OVERSIZED)))
        time.sleep(1.0)
        after = rss_bytes(server.pid)
        print(f"oversized gRPC: {OVERSIZED} x {len(data) >> 20} MiB -> {collections.Counter(codes)}; front end "
              f"RSS {before >> 20} -> {after >> 20} MiB (+{(after - before) >> 20}) 1 s after; "
              f"slowest live {worst:.3f} s")

        lines0 = len(server.log().splitlines())
        socks = []

        def flood():
            for port in (server.http_port, server.grpc_port):
                socks.extend(socket.create_connection(("127.0.0.1", port)) for _ in range(FLOOD))
            time.sleep(1.0)

        worst = while_probing(server.url, flood)
        time.sleep(IDLE_TIMEOUT_S + 3)
        still = collections.Counter()
        for s in socks:
            port = s.getpeername()[1]
            s.setblocking(False)
            try:
                closed = s.recv(1) == b""  # EOF: the server closed it
            except BlockingIOError:
                closed = False             # nothing to read: still open
            except OSError:
                closed = True              # reset by the server
            still["HTTP" if port == server.http_port else "gRPC"] += not closed
            s.close()
        added = len(server.log().splitlines()) - lines0
        print(f"idle flood: {FLOOD} HTTP + {FLOOD} gRPC sockets; slowest live {worst:.3f} s; open "
              f"{IDLE_TIMEOUT_S + 3:.0f} s later: HTTP {still['HTTP']}, gRPC {still['gRPC']}; log lines added {added}")

        pids = server.rank_pids()
        os.kill(pids[2], signal.SIGSTOP)
        t0 = time.monotonic()
        while httpx.get(server.url + "/v2/health/ready", timeout=5).status_code == 200:
            if time.monotonic() - t0 > 90:
                break
            time.sleep(0.05)
        detected = time.monotonic() - t0
        while httpx.get(server.url + "/v2/health/ready", timeout=5).status_code != 200:
            if time.monotonic() - t0 > 180:
                break
            time.sleep(0.1)
        recovered = time.monotonic() - t0
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        print(f"SIGSTOP rank 2: readiness false after {detected:.1f} s, ready again after {recovered:.1f} s")
    finally:
        code = server.stop()
        print(f"server exit code {code}")


if __name__ == "__main__":
    main()
