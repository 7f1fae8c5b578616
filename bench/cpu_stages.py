"""Per-stage time of the CPU rank group's step (rank 0's view), the group started as the server does.

    python bench/cpu_stages.py [--sizes 8,512] [--steps 60] [--preset cpu] [--share]
        [--device cuda --backend auto]     # the same on a GPU (bench/gpu_serve.sh GROUP=1)
        [--callers N --lookahead 1|2 [--copy-streams]]  # N threads' steps in flight (bench/gpu_lookahead.sh)

A WorkerGroup of the preset (cpu: E=16 H=256 I=512 K=4, R=4 CPU ranks, C=128, fp32), synthetic
weights; per step size T: --steps steps on one slot of fresh balanced routing (the first 10 not
counted), printed as the median wall time of a step (the parent's send to the last answer),
the layer's stage sum on rank 0, its exposed communication, and each stage's median in ms; then
the medians of the step's phases (StepStats.phases: where the wall goes between the processes).

`--callers N`: N threads, each on its own slot, run steps back to back (their rows written once:
what is timed is the group), so up to N step messages wait for the ranks, as under a served load;
the table then has the steps per second of the whole (counted steps / their span) beside the
medians, and the share of steps rank 0 enqueued behind another (StepStats.behind: the lookahead
at work). `--lookahead`: the ranks' steps in flight (WorkerGroup(lookahead=...), CUDA only).

`--share`: one rank's share of the same step in this process, no group and no communication
(SerialLayer at R=1 with C = R*C and I = I/R, one torch thread, as a rank runs): the step's own
CPU work; "step wall" is then the forward call's time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from service.config import preset  # noqa: E402
from service.metrics import STEP_PHASES  # noqa: E402
from service.worker.group import WorkerGroup  # noqa: E402

WARMUP = 10


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,512")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--preset", default="cpu")
    p.add_argument("--share", action="store_true", help="one rank's share in this process (no group)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the group's device (not with --share)")
    p.add_argument("--backend", default="serial", choices=("auto", "serial", "fused"), help="the group's backend")
    p.add_argument("--callers", type=int, default=0, help="threads with a step each in flight (0: the one-slot loop)")
    p.add_argument("--lookahead", type=int, default=2, choices=(1, 2), help="the ranks' steps in flight (CUDA)")
    p.add_argument("--copy-streams", action="store_true", help="the ranks' copies on copy streams (CUDA)")
    args = p.parse_args()
    cfg = preset(args.preset)
    if args.device == "cuda":  # one rank per GPU, as the server caps it
        cfg = cfg.replace(R=min(cfg.R, torch.cuda.device_count()))
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cfg.describe()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"
          + (f", {args.callers} callers, lookahead {args.lookahead}, copy streams {args.copy_streams}"
             if args.callers else ""))
    if args.callers:
        return concurrent(cfg, args)
    phases: list[tuple] = []
    rows = share(cfg, [int(t) for t in args.sizes.split(",")], args.steps) if args.share else group(cfg, args, phases)
    names = list(rows[0][4])
    print("| T | step wall ms | layer ms | exposed comm ms | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for T, wall, layer, comm, stages in rows:
        print(f"| {T} | {wall * 1e3:.2f} | {layer * 1e3:.2f} | {comm * 1e3:.2f} | "
              + " | ".join(f"{stages.get(n, 0.0) * 1e3:.2f}" for n in names) + " |")
    if phases:
        print("\nA step's phases (StepStats.phases, service.metrics.STEP_PHASES), medians, ms:\n")
        print("| T | step wall | " + " | ".join(STEP_PHASES) + " |")
        print("|---|---|" + "---|" * len(STEP_PHASES))
        for T, wall, med in phases:
            print(f"| {T} | {wall * 1e3:.2f} | " + " | ".join(f"{med[p] * 1e3:.3f}" for p in STEP_PHASES) + " |")
    return 0


def batch(cfg, T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh rows: x [T, H], ids [T, K] int32 (K distinct experts), w [T, K] (softmax)."""
    return (torch.randn(T, cfg.H, generator=gen),
            torch.argsort(torch.rand(T, cfg.E, generator=gen), dim=1)[:, :cfg.K].to(torch.int32),
            torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1))


def summary(T: int, walls: list[float], stats: list[dict], comm: list[float]) -> tuple:
    stages = {k: statistics.median(s.get(k, 0.0) for s in stats) for k in stats[0]}
    layer = statistics.median(sum(s.values()) for s in stats)
    return T, statistics.median(walls), layer, statistics.median(comm), stages


