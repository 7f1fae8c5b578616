"""The direct rows' device check before and after: the torch calls against the one Triton launch
(service.kernels.finite_rows), both as service.worker.rank._check_cuda runs them (the flags' copy to
pinned host memory included), on the same inputs, in the same run, interleaved step by step.

    python bench/check_launch.py [--rows 512] [--hidden 4096] [--dtype bf16] [--bad 3] [--iters 300]

Per call, median and p90 over --iters:
  host us      perf_counter around the call, the device idle before it (the c=1 case: the layer is
               launched after it, so this is on the step's critical path);
  idle us      CUDA events around the call with the device idle before it: from the first launch
               reaching the GPU to the flags' copy done, the host's launch gaps included;
  device us    the same with the GPU held busy (torch.cuda._sleep) until every launch is queued:
               the device's own time.
x is restored from the same pristine rows (--bad of them not finite) before every call, outside the
timing. Prints a table and the kernel's ratios to the torch calls. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WARMUP = 20  # calls of each variant before timing: the kernel's compile, the allocator, the caches
BUSY_CYCLES = 2_000_000  # ~1 ms of GPU spinning: longer than the host takes to queue either variant
PAUSE_S = 0.0005  # between calls, as between a c=1 rank's steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--bad", type=int, default=3, help="rows with a NaN or inf")
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from service.kernels.finite_rows import bytes_moved, zero_bad_rows
    from service.worker import rank

    r, H, dtype, dev = args.rows, args.hidden, DTYPES[args.dtype], torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(0)
    pristine = torch.randn(r, H, generator=gen).to(dtype)
    bad_rows = torch.randperm(r, generator=gen)[:args.bad]
    for n, i in enumerate(bad_rows.tolist()):
        pristine[i, (n * 997) % H] = (float("nan"), float("inf"), -float("inf"))[n % 3]
    pristine = pristine.to(dev)
    want = ~torch.isfinite(pristine.float()).all(dim=1)
    x = torch.empty_like(pristine)
    flags = (torch.empty(r, dtype=torch.bool, device=dev), torch.empty(r, dtype=torch.bool, pin_memory=True))
    plan = types.SimpleNamespace(span=(0, r))  # _check_cuda reads the plan's span alone
    use_kernel = rank._row_check
    assert use_kernel() is not None, "triton is not importable: nothing to compare"

    def torch_calls() -> None:
        rank._row_check = lambda: None  # _check_cuda's path without Triton
        try:
            rank._check_cuda(x, plan, flags)
        finally:
            rank._row_check = use_kernel

    variants = {
        "torch calls (before)": torch_calls,
        "one launch + flags copy (after)": lambda: rank._check_cuda(x, plan, flags),
        "  of which the launch": lambda: zero_bad_rows(x, flags[0]),
        "  of which the flags copy": lambda: flags[1].copy_(flags[0], non_blocking=True),
    }
    times: dict[str, dict[str, list[float]]] = {name: {"host": [], "idle": [], "device": []} for name in variants}
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(WARMUP + args.iters):
        for name, fn in variants.items():
            for mode in ("idle", "device"):
                x.copy_(pristine)
                flags[1].fill_(False)
                torch.cuda.synchronize()
                time.sleep(PAUSE_S)
                if mode == "device":
                    torch.cuda._sleep(BUSY_CYCLES)
                e0.record()
                t0 = time.perf_counter()
                fn()
                host_us = (time.perf_counter() - t0) * 1e6
                e1.record()
                e1.synchronize()
                if i >= WARMUP:
                    times[name][mode].append(e0.elapsed_time(e1) * 1e3)
                    if mode == "idle":
                        times[name]["host"].append(host_us)
                if name != "  of which the flags copy" and mode == "idle" and i == WARMUP:  # the result, once
                    if name != "  of which the launch":
                        assert torch.equal(flags[1], want.cpu()), f"{name}: wrong flags"
                    assert torch.equal(x[~want], pristine[~want]) and (x[want] == 0).all(), f"{name}: wrong rows"

    def med(v: list[float]) -> float:
        return statistics.median(v)

    def p90(v: list[float]) -> float:
        return statistics.quantiles(v, n=10)[8] if len(v) > 1 else v[0]

    mb = bytes_moved(r, H, dtype.itemsize, args.bad) / 1e6
    print(f"# {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; x [{r}, {H}] {args.dtype}, "
          f"{args.bad} bad rows, {mb:.1f} MB moved by the kernel; {args.iters} calls each, interleaved")
    print("| variant | host us (median / p90) | idle us (median / p90) | device us (median) |\n|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name.strip()} | {med(t['host']):.1f} / {p90(t['host']):.1f} | "
              f"{med(t['idle']):.1f} / {p90(t['idle']):.1f} | {med(t['device']):.1f} |")
    before, after = times["torch calls (before)"], times["one launch + flags copy (after)"]
    print(f"after / before: host {med(after['host']) / med(before['host']):.2f}, "
          f"idle {med(after['idle']) / med(before['idle']):.2f}, "
          f"device {med(after['device']) / med(before['device']):.2f}; "
          f"host saved per call {med(before['host']) - med(after['host']):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
