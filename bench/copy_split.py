"""A front end's big copies on this machine: the memcpy floor, and RowSplit's split against one thread.

    python bench/copy_split.py [--threads 2,4] [--sizes 512,2048] [--reps 60]

Floor: one 4 / 16 / 64 MiB copy (torch copy_, one torch thread, as a front end runs), a copy into a
freshly allocated bytes object (what a gRPC answer's copy out writes), and the sum that screens a
request's rows (codecs.rows_error). Split: the batcher's copy in with its check (`_copy_in`) and copy
out (`_copy_out`) of [T, 4096] bf16 rows, from a step-like thread, with copy_threads 1 and each of
--threads, interleaved; medians in us and their ratio to one thread's in the same run. Prints the
load average: on a shared machine it decides.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import statistics
import time
import warnings

import torch
from frontend_costs import median_us

from service.api.batcher import RowSplit, _copy_in, _copy_out
from service.api.grpc_codec import bytes_to_fill

H = 4096


def floors(reps: int) -> None:
    for mib in (4, 16, 64):
        src = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        us = median_us(lambda: dst.copy_(src), reps)  # noqa: B023  (called at once)
        print(f"| memcpy {mib} MiB | {us:,.0f} | {(mib << 20) / us / 1e3:.1f} GB/s |")
    src = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8)

    def fresh():
        data = bytes_to_fill(4 << 20)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytes are read-only to Python: see bytes_to_fill
            torch.frombuffer(data, dtype=torch.uint8).copy_(src)

    print(f"| 4 MiB into a fresh bytes object | {median_us(fresh, reps):,.0f} | |")
    x = torch.randn(512, H).bfloat16()
    print(f"| sum of [512, {H}] bf16 (the rows' check) | {median_us(x.sum, reps):,.0f} | |")


def split_times(splits: dict[int, RowSplit], T: int, reps: int) -> dict[int, tuple[list[float], list[float]]]:
    """Seconds of the copy in (with its check) and the copy out of [T, H] bf16 rows, per copy threads."""
    src = torch.randn(T, H).bfloat16()
    slot, out = torch.empty_like(src), torch.empty_like(src)
    got: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in splits}
    for _ in range(reps):
        for n, sp in splits.items():
            t0 = time.perf_counter()
            sp.run(functools.partial(_copy_in, slot, src, 0), T, T * H * 2)
            t1 = time.perf_counter()
            sp.run(functools.partial(_copy_out, out, slot), T, T * H * 2)
            got[n][0].append(t1 - t0)
            got[n][1].append(time.perf_counter() - t1)
            time.sleep(0.002)  # as between steps
    return got


def split(sizes: list[int], threads: list[int], reps: int) -> None:
    splits = {n: RowSplit(n) for n in [1, *threads]}
    step_thread = concurrent.futures.ThreadPoolExecutor(1)  # the batcher's copies run in a step thread
    for T in sizes:
        medians = {n: [statistics.median(t) * 1e6 for t in times]
                   for n, times in step_thread.submit(split_times, splits, T, reps).result().items()}
        for n, (us_in, us_out) in medians.items():
            base_in, base_out = medians[1]
            print(f"| T={T}, copy threads {n} | {us_in:,.0f} | {us_in / base_in:.2f} | "
                  f"{us_out:,.0f} | {us_out / base_out:.2f} |")
    step_thread.shutdown()
    for sp in splits.values():
        sp.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="2,4")
    p.add_argument("--sizes", default="512,2048")
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args()
    torch.set_num_threads(1)  # as every front end (service.fleet.set_frontend_threads)
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n\n| copy | us | rate |\n|---|---|---|")
    floors(args.reps)
    print("\n| split | copy in + check us | / 1 thread | copy out us | / 1 thread |\n|---|---|---|---|---|")
    split([int(s) for s in args.sizes.split(",")], [int(t) for t in args.threads.split(",")], args.reps)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