def share(cfg, sizes: list[int], steps: int) -> list[tuple]:
    from service.moe.serial import SerialLayer
    from service.moe.timing import StageTimer
    from service.moe.weights import synthetic_rank_weights

    torch.set_num_threads(1)
    one = cfg.replace(R=1, C=cfg.tokens_per_step, I=cfg.Ir)
    layer = SerialLayer(one, synthetic_rank_weights(one, 0, 0), rank=0, device=torch.device("cpu"))
    rows, seq = [], 0
    for T in sizes:
        gen = torch.Generator().manual_seed(T)
        walls, stats = [], []
        for i in range(steps * 5 + WARMUP):  # cheap steps: more of them
            x, ids, w = batch(one, T, gen)
            timer = StageTimer(torch.device("cpu"))
            seq += 1
            t0 = time.perf_counter()
            layer.forward(x, ids, w, seq, timer)
            if i >= WARMUP:
                walls.append(time.perf_counter() - t0)
                stats.append(timer.seconds())
        rows.append(summary(T, walls, stats, [0.0]))
    return rows


def group(cfg, args, phases: list[tuple]) -> list[tuple]:
    """The stage rows; `phases` gets (T, median wall, {phase: median}) per size."""
    rows = []
    with WorkerGroup(cfg, seed=0, device=args.device, backend=args.backend) as g:
        for T in (int(t) for t in args.sizes.split(",")):
            gen = torch.Generator().manual_seed(T)
            slot = g.acquire_slot()
            stats = []
            for _ in range(args.steps + WARMUP):
                for buf, t in zip((slot.x, slot.ids, slot.w), batch(cfg, T, gen), strict=True):
                    buf[:T].copy_(t)
                stats.append(g.run(slot, T))
            g.release(slot)
            stats = stats[WARMUP:]
            rows.append(summary(T, [s.wall_s for s in stats], [s.stages for s in stats],
                                [s.exposed_comm_s for s in stats]))
            phases.append((T, statistics.median(s.wall_s for s in stats),
                           {p: statistics.median(s.phases[p] for s in stats) for p in STEP_PHASES}))
    return rows


def concurrent(cfg, args) -> int:
    """--callers: the group under several callers at once; one table row per size."""
    print("| T | lookahead | copy streams | steps/s | tokens/s | step wall ms | behind % | overlapped % | "
          + " | ".join(STEP_PHASES) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(STEP_PHASES))
    with WorkerGroup(cfg, seed=0, device=args.device, backend=args.backend, slots=args.callers,
                     lookahead=args.lookahead, copy_streams=args.copy_streams) as g:
        for T in (int(t) for t in args.sizes.split(",")):
            stats, span = load(g, cfg, T, args.callers, args.steps)
            rate = len(stats) / span
            med = {p: statistics.median(s.phases[p] for s in stats) for p in STEP_PHASES}
            print(f"| {T} | {g.lookahead} | {g.copy_streams} | {rate:.0f} | {rate * T:.0f} | "
                  f"{statistics.median(s.wall_s for s in stats) * 1e3:.2f} | "
                  f"{100 * sum(s.behind for s in stats) / len(stats):.0f} | "
                  f"{100 * sum(s.overlapped for s in stats) / len(stats):.0f} | "
                  + " | ".join(f"{med[p] * 1e3:.3f}" for p in STEP_PHASES) + " |")
    return 0


def load(g: WorkerGroup, cfg, T: int, callers: int, steps: int) -> tuple[list, float]:
    """`callers` threads, each on its own slot (rows written once), WARMUP steps each, then `steps`
    each from a common start -> (the counted steps' StepStats, their span in seconds)."""
    import threading

    stats: list = []
    marks: list[float] = []
    ready = threading.Barrier(callers, action=lambda: marks.append(time.perf_counter()))

    def caller(c: int) -> None:
        slot = g.acquire_slot(timeout=60)
        for buf, t in zip((slot.x, slot.ids, slot.w), batch(cfg, T, torch.Generator().manual_seed(c)), strict=True):
            buf[:T].copy_(t)
        for _ in range(WARMUP):
            g.run(slot, T)
        ready.wait()  # every caller warm: the counted span starts
        stats.extend([g.run(slot, T) for _ in range(steps)])
        g.release(slot)

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats, time.perf_counter() - marks[0]  # the last caller's end (joined) minus the common start


if __name__ == "__main__":
    sys.exit(main())
