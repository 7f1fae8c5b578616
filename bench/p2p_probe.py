"""Peer copy bandwidth between every ordered pair of GPUs (issue 7, step 1).

    python bench/p2p_probe.py [--mb 256] [--reps 5] [--json PATH] [--dry-run]

For each ordered pair (src, dst), src != dst: whether torch reports peer access
(`torch.cuda.can_device_access_peer(dst, src)`: dst can read src, and src can write dst), then
`dst_buf.copy_(src_buf)` of --mb MiB timed with CUDA events on the source device's current stream
(PyTorch runs a cross-device copy on the source device's stream and orders it against both
devices' streams), two warm-ups, median of --reps. GB/s = bytes / time, 1e9 bytes, one direction.
A pair without peer access still copies (staged through host memory), and the figure shows it.

The fused backend needs peer access between every pair (service.moe.fused.fused_unavailable_reason);
on an NVLink host each pair should show a few hundred GB/s, on PCIe tens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

WARMUP = 2


def probe(mb: int, reps: int) -> dict:
    import torch

    n = torch.cuda.device_count()
    nbytes = mb << 20
    names = [torch.cuda.get_device_name(d) for d in range(n)]
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in range(n)]  # [nbytes] per GPU
    dsts = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in range(n)]  # [nbytes] per GPU
    for b in bufs:
        b.random_(0, 256)
    peer = [[src == dst or torch.cuda.can_device_access_peer(dst, src) for dst in range(n)] for src in range(n)]
    gbps: list[list[float | None]] = [[None] * n for _ in range(n)]
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            times = []
            with torch.cuda.device(src):
                for i in range(WARMUP + reps):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    dsts[dst].copy_(bufs[src])
                    end.record()
                    end.synchronize()
                    torch.cuda.synchronize(dst)
                    if i >= WARMUP:
                        times.append(start.elapsed_time(end) / 1e3)
            if not torch.equal(dsts[dst][:4096].cpu(), bufs[src][:4096].cpu()):
                raise RuntimeError(f"copy GPU {src} -> GPU {dst} delivered wrong bytes")
            gbps[src][dst] = nbytes / statistics.median(times) / 1e9
    return {"devices": names, "mb": mb, "reps": reps, "peer": peer, "gbps": gbps}


def table(res: dict) -> str:
    n = len(res["devices"])
    lines = ["| src \\ dst | " + " | ".join(f"GPU {d}" for d in range(n)) + " |",
             "|---" * (n + 1) + "|"]
    for src in range(n):
        cells = []
        for dst in range(n):
            g = res["gbps"][src][dst]
            cells.append("-" if g is None else f"{g:.0f}" + ("" if res["peer"][src][dst] else " (no P2P)"))
        lines.append(f"| GPU {src} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256, help="MiB per copy")
    p.add_argument("--reps", type=int, default=5, help="timed copies per pair (median)")
    p.add_argument("--json", help="write the matrix here")
    p.add_argument("--dry-run", action="store_true", help="print the plan, touch no GPU")
    args = p.parse_args()
    if args.dry_run:
        print(f"plan: every ordered GPU pair, {args.mb} MiB copy, {WARMUP} warm-ups + median of {args.reps}")
        return 0
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"p2p probe: {n} CUDA device(s); needs 2 or more", file=sys.stderr)
        return 1
    res = probe(args.mb, args.reps)
    print(f"devices: {', '.join(f'{i}: {name}' for i, name in enumerate(res['devices']))}")
    print(f"peer copy GB/s (1e9 B/s, one direction, {args.mb} MiB, median of {args.reps}):")
    print(table(res))
    off = [g for row in res["gbps"] for g in row if g is not None]
    no_peer = [(s, d) for s in range(n) for d in range(n) if not res["peer"][s][d]]
    print(f"min {min(off):.0f} / median {statistics.median(off):.0f} / max {max(off):.0f} GB/s; "
          f"pairs without peer access: {no_peer or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if no_peer else 0


if __name__ == "__main__":
    sys.exit(main())
