"""Closed-loop load and its summary, for bench/multigpu.py load (threads in one process; the
issue-11 load generator, bench/serve_load.py, uses client processes instead).

Imported as `bench.loadstats`, with the repository's root on sys.path.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time


def measure(callers: list, seconds: float, min_requests: int = 1) -> tuple[list[float], float]:
    """Latencies of back-to-back calls, one thread per caller, for about `seconds` and at least
    `min_requests` calls in all; and the wall time they took."""
    stop = time.perf_counter() + seconds

    def worker(call) -> list[float]:
        lat = []
        while time.perf_counter() < stop or len(lat) * len(callers) < min_requests:
            t0 = time.perf_counter()
            call()
            lat.append(time.perf_counter() - t0)
        return lat

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(callers)) as pool:
        lats = [x for f in [pool.submit(worker, c) for c in callers] for x in f.result()]
    return lats, time.perf_counter() - t0


def summary(lats: list[float], wall: float, T: int) -> dict:
    """Requests, tokens/s and p50/p99 latency (ms) of `lats` latencies of T-token calls over `wall` s."""
    q = statistics.quantiles(lats, n=100, method="inclusive") if len(lats) > 1 else [lats[0]] * 99
    return {"requests": len(lats), "tok_s": len(lats) * T / wall, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}
