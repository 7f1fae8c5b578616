"""Per-stage time of the CPU rank group's step (rank 0's view), the group started as the server does.

    python bench/cpu_stages.py [--sizes 8,512] [--steps 60] [--preset cpu]

A WorkerGroup of the preset (cpu: E=16 H=256 I=512 K=4, R=4 CPU ranks, C=128, fp32), synthetic
weights; per step size T: --steps steps on one slot of fresh balanced routing (the first 10 not
counted), printed as the median wall time of a step (the parent's send to the last answer),
the layer's stage sum on rank 0, its exposed communication, and each stage's median in ms.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from service.config import preset  # noqa: E402
from service.worker.group import WorkerGroup  # noqa: E402

WARMUP = 10


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,512")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--preset", default="cpu")
    args = p.parse_args()
    cfg = preset(args.preset)
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cfg.describe()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    rows = []
    with WorkerGroup(cfg, seed=0) as g:
        for T in (int(t) for t in args.sizes.split(",")):
            gen = torch.Generator().manual_seed(T)
            slot = g.acquire_slot()
            stats = []
            for _ in range(args.steps + WARMUP):
                slot.x[:T].copy_(torch.randn(T, cfg.H, generator=gen))
                slot.ids[:T].copy_(torch.argsort(torch.rand(T, cfg.E, generator=gen), dim=1)[:, :cfg.K])
                slot.w[:T].copy_(torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1))
                stats.append(g.run(slot, T))
            g.release(slot)
            stats = stats[WARMUP:]
            stages = {k: statistics.median(s.stages.get(k, 0.0) for s in stats) for k in stats[0].stages}
            rows.append((T, statistics.median(s.wall_s for s in stats), statistics.median(s.layer_s for s in stats),
                         statistics.median(s.exposed_comm_s for s in stats), stages))
    names = list(rows[0][4])
    print("| T | step wall ms | layer ms | exposed comm ms | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for T, wall, layer, comm, stages in rows:
        print(f"| {T} | {wall * 1e3:.2f} | {layer * 1e3:.2f} | {comm * 1e3:.2f} | "
              + " | ".join(f"{stages.get(n, 0.0) * 1e3:.2f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
