"""What a rank's step costs on the host at one client, now and with fewer CUDA calls (GPU only).

    python bench/step_enqueue_probe.py [--tokens 512,8] [--iters 300]

The step phases at c=1 (bench/RESULTS.md, sixteenth session: copy_in 0.29, launch 0.15, checks 0.09 ms
around a device 1.67 ms at T=512 on an H100) are ~17 CUDA calls at 10-50 us each on these guests
(bench/rank_host_calls.py). Three ways of running the same step on one real slot (service.worker.shm,
registered as the rank does) and the fused layer (seed preset, R=1), one step at a time with the
device idle before each (the c=1 case):

  now     the rank's own loop (service.worker.rank._steps, in a thread, fed through a pipe): the
          stamps it reports, message read -> answer in the slot (`copied_out`) and -> stats ready.
  graph   the rows' DMA eager (exact rows, as now), then ONE replay of a graph per lane holding the
          control words' copy (from the lane's pinned words), the layer's step, the snapshot into
          the lane's pinned words and the cast; the answer's DMA and the done event eager.
  all     (R=1, a fixed step size) the rows' DMA and the answer's DMA captured too: one replay
          and one event per step; the floor of what fewer calls could give.

Each prints the host time from the step's start to the answer in the slot and to its stats (p50/p90
us), and checks that every variant's answer equals `now`'s bit for bit. ("start -> layer launched"
does not compare across variants: `now` stamps it before the layer's forward, the others after the
replay.) First run: bench/RESULTS.md, seventeenth session (H100).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import statistics
import sys
import threading
import time

import torch


def q(v: list[float]) -> tuple[float, float]:
    return statistics.median(v), statistics.quantiles(v, n=10)[8]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,8")
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from service.config import preset
    from service.moe import routing
    from service.moe.fused import _seq32
    from service.moe.layer import StepState, make_layer
    from service.moe.timing import StageTimer
    from service.moe.weights import synthetic_rank_weights
    from service.worker import rank as rk
    from service.worker.direct import Objects
    from service.worker.shm import create_slots, remove_slots

    cfg = preset("seed", R=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    layer = make_layer(cfg, synthetic_rank_weights(cfg, 0, 0, device=dev), rank=0, device=dev, backend="fused")
    slots = create_slots(cfg, 2)
    for s in slots:
        rk.pin_slot(s)
    opts = rk.RankOptions(cfg=cfg, device="cuda", store_host="", store_port=0, slot_paths=(), lookahead=2)
    bufs = layer.bufs
    log = logging.getLogger("probe")
    rows: dict[str, dict[int, list[float]]] = {}

    def note(name: str, T: int, key: str, v: float) -> None:
        rows.setdefault(f"{name}|{key}", {}).setdefault(T, []).append(v)

    sizes = [int(t) for t in args.tokens.split(",")]
    answers: dict[tuple[str, int], torch.Tensor] = {}
    with torch.inference_mode():
        for s in slots:
            gen = torch.Generator().manual_seed(7)
            s.x.copy_(torch.randn(s.x.shape, generator=gen).to(cfg.dtype))
            s.ids.copy_(torch.argsort(torch.rand(s.ids.shape[0], cfg.E, generator=gen), dim=1)[:, :cfg.K].int())
            s.w.copy_(torch.softmax(torch.randn(s.w.shape, generator=gen), dim=1))

        # -- now: the rank's loop ------------------------------------------------------------------
        a, b = mp.Pipe()
        t = threading.Thread(target=rk._steps, args=(0, cfg, opts, b, log, layer, slots, layer.inputs,
                                                     Objects(cuda=True)), daemon=True)
        t.start()
        # One ping first: the loop makes its lanes (the fused layer captures each lane's step graph)
        # before it reads a message, and a device-wide synchronize in this thread during a capture
        # in that one is refused (cudaErrorStreamCaptureUnsupported).
        a.send(("ping", 0))
        assert a.recv()[0] == "pong"
        seq = 0
        for T in sizes:
            for i in range(args.iters + 20):
                seq += 1
                slot = slots[seq % 2]
                slot.out.fill_(float("nan"))
                torch.cuda.synchronize()
                time.sleep(0.001)
                t0 = time.monotonic()
                a.send(("step", seq, slot.index, T))
                msg = a.recv()
                t1 = time.monotonic()
                assert msg[0] == "done", msg
                st = msg[3]["stamps"]  # received, issued, enqueued, device_done, copied_out, ready
                if i >= 20:
                    note("now", T, "start -> answer in slot", (st[4] - st[0]) * 1e6)
                    note("now", T, "start -> layer launched", (st[1] - st[0]) * 1e6)
                    note("now", T, "start -> stats ready", (st[5] - st[0]) * 1e6)
                    note("now", T, "pipe round trip (send -> recv)", (t1 - t0) * 1e6)
            answers[("now", T)] = slot.out[:T].clone()
        a.send(("stop",))
        t.join(10)

        # -- graph: the eager rows' DMA, one replay per lane, the eager answer's DMA ---------------
        class Lane:
            def __init__(self, copies: tuple | None = None):
                self.ctl = torch.zeros(bufs.ctl.shape, dtype=bufs.ctl.dtype, pin_memory=True)
                self.ctl_np = self.ctl.numpy()
                self.state = StepState(StageTimer(dev), torch.zeros(bufs.state.shape, dtype=bufs.state.dtype,
                                                                    pin_memory=True))
                self.out_dev = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, device=dev)
                self.e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                self.layer_done, self.done = torch.cuda.Event(), torch.cuda.Event()
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                self.g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(side), torch.cuda.graph(self.g, stream=side):
                    if copies is not None:  # all: the rows' DMA (fixed n) inside the graph
                        slot, n = copies
                        for buf, src in zip(layer.inputs, (slot.x, slot.ids, slot.w), strict=True):
                            buf[:n].copy_(src[:n], non_blocking=True)
                    bufs.ctl.copy_(self.ctl, non_blocking=True)
                    layer._device_step(None)
                    self.state.words.copy_(bufs.state, non_blocking=True)
                    self.out_dev.copy_(bufs.out)
                    if copies is not None:
                        slot.out[:n].copy_(self.out_dev[:n], non_blocking=True)
                torch.cuda.current_stream(dev).wait_stream(side)
                torch.cuda.synchronize()

        def run(name: str, lanes_for, T: int, fixed_slot: int | None) -> None:
            nonlocal seq
            for i in range(args.iters + 20):
                seq += 1
                slot = slots[fixed_slot if fixed_slot is not None else seq % 2]
                lane = lanes_for(seq)
                slot.out.fill_(float("nan"))
                torch.cuda.synchronize()
                time.sleep(0.001)
                t0 = time.monotonic()
                n = T
                if fixed_slot is None:
                    lane.e[0].record()
                    for buf, src in zip(layer.inputs, (slot.x, slot.ids, slot.w), strict=True):
                        buf[:n].copy_(src[:n], non_blocking=True)
                    lane.e[1].record()
                layer.step += 1
                lane.ctl_np[:] = (_seq32(layer.step), n, *routing.seq_words(seq))
                lane.g.replay()
                t_launch = time.monotonic()
                if fixed_slot is None:
                    lane.layer_done.record()
                    slot.out[:n].copy_(lane.out_dev[:n], non_blocking=True)
                lane.done.record()
                lane.layer_done.synchronize()
                lane.done.synchronize()
                t_out = time.monotonic()
                layer.check_seq(seq, lane.state)
                if fixed_slot is None:
                    lane.e[0].elapsed_time(lane.e[1])
                t_ready = time.monotonic()
                if i >= 20:
                    note(name, T, "start -> answer in slot", (t_out - t0) * 1e6)
                    note(name, T, "start -> layer launched", (t_launch - t0) * 1e6)
                    note(name, T, "start -> stats ready", (t_ready - t0) * 1e6)
            answers[(name, T)] = slot.out[:T].clone()

        lanes = [Lane(), Lane()]
        for T in sizes:
            run("graph", lambda s: lanes[s % 2], T, None)
        for T in sizes:
            fixed = [Lane((slots[0], T)), Lane((slots[0], T))]
            run("all", lambda s, fixed=fixed: fixed[s % 2], T, 0)
            del fixed

    remove_slots(slots)
    print(f"# {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; {args.iters} steps per cell, "
          "device idle before each; us")
    print("| variant | what | " + " | ".join(f"T={T} p50 / p90" for T in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for key, per_t in rows.items():
        name, what = key.split("|")
        cells = " | ".join("{:.0f} / {:.0f}".format(*q(per_t[T])) if T in per_t else "" for T in sizes)
        print(f"| {name} | {what} | {cells} |")
    ok = True
    for (name, T), out in answers.items():
        same = torch.equal(out, answers[("now", T)])
        ok &= same and bool(torch.isfinite(out).all())
        print(f"answer {name} T={T}: {'equal to now' if same else 'DIFFERS from now'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
