"""What a hand-off between processes and threads costs when the receiver has been idle: the step's
hops (the owner's message to its rank, the rank's answer back, the event loop's hand-off to a step
thread and back), each timed as a one-way latency on the monotonic clock, blocking against spinning.

    python bench/wake_probe.py [--n 400] [--gap-ms 3] [--keepers N]
    python bench/wake_probe.py --keep-only N   # only the keepers, until killed (beside a served A/B arm)

Every message is sent after the receiver has waited gap-ms (as a rank waits for the next request at
one client), stamped with time.perf_counter() just before it is sent; the receiver stamps it as it
has it. Variants:
- pipe/block: a multiprocessing Pipe between two spawned processes, the receiver in conn.recv()
  (the rank's wait for a step; the owner's wait for the answer is the same read after a select);
- pipe/spin: the same receiver polling conn.poll(0) until the message is there;
- thread/executor: the event loop's run_in_executor to a waiting worker thread (the batcher's
  hand-off to its step thread), timed to the worker's first line;
- thread/back: a worker thread's result back to the loop's coroutine (the way back), timed to the
  coroutine's resumption;
- with --keepers N (N > 0; -1: one per CPU), pipe/block and the thread hops again, each row suffixed
  "+keep", while N processes busy-loop at SCHED_IDLE: every vCPU stays running, so a woken thread
  preempts a keeper at once instead of waiting for a halted vCPU to be scheduled by the hypervisor
  (the question: is a slow wake the vCPU's halt, which a server could avoid while it has work in flight?).
p50 / p90 in us per variant; a short table at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import signal
import statistics
import time

now = time.perf_counter


def _receiver(conn, spin: bool, n: int) -> None:
    lat = []
    for _ in range(n):
        if spin:
            while not conn.poll(0):
                pass
        sent = conn.recv()
        lat.append(now() - sent)
    conn.send(lat)


def pipe(n: int, gap_s: float, spin: bool) -> list[float]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_receiver, args=(b, spin, n))
    p.start()
    a.send(now())  # the first message waits for the child's start: not counted below
    time.sleep(1.0)
    lat = []
    for _ in range(n - 1):
        time.sleep(gap_s)
        a.send(now())
    lat = a.recv()[1:]
    p.join()
    return lat


async def _threads(n: int, gap_s: float) -> tuple[list[float], list[float]]:
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    there, back = [], []

    def work(sent: float) -> float:
        there.append(now() - sent)
        return now()

    await loop.run_in_executor(pool, work, now())  # the worker thread's start
    there.clear()
    for _ in range(n):
        await asyncio.sleep(gap_s)
        done = await loop.run_in_executor(pool, work, now())
        back.append(now() - done)
    pool.shutdown()
    return there, back


def _keeper() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def keepers(n: int) -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_keeper, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # their start (an interpreter each) is over before anything is timed
    return procs


def _p(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--gap-ms", type=float, default=3.0)
    ap.add_argument("--keepers", type=int, default=0,
                    help="also time pipe/block and the thread hops beside this many SCHED_IDLE busy loops "
                         "(-1: one per CPU)")
    ap.add_argument("--keep-only", type=int, metavar="N",
                    help="run N keepers (-1: one per CPU) until killed, and time nothing (bench/gpu_serve_ab.sh's "
                         "BENCH_KEEPERS arm)")
    args = ap.parse_args()
    if args.keep_only is not None:
        keepers((os.cpu_count() or 1) if args.keep_only < 0 else args.keep_only)
        signal.pause()
        return
    gap = args.gap_ms / 1e3
    rows = {"pipe/block": pipe(args.n, gap, False), "pipe/spin": pipe(args.n, gap, True)}
    rows["thread/executor"], rows["thread/back"] = asyncio.run(_threads(args.n, gap))
    n_keep = (os.cpu_count() or 1) if args.keepers < 0 else args.keepers
    if n_keep:
        procs = keepers(n_keep)
        try:
            rows[f"pipe/block+keep{n_keep}"] = pipe(args.n, gap, False)
            there, back = asyncio.run(_threads(args.n, gap))
            rows[f"thread/executor+keep{n_keep}"], rows[f"thread/back+keep{n_keep}"] = there, back
        finally:
            for p in procs:
                p.kill()
    print(f"| hop (gap {args.gap_ms:g} ms, n {args.n}) | p50 us | p90 us |\n|---|---|---|")
    for name, xs in rows.items():
        print(f"| {name} | {_p(xs, 50):.1f} | {_p(xs, 90):.1f} |")


if __name__ == "__main__":
    main()
