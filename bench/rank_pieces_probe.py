"""Host time of each piece of a rank's step on the wire arena's path at one client (GPU only).

    python bench/rank_pieces_probe.py [--tokens 512,8] [--iters 200]

The served c=1 step phases on an H100 (bench/RESULTS.md, eighteenth session; T=512, the arena's rows)
were copy_in 0.47, launch 0.19, checks 0.14 ms of host time, where the probe of the slot's path
(bench/step_enqueue_probe.py, no sources) put the whole enqueue at ~0.1 ms. This times the pieces the
rank (service.worker.rank._steps) runs for a step whose rows come from one source (one request in the
arena: a /dev/shm object, its input and output regions registered as the rank registers them), each
alone and in the rank's order, with the device idle before each (synchronize, 1 ms sleep), the fused
layer (seed preset, R=1) and real buffers:

  copy_in:  objects.prune, direct.plan, the rows' DMA (_dma_in from the source; the slot's DMA for
            comparison), ids and w, the copy-in events, the check (the lane's graph, rank._SpanCheck, as the
            rank runs it; alone: the eager _check_cuda, the Triton launch and the flags' copy)
  launch:   layer.forward with the lane's state (the step graph's replay), the cast into out_dev,
            layer_done, _dma_out into the source's output region, done
  checks:   (after the step) _note_flags, check_seq, the timer's seconds, exposed_comm_s

p50 / p90 us per piece, and the sum of the rank's order against its pieces' sum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@torch.inference_mode()  # as the rank's steps run
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,8")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    from service.config import preset
    from service.moe.layer import make_layer
    from service.moe.weights import synthetic_rank_weights
    from service.worker import direct
    from service.worker import rank as rk
    from service.worker.shm import ARENA_PREFIX

    cfg = preset("seed", R=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    layer = make_layer(cfg, synthetic_rank_weights(cfg, 0, 0, device=dev), rank=0, device=dev, backend="fused")
    state = layer.new_state()
    row_bytes = cfg.H * cfg.dtype.itemsize
    C = cfg.C
    size = 2 * C * row_bytes
    key = f"/{ARENA_PREFIX}probe-{uuid.uuid4().hex[:12]}"  # named as a front end's arena is
    path = f"{direct.SHM_ROOT}/{key[1:]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    rows: dict[str, dict[int, list[float]]] = {}
    try:
        os.ftruncate(fd, size)
        ident = direct.identity(fd)
        gen = torch.Generator().manual_seed(3)
        x_host = torch.randn(C, cfg.H, generator=gen).to(cfg.dtype)
        os.pwrite(fd, direct.memory(x_host), 0)
        slot_x = x_host.clone().pin_memory()
        slot_out = torch.empty(C, cfg.H, dtype=cfg.dtype).pin_memory()
        ids_h = torch.argsort(torch.rand(C, cfg.E, generator=gen), dim=1)[:, :cfg.K].int().pin_memory()
        w_h = torch.softmax(torch.randn(C, cfg.K, generator=gen), dim=1).pin_memory()
        inputs = layer.inputs
        out_dev = torch.empty(C, cfg.H, dtype=cfg.dtype, device=dev)
        flags = (torch.empty(C, dtype=torch.bool, device=dev), torch.empty(C, dtype=torch.bool, pin_memory=True))
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        layer_done, done = torch.cuda.Event(), torch.cuda.Event()
        objects = direct.Objects(cuda=True)
        in_region, out_region = (0, C * row_bytes), (C * row_bytes, C * row_bytes)
        check = rk._row_check()
        span_check = rk._SpanCheck(check, inputs[0], flags)

        def note(what: str, T: int, dt: float) -> None:
            rows.setdefault(what, {}).setdefault(T, []).append(dt * 1e6)

        seq = 0
        for T in [int(t) for t in args.tokens.split(",")]:
            sources = [(0, T, key, ident, 0, key, ident, C * row_bytes, in_region, out_region)]
            for i in range(args.iters + 20):
                seq += 1
                torch.cuda.synchronize()
                time.sleep(0.001)
                keep = i >= 20
                marks = [("", time.perf_counter())]

                def mark(what: str, marks=marks) -> None:
                    marks.append((what, time.perf_counter()))

                objects.prune()
                mark("prune")
                plan = direct.plan(sources, objects, row_bytes, (0, T), (0, T))
                mark("plan")
                assert plan.report == {} and plan.reads, plan.report
                ev[0].record()
                mark("copy-in's first event")
                x = rk._dma_in(inputs[0][:T], slot_x[:T], plan, row_bytes)
                mark("rows' DMA from the source")
                ids, w = (buf[:T].copy_(src[:T], non_blocking=True) for buf, src in zip(inputs[1:], (ids_h, w_h),
                                                                                        strict=True))
                mark("ids, w")
                ev[1].record()
                mark("copy-in's second event")
                assert span_check.covers(x) and plan.span is not None
                span_check.run(*plan.span)
                mark("check (the lane's graph)")
                out = layer.forward(x, ids, w, seq, state=state)
                mark("forward (graph replay)")
                layer_done.record()
                mark("layer_done event")
                rk._dma_out(out_dev[:T].copy_(out), slot_out[:T], plan, row_bytes)
                mark("cast + answer's DMA to the source")
                done.record()
                mark("done event")
                done.synchronize()
                mark("(device)")
                rk._note_flags(plan, flags[1], sources, (0, T))
                mark("_note_flags")
                layer.check_seq(seq, state)
                mark("check_seq")
                state.timer.seconds()
                mark("timer seconds")
                layer.exposed_comm_s(state)
                mark("exposed_comm_s")
                ev[0].elapsed_time(ev[1])
                mark("copy-in events' time")
                if keep:
                    acc: dict[str, float] = {}
                    for (_, t0), (what, t1) in zip(marks, marks[1:], strict=False):
                        acc[what] = acc.get(what, 0.0) + (t1 - t0)
                    for what, dt in acc.items():
                        note(what, T, dt)
                    note("= message -> issued (prune .. check)", T,
                         marks[7][1] - marks[0][1])
                    note("= issued -> enqueued (forward .. done)", T, marks[11][1] - marks[7][1])
                    note("= checks (_note_flags .. events' time)", T, marks[-1][1] - marks[12][1])
            got = torch.empty(T, cfg.H, dtype=cfg.dtype)
            os.preadv(fd, [direct.memory(got)], C * row_bytes)
            assert bool(torch.isfinite(got.float()).all()), "the answer in the source's output region"
            # alone: the pieces that may dominate, each with the device idle before it
            for i in range(args.iters + 20):
                for what, call in (
                        ("alone: slot rows' DMA", lambda T=T: inputs[0][:T].copy_(slot_x[:T], non_blocking=True)),
                        ("alone: _check_cuda (eager)", lambda T=T, p=plan: rk._check_cuda(inputs[0][:T], p, flags)),
                        ("alone: zero_bad_rows launch", lambda T=T: check(inputs[0][:T], flags[0][:T])),
                        ("alone: the check's graph", lambda T=T: span_check.run(0, T)),
                        ("alone: flags' copy", lambda T=T: flags[1][:T].copy_(flags[0][:T], non_blocking=True)),
                        ("alone: an event", lambda: ev[0].record())):
                    torch.cuda.synchronize()
                    time.sleep(0.001)
                    t0 = time.perf_counter()
                    call()
                    if i >= 20:
                        note(what, T, time.perf_counter() - t0)
        objects.close()
    finally:
        os.close(fd)
        os.unlink(path)
    sizes = [int(t) for t in args.tokens.split(",")]
    print(f"# {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; {args.iters} steps per cell, device idle "
          "before each; host us")
    print("| piece | " + " | ".join(f"T={T} p50 / p90" for T in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for what, per_t in rows.items():
        cells = " | ".join(f"{statistics.median(per_t[T]):.0f} / {statistics.quantiles(per_t[T], n=10)[8]:.0f}"
                           if T in per_t else "" for T in sizes)
        print(f"| {what} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
