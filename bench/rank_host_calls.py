"""What each host call of a CUDA rank's step costs on the host (the step phases copy_in, launch and
checks: 0.31 + 0.24 + 0.17 ms at T=512 on one H200, bench/RESULTS.md, eighth session, call 1).

    python bench/rank_host_calls.py [--tokens 512] [--iters 300]

The calls the rank makes with copy streams on (service.worker.rank._steps), one at a time on a real
slot (service.worker.shm, registered with CUDA as the rank does: rank.pin_slot), each timed on the
host (perf_counter around the Python call, the device idle before each step: the c=1 case), median
and p90 us over --iters steps. Beside them, the same H2D copy from pageable memory and from torch's
own pinned memory (an H2D copy whose host time is ~the DMA's would say the driver does not treat the
source as pinned), and a pipe round trip between two processes (the to_rank / to_owner hops).
Needs CUDA; prints a table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch


def _echo(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


def pipe_round_trip_us(iters: int) -> list[float]:
    """A ("step", seq, slot, T)-sized message to another process and back, as the group's pipes carry it."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(b,), daemon=True)
    p.start()
    out = []
    for i in range(iters + 20):
        t0 = time.perf_counter()
        a.send(("step", i, 0, 512))
        a.recv()
        if i >= 20:
            out.append((time.perf_counter() - t0) * 1e6)
        time.sleep(0.001)  # the receiver sleeps in recv between steps, as an idle rank does
    a.send(None)
    p.join(5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from service.config import preset
    from service.worker.rank import pin_slot
    from service.worker.shm import create_slots, remove_slots

    cfg = preset("seed", R=1)
    n, dev = args.tokens, torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    slots = create_slots(cfg, 1)
    slot = slots[0]
    pin_slot(slot)
    inputs = (torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, device=dev),
              torch.empty(cfg.C, cfg.K, dtype=torch.int32, device=dev),
              torch.empty(cfg.C, cfg.K, dtype=torch.float32, device=dev))
    staged = tuple(torch.empty_like(b) for b in inputs)
    out_dev = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, device=dev)
    result = torch.empty(cfg.C, cfg.H, dtype=torch.float32, device=dev)
    s_in, s_out = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    layer_done, done = torch.cuda.Event(), torch.cuda.Event()
    pageable = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype)
    pinned = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, pin_memory=True)
    # a stand-in for the layer's graph: one small kernel captured
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        result[:n].mul_(1.0)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize()

    calls = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        r = fn()
        calls.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
        return r

    cur = torch.cuda.current_stream(dev)
    for i in range(args.iters + 20):
        torch.cuda.synchronize()
        time.sleep(0.0005)
        if i == 20:
            calls.clear()
        t_step = time.perf_counter()
        with torch.cuda.stream(s_in):
            timed("in-stream: event record", ev[0].record)
            timed("H2D x [n, H] from the registered slot", lambda: staged[0][:n].copy_(slot.x[:n], non_blocking=True))
            timed("H2D ids [n, K]", lambda: staged[1][:n].copy_(slot.ids[:n], non_blocking=True))
            timed("H2D w [n, K]", lambda: staged[2][:n].copy_(slot.w[:n], non_blocking=True))
            timed("in-stream: event record ", ev[1].record)
        timed("layer stream: wait_event", lambda: cur.wait_event(ev[1]))
        for j, name in enumerate(("x", "ids", "w")):
            timed(f"D2D staged -> inputs ({name})", lambda j=j: inputs[j][:n].copy_(staged[j][:n]))
        timed("graph replay (one kernel)", g.replay)
        timed("cast into out_dev", lambda: out_dev[:n].copy_(result[:n]))
        timed("layer_done record", layer_done.record)
        timed("out-stream: wait_event", lambda: s_out.wait_event(layer_done))
        with torch.cuda.stream(s_out):
            timed("D2H answer into the registered slot", lambda: slot.out[:n].copy_(out_dev[:n], non_blocking=True))
            timed("done record", done.record)
        calls.setdefault("= enqueue, all of the above", []).append((time.perf_counter() - t_step) * 1e6)
        timed("layer_done.synchronize", layer_done.synchronize)
        timed("done.synchronize", done.synchronize)
        timed("elapsed_time", lambda: ev[0].elapsed_time(ev[1]))
        torch.cuda.synchronize()
        timed("H2D x from pageable memory (non_blocking)", lambda: staged[0][:n].copy_(pageable[:n], non_blocking=True))
        torch.cuda.synchronize()
        timed("H2D x from torch pinned memory (non_blocking)",
              lambda: staged[0][:n].copy_(pinned[:n], non_blocking=True))
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        staged[0][:n].copy_(slot.x[:n], non_blocking=True)
        e1.record()
        e1.synchronize()
        calls.setdefault("device: H2D x from the slot (us on the GPU)", []).append(e0.elapsed_time(e1) * 1e3)
    calls["pipe round trip, another process (sleeping in recv)"] = pipe_round_trip_us(min(args.iters, 200))
    remove_slots(slots)
    nbytes = n * cfg.H * cfg.dtype.itemsize
    print(f"# {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; T={n}, x {nbytes / 2**20:.1f} MiB; "
          f"{args.iters} steps, device idle before each")
    print("| call | median us | p90 us |\n|---|---|---|")
    for name, v in calls.items():
        q = statistics.quantiles(v, n=10) if len(v) > 1 else v * 9
        print(f"| {name.strip()} | {statistics.median(v):.1f} | {q[8]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
