"""The step's host copies on this machine: is a slow copy the memory, the pinning or NUMA? (issue 11t)

    python bench/host_copies.py [--sizes 512,2048] [--threads 1,4] [--reps 30]

The front end's step thread copies a request's rows [T, 4096] bf16 (4 MiB at T=512) into a
shared-memory slot and checks them there (compute_input), and the answer out of it (compute_output):
service.api.batcher's `_copy_in`, `_copy_out` and `_write_out`. On the H200 host those took 1.8 and
0.9 ms for 4 MiB (~3 GB/s), where a memcpy of 4 MiB is expected at ~0.3 ms. This times each piece
alone, from a step-like thread, on one torch thread as a front end runs, split over --threads
(service.api.batcher.RowSplit, as --copy-threads does), into and out of:
- `pageable`: a plain torch tensor of this process;
- `slot`: a real slot (service.worker.shm.create_slots), MAP_SHARED, not registered with CUDA;
- `slot pinned here`: the same, registered with CUDA by this process (service.worker.rank.pin_slot);
- `slot pinned by a rank`: registered by another process that maps the same file, as in the server
  (the rank registers its mapping; the front end copies through its own; cudaHostRegister faults
  the pages in on the rank's NUMA node).
The pinned kinds need CUDA (skipped without). Pieces: memcpy of the rows in (same dtype), preadv
from a /dev/shm object (a shm request), the check alone (codecs.rows_error: one sum), the batcher's
copy in + check (`_copy_in`, wire and shm), the copy in fused with the check chunk by chunk (256 KiB
and 1 MiB: does the re-read of 4 MiB cost here?), the copy out (memcpy, and pwritev to /dev/shm as
`_write_out`), the copies in again after 2 ms of sleep each (a core idle between requests, as at
concurrency 1: clock and C-state), and, in the slot pinned here, the copy out right after a DMA wrote slot.out (as after
a step: the device's writes leave none of those lines in the CPU's caches).
Then NUMA: the nodes and their CPUs (/sys; `numactl -H` if present), this process's affinity, where
the slot's pages are (/proc/self/numa_maps), and with more than one node whose CPUs this process may
use, the 1-thread copies of the first size again with the step thread bound to each node's CPUs.
Median us of --reps; a table per section; the load average.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
from frontend_costs import shm_rows

from service.api import batcher, codecs
from service.api.regions import copy_rows
from service.config import preset
from service.worker.shm import Slot, create_slots, remove_slots

PINNED_HERE = "slot pinned here"
CHUNKS = (256 << 10, 1 << 20)  # the fused copy + check's chunk bytes
LSCPU = {"Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "NUMA node(s)", "CPU max MHz",
         "L2 cache", "L3 cache", "Hypervisor vendor", "Flags"}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx", "erms")  # of lscpu's: the ones a bf16 sum and a memcpy may use


def median_us(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> float:
    """Median us of fn(), `before` (untimed) ahead of each run."""
    times = []
    for i in range(reps + 1):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def fused(dst: torch.Tensor, src, chunk_bytes: int, lo: int, hi: int):
    """Rows lo..hi copied in and checked chunk by chunk (each chunk's sum while its rows are in cache)."""
    step = max(1, chunk_bytes // (dst.shape[1] * dst.element_size()))
    bad = None
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        copy_rows(dst[a:b], src[a:b])
        if bad is None:
            bad = codecs.rows_error(dst[a:b], src[a:b], a)
    return bad


def pieces(slot: Slot, T: int, split: batcher.RowSplit, reps: int, dma=None) -> dict[str, float]:
    """Median us of each piece for T rows of `slot` (its x and out), split by `split`."""
    H, dt = slot.x.shape[1], slot.x.dtype
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(dt)
    answer = torch.empty_like(x)
    n = T * H * dt.itemsize
    run = functools.partial(split.run, n=T, piece_bytes=n)
    dst, out = slot.x[:T], slot.out[:T]
    out.copy_(x)
    got = {}
    with shm_rows(x) as src, shm_rows(answer) as region:
        def time_ranges(name: str, fn, before=None) -> None:
            got[name] = median_us(lambda: run(fn), reps, before)

        time_ranges("memcpy in", lambda lo, hi: dst[lo:hi].copy_(x[lo:hi]))
        time_ranges("preadv in (from /dev/shm)", lambda lo, hi: copy_rows(dst[lo:hi], src[lo:hi]))
        idle = functools.partial(time.sleep, 0.002)  # as a step thread between requests at concurrency 1
        time_ranges("memcpy in after 2 ms idle", lambda lo, hi: dst[lo:hi].copy_(x[lo:hi]), idle)
        time_ranges("preadv in after 2 ms idle", lambda lo, hi: copy_rows(dst[lo:hi], src[lo:hi]), idle)
        time_ranges("check alone (sum)", lambda lo, hi: codecs.rows_error(dst[lo:hi], x[lo:hi]))
        time_ranges("_copy_in wire (memcpy + check)", functools.partial(batcher._copy_in, dst, x, 0))
        time_ranges("_copy_in shm (preadv + check)", functools.partial(batcher._copy_in, dst, src, 0))
        for c in CHUNKS:
            time_ranges(f"fused in {c >> 10} KiB chunks, wire", functools.partial(fused, dst, x, c))
            time_ranges(f"fused in {c >> 10} KiB chunks, shm", functools.partial(fused, dst, src, c))
        time_ranges("memcpy out (_copy_out)", functools.partial(batcher._copy_out, answer, out))
        time_ranges("pwritev out (_write_out, to /dev/shm)", functools.partial(batcher._write_out, region, out))
        if dma is not None:  # slot.out just written by the device, as after a step
            time_ranges("memcpy out after a DMA", functools.partial(batcher._copy_out, answer, out), lambda: dma(out))
            time_ranges("pwritev out after a DMA", functools.partial(batcher._write_out, region, out), lambda: dma(out))
    return got


def _rank(cfg, path: str, conn) -> None:
    """A stand-in rank: map the slot file, register it with CUDA, wait until told to go."""
    from service.worker.rank import pin_slot

    slot = Slot.open(cfg, 0, path)
    torch.cuda.init()
    pin_slot(slot)
    conn.send("pinned")
    conn.recv()


def numa() -> tuple[list[str], dict[int, list[int]]]:
    """Lines describing the NUMA layout and this process, and each node's CPUs."""
    lines, nodes = [], {}
    root = "/sys/devices/system/node"
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("node") and name[4:].isdigit():
            with open(f"{root}/{name}/cpulist") as f:
                cpus = f.read().strip()
            nodes[int(name[4:])] = _cpus(cpus)
            lines.append(f"{name}: cpus {cpus}")
    lines.append(f"this process may run on cpus {_ranges(sorted(os.sched_getaffinity(0)))}")
    if shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines()
        except (OSError, subprocess.SubprocessError) as e:
            out = [f"lscpu failed: {e}"]
        for line in out:
            key, _, value = line.partition(":")
            if key.strip() == "Flags":
                value = " ".join(f for f in value.split() if f.startswith(FLAGS))
            if key.strip() in LSCPU:
                lines.append(f"lscpu: {key.strip()}: {value.strip()}")
    if shutil.which("numactl"):
        try:
            lines += ["numactl -H:"] + subprocess.run(["numactl", "-H"], capture_output=True, text=True,
                                                      timeout=5).stdout.splitlines()
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"numactl -H failed: {e}")
    else:
        lines.append("(no numactl here)")
    return lines, nodes


def pages_where(path: str) -> str:
    """The slot file's pages by node, from /proc/self/numa_maps (N<node>=<pages>)."""
    try:
        with open("/proc/self/numa_maps") as f:
            hits = [line.split(" ", 1)[1].strip() for line in f if path in line]
    except OSError as e:
        return f"no /proc/self/numa_maps ({e.strerror})"
    return "; ".join(hits) or "not mapped?"


def _cpus(text: str) -> list[int]:
    out = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def _ranges(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]} ({len(cpus)})" if cpus else "none"


