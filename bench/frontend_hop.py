"""The extra hop of a step from front end i >= 1 (service.fleet): one round trip through the owner.

    python bench/frontend_hop.py [--steps 2000] [--busy 0,1]

A spawned process plays front end 1 and calls `RemoteGroup.run` on its slot; a thread of this
process serves it with `Fleet._serve_slot` (the owner's code) on a stand-in group whose run()
returns at once, so the figure is the hop alone: pipe, pickling of the StepStats, the owner
thread's wake-up. `--busy 1` also keeps one thread of the owner running Python (as the owner's
event loop does under load), which makes the owner thread wait for the GIL. The baseline is the
same stand-in's run() called in-process (what front end 0 pays).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time

from service.config import Settings, preset
from service.fleet import Fleet, _Member
from service.replica import RemoteGroup
from service.worker.group import StepStats


class InstantGroup:
    """A rank group whose steps take no time (the stages of a fused step, to pickle realistic stats)."""

    backend = "fused"
    alive = True

    def __init__(self, slots: int):
        self.slots = list(range(slots))
        self.seq = 0

    def run(self, slot, T: int, sources=()) -> StepStats:
        self.seq += 1
        return StepStats(seq=self.seq, tokens=T, backend=self.backend, layer_s=1e-3,
                         stages={"copy_in": 1e-5, "fused": 1e-3}, exposed_comm_s=0.0)


class _Slot:
    index = 0


def _frontend(conn, steps: int, out) -> None:
    group = RemoteGroup(1, "fused", [_Slot()], [conn], [0], timeout_s=30.0)
    for _ in range(50):
        group.run(_Slot, 512)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        group.run(_Slot, 512)
        times.append(time.perf_counter() - t0)
    out.send(times)


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def hop(steps: int, busy: bool) -> list[float]:
    cfg = preset("cpu")
    fleet = Fleet(Settings(), cfg, 2, lambda: None, lambda group, exc: None)
    fleet._group, fleet._gen = InstantGroup(2 * fleet.slots), 1
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    result_here, result_there = ctx.Pipe()
    member = _Member(1, None, None, [here])
    threading.Thread(target=fleet._serve_slot, args=(member, 0, here), daemon=True).start()
    stop = threading.Event()
    if busy:
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    proc = ctx.Process(target=_frontend, args=(there, steps, result_there))
    proc.start()
    times = result_here.recv()
    stop.set()
    proc.join()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--busy", default="0,1", help="owner busy running Python: 0, 1 or both")
    p.add_argument("--switch-ms", type=float, help="the owner's sys.setswitchinterval, ms (default Python's)")
    args = p.parse_args()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    group = InstantGroup(1)
    local = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        group.run(None, 512)
        local.append(time.perf_counter() - t0)
    base = statistics.median(local)
    print(f"switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print("| path | p50 us | p90 us | p99 us | extra over in-process (p50) |")
    print("|---|---|---|---|---|")
    print(f"| in-process run() (front end 0) | {base * 1e6:.1f} | - | - | - |")
    for busy in (int(b) for b in args.busy.split(",")):
        t = sorted(hop(args.steps, bool(busy)))
        q = statistics.quantiles(t, n=100)
        print(f"| front end 1 via the owner{' (owner busy)' if busy else ''} | {q[49] * 1e6:.1f} | "
              f"{q[89] * 1e6:.1f} | {q[98] * 1e6:.1f} | {(q[49] - base) * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
