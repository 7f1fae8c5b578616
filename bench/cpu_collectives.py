"""Why a small gloo collective among the CPU default's 4 ranks takes milliseconds on 2 cores.

    python bench/cpu_collectives.py [--ranks 4] [--iters 200] [--threads 1]

R spawned processes (as the rank group spawns them: a TCPStore, a gloo group on loopback) time,
per call, the collectives of the serial step at the cpu preset (E=16, H=256, K=4, C=128) for a
T=8 step (m = 2 rows per rank):
  - `ag_routing`  all_gather of the routing block (META + 2*C*K int32 = 4 KB per rank)
  - `ag_tokens`   all_gather of m token rows [m, H] fp32 (2 KB per rank)
  - `allreduce`   all_reduce of [R*m, H] fp32 (the gloo stand-in for the reduce-scatter)
  - `barrier`     gloo's barrier (one all-reduce of one element)
  - `sem_barrier` a barrier of R multiprocessing semaphores (each rank posts R-1 and waits R-1 times):
                  the floor of what ranks on one host must pay to agree that a step's data is written
Each call is preceded by a barrier of the same kind and by `--work-us` of compute (a matmul sized
to take about that long), as the step's stages are. Printed: median and p90 on rank 0, in us, the
median context switches of rank 0's process during one call (all its threads, from
/proc/self/task/*/status), and each process's thread count, with `--threads` torch intra-op
threads each (the group gives max(1, cores // R)).

`--idle-us` instead of work: the ranks sleep that long before the call (they arrive idle, as
after reading the step message), so the figure shows the wake-up cost alone.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

H, K, C, META = 256, 4, 128, 4


def sem_barrier(sems, rank: int, timeout: float = 30.0) -> None:
    """Post every peer once, then take R-1 posts of our own (see service.worker.shm's barrier)."""
    for p, s in enumerate(sems):
        if p != rank:
            s.release()
    for _ in range(len(sems) - 1):
        if not sems[rank].acquire(timeout=timeout):
            raise TimeoutError("barrier")


def _switches() -> int:
    """Context switches of this process so far (every thread's, voluntary and not)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except FileNotFoundError:
            pass
    return total


def _rank(rank: int, R: int, port: int, iters: int, threads: int, work_us: float, idle_us: float,
          sems, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=R, timeout=datetime.timedelta(seconds=60))
    m = 2
    routing = torch.zeros(META + 2 * C * K, dtype=torch.int32)
    routing_g = [torch.zeros_like(routing) for _ in range(R)]
    tok = torch.randn(m, H)
    tok_g = [torch.zeros_like(tok) for _ in range(R)]
    red = torch.randn(R * m, H)
    a = torch.randn(64, 64)
    # size the work: matmuls of 64x64 until about work_us
    t0 = time.perf_counter()
    for _ in range(100):
        a @ a
    per = (time.perf_counter() - t0) / 100
    reps = max(0, int(work_us * 1e-6 / per))

    def work():
        if idle_us:
            time.sleep(idle_us * 1e-6)
        for _ in range(reps):
            a @ a

    ops = {
        "ag_routing": (lambda: dist.all_gather(routing_g, routing), dist.barrier),
        "ag_tokens": (lambda: dist.all_gather(tok_g, tok), dist.barrier),
        "allreduce": (lambda: dist.all_reduce(red), dist.barrier),
        "barrier": (dist.barrier, dist.barrier),
        "sem_barrier": (lambda: sem_barrier(sems, rank), lambda: sem_barrier(sems, rank)),
    }
    result = {"threads": len(os.listdir("/proc/self/task"))}
    for name, (op, sync) in ops.items():
        times = []
        for i in range(iters + 10):
            sync()
            work()
            cs0 = _switches()
            t0 = time.perf_counter()
            op()
            dt = time.perf_counter() - t0
            if i >= 10:
                times.append(dt * 1e6)
                result.setdefault(name + "_cs", []).append(_switches() - cs0)
        times.sort()
        result[name] = (statistics.median(times), times[int(0.9 * len(times))])
        result[name + "_cs"] = statistics.median(result[name + "_cs"])
    out.put((rank, result))
    dist.barrier()
    os._exit(0)


def run(R: int, iters: int, threads: int, work_us: float, idle_us: float) -> dict:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True,  # noqa: F841 - serves the ranks
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    sems = [ctx.Semaphore(0) for _ in range(R)]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, R, port, iters, threads, work_us, idle_us, sems, out))
             for r in range(R)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", default="1", help="torch intra-op threads per rank, comma-separated")
    p.add_argument("--work-us", type=float, default=0.0, help="compute before each call (us)")
    p.add_argument("--idle-us", type=float, default=0.0, help="sleep before each call (us)")
    args = p.parse_args()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}, R={args.ranks}, work {args.work_us:.0f} us, "
          f"idle {args.idle_us:.0f} us, torch {torch.__version__}")
    names = ("ag_routing", "ag_tokens", "allreduce", "barrier", "sem_barrier")
    print("| threads/rank | OS threads/rank | " + " | ".join(f"{n} p50 / p90 us (switches)" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for threads in (int(t) for t in args.threads.split(",")):
        res = run(args.ranks, args.iters, threads, args.work_us, args.idle_us)[0]
        cells = " | ".join(f"{res[n][0]:,.0f} / {res[n][1]:,.0f} ({res[n + '_cs']:.0f})" for n in names)
        print(f"| {threads} | {res['threads']} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