def table(title: str, columns: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}\n| piece | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for row in next(iter(columns.values())):
        print(f"| {row} | " + " | ".join(f"{c[row]:,.0f}" if row in c else "-" for c in columns.values()) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="512,2048")
    p.add_argument("--threads", default="1,4")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)  # as every front end (service.fleet.set_frontend_threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    cfg = preset("seed", R=1, C=max(sizes))
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "no CUDA"
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; {device}; "
          f"rows [T, {cfg.H}] {cfg.dtype}; median us of {args.reps}")
    lines, nodes = numa()
    print("\n".join(lines))
    kinds: dict[str, Slot] = {}
    slots = create_slots(cfg, 3 if cuda else 1)
    rank = None
    try:
        pageable = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype)
        kinds["pageable"] = Slot(index=-1, path="", x=pageable, ids=slots[0].ids, w=slots[0].w,
                                 out=torch.empty_like(pageable))
        kinds["slot"] = slots[0]
        dma = None
        if cuda:
            from service.worker.rank import pin_slot

            pin_slot(slots[1])
            kinds[PINNED_HERE] = slots[1]
            ctx = mp.get_context("spawn")
            here, there = ctx.Pipe()
            rank = ctx.Process(target=_rank, args=(cfg, slots[2].path, there), daemon=True)
            rank.start()
            if here.poll(60) and here.recv() == "pinned":
                kinds["slot pinned by a rank"] = slots[2]
            else:
                print("the stand-in rank did not pin its slot within 60 s: that column is left out")
            dev = torch.randn(cfg.C, cfg.H, device="cuda").to(cfg.dtype)

            def dma(out: torch.Tensor) -> None:
                out.copy_(dev[:out.shape[0]], non_blocking=True)
                torch.cuda.synchronize()

        for name, slot in kinds.items():
            if name != "pageable":
                slot.x.zero_(), slot.out.zero_()  # the pages mapped here (registered ones already are)
                print(f"{name}: its pages by node: {pages_where(slot.path)}")
        step = concurrent.futures.ThreadPoolExecutor(1)  # the batcher's copies run in a step thread
        for T in sizes:
            for n in (int(t) for t in args.threads.split(",")):
                split = batcher.RowSplit(n)
                cols = {k: step.submit(pieces, s, T, split, args.reps, dma if k == PINNED_HERE else None).result()
                        for k, s in kinds.items()}
                split.close()
                table(f"T={T} ({T * cfg.H * cfg.dtype.itemsize >> 20} MiB), {n} thread(s), us", cols)
        allowed = os.sched_getaffinity(0)
        usable = {node: sorted(set(cpus) & allowed) for node, cpus in nodes.items() if set(cpus) & allowed}
        if len(usable) > 1:  # (nodes without CPUs this process may use are left out)
            one, T, cols = batcher.RowSplit(1), sizes[0], {}
            for node, cpus in usable.items():
                def bound(node_cpus=cpus):
                    os.sched_setaffinity(0, node_cpus)  # this (step) thread only
                    try:
                        return {k: pieces(s, T, one, args.reps) for k, s in kinds.items()}
                    finally:
                        os.sched_setaffinity(0, allowed)
                for k, v in step.submit(bound).result().items():
                    cols[f"{k}, thread on node {node}"] = v
            table(f"T={T}, 1 thread, the step thread bound to one node's CPUs, us", cols)
            one.close()
        elif len(nodes) > 1:
            print(f"\nthis process may use the CPUs of node(s) {sorted(usable)} only: no per-node comparison")
        step.shutdown()
    finally:
        if rank is not None:
            here.send("go")
            rank.join(10)
        remove_slots(slots)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
