"""Fused vs serial layer time on one GPU (R=1), the compute-only time, and exposed communication.

    python bench/fused_layer.py [--iters 20] [--tokens 2048] [--intermediate 768]

Shape: the seed preset's per-rank share (E=64, H=4096, K=8, I = 768 = one TP4 slice), with all
T = 2048 tokens of a step on one GPU (R=1, C=T), bf16, random weights. Same inputs for every row:
  - serial        service.moe.serial.SerialLayer with the Triton grouped GEMMs (gemm=triton):
                  tables, GEMM1+SwiGLU (rows gathered through row_token), GEMM2, combine, one
                  after the other (eager, the baseline of the ratios; and its step as a CUDA
                  graph, graph=True, timed like the fused layer);
  - fused         service.moe.fused.FusedLayer (CUDA graph): exchange, tables, kernel 1, kernel 2,
                  final reduce; the same GEMM tile code and tile configs as the serial GEMMs;
  - compute-only  the fused layer with every wait removed (SYNC=False): the same programs move the
                  same bytes, nobody waits (output discarded). At R=1 kernel 1 pulls nothing
                  (every token is read in place), so what differs is kernel 2's job machinery;
  - exposed comm  fused - compute-only, and the in-kernel measure (`FusedLayer.exposed_comm_s`).
Each figure is the median of --iters steps timed with CUDA events around `forward` (the layer's
own staging included; the step's rows are first written where the layer takes them, as the rank
does); ratios are to serial measured in the same run. Target (issue 6): fused <= 1.05 x serial.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# Run as a script: the repository's root on sys.path for `service` without an install.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from service.config import LayerConfig  # noqa: E402


def plan_value(text: str):
    """A --variants value: an int, True / False, else the text (e.g. a name)."""
    if text.isdigit():
        return int(text)
    return {"True": True, "False": False}.get(text, text)


def own_inputs(layer, x, ids, w):
    """As the rank does: the step's rows written once into the layer's own input buffers, when it
    has them (the fused layer stages them inside its graph), and views of them passed in."""
    if not hasattr(layer, "inputs"):
        return x, ids, w
    return tuple(buf[:t.shape[0]].copy_(t) for buf, t in zip(layer.inputs, (x, ids, w), strict=True))


def time_forward(layer, x, ids, w, iters: int, seq0: int) -> tuple[float, list[float]]:
    x, ids, w = own_inputs(layer, x, ids, w)
    times, exposed = [], []
    for i in range(iters + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        layer.forward(x, ids, w, seq=seq0 + i)
        e.record()
        e.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
            if hasattr(layer, "exposed_comm_s"):
                exposed.append(layer.exposed_comm_s())
    return statistics.median(times), exposed


def stage_medians(layer, x, ids, w, iters: int, seq0: int) -> dict[str, float]:
    """Median device time per stage (StageTimer events; the fused layer must run eagerly)."""
    from service.moe.timing import StageTimer

    x, ids, w = own_inputs(layer, x, ids, w)
    timer = StageTimer(x.device)
    per: dict[str, list[float]] = {}
    for i in range(iters + 3):
        layer.forward(x, ids, w, seq=seq0 + i, timer=timer)
        if i >= 3:
            for k, v in timer.seconds().items():
                per.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in per.items()}


def main() -> None:
    from service.moe.fused import FusedLayer
    from service.moe.serial import SerialLayer
    from service.moe.weights import RankWeights

    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--stages", action="store_true", help="also print per-stage times (serial, fused eager)")
    p.add_argument("--job-cols", default="", help="comma-separated kernel-2 job widths to sweep")
    p.add_argument("--variants", default="", help="semicolon-separated plan overrides to time, e.g. "
                   "'num_compute2=132;num_compute2=116,job_cols=1024'")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    cfg = LayerConfig(E=64, H=4096, I=args.intermediate, K=8, R=1, C=args.tokens, dtype=torch.bfloat16)
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {cfg.describe()}")
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = RankWeights(
        w13=(torch.randn(cfg.E, cfg.H, 2 * cfg.Ir, device=dev, generator=gen) / cfg.H ** 0.5).to(cfg.dtype),
        w2=(torch.randn(cfg.E, cfg.Ir, cfg.H, device=dev, generator=gen) / cfg.Ir ** 0.5).to(cfg.dtype))
    T = cfg.C
    x = torch.randn(T, cfg.H, device=dev, generator=gen).to(cfg.dtype)
    ids = torch.rand(T, cfg.E, device=dev, generator=gen).argsort(dim=1)[:, :cfg.K].int()
    w = torch.softmax(torch.randn(T, cfg.K, device=dev, generator=gen), dim=1)

    serial = SerialLayer(cfg, weights, rank=0, device=dev, gemm="triton")
    serial_graph = SerialLayer(cfg, weights, rank=0, device=dev, gemm="triton", graph=True)
    fused = FusedLayer(cfg, weights, rank=0, device=dev)
    compute = FusedLayer(cfg, weights, rank=0, device=dev, sync=False)
    print(f"fused plan: {fused.plan}")

    ref = serial.forward(x, ids, w, seq=1).clone()
    out = fused.forward(x, ids, w, seq=1).clone()
    fused.check_seq(1)
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"fused vs serial output: relative difference {err:.2e}")

    t_serial, _ = time_forward(serial, x, ids, w, args.iters, 2)
    t_serial_graph, _ = time_forward(serial_graph, x, ids, w, args.iters, 2)
    t_fused, exposed = time_forward(fused, x, ids, w, args.iters, 2)
    fused.check_seq(args.iters + 4)
    t_compute, _ = time_forward(compute, x, ids, w, args.iters, 2)
    breakdown = fused.exposure_breakdown_s()
    flops = 2 * T * cfg.K * cfg.H * 3 * cfg.Ir
    print("\n| layer | time (us) | x serial | TFLOP/s |")
    print("|---|---|---|---|")
    for name, t in (("serial (triton GEMMs, eager)", t_serial), ("serial (graph)", t_serial_graph),
                    ("fused (graph)", t_fused),
                    ("compute-only (fused, no waits)", t_compute)):
        print(f"| {name} | {t * 1e6:.0f} | {t / t_serial:.3f} | {flops / t / 1e12:.0f} |")
    print(f"| exposed comm = fused - compute-only | {(t_fused - t_compute) * 1e6:.0f} | - | - |")
    print(f"| exposed comm, in-kernel (median) | {statistics.median(exposed) * 1e6:.0f} | - | - |")
    print("in-kernel breakdown of the last step (us): "
          + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in breakdown.items()))
    print(f"fused / serial = {t_fused / t_serial:.3f} (target <= 1.05); fused / serial graph = "
          f"{t_fused / t_serial_graph:.3f}")
    if args.stages:
        eager = FusedLayer(cfg, weights, rank=0, device=dev, graph=False)
        for name, layer in (("serial", serial), ("fused eager", eager)):
            med = stage_medians(layer, x, ids, w, args.iters, 100)
            print(f"stages {name} (us): " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in med.items())
                  + f"; sum {sum(med.values()) * 1e6:.0f}")
    variants = [dict(job_cols=int(c)) for c in args.job_cols.split(",") if c]
    for text in [v for v in args.variants.split(";") if v]:
        variants.append({k: plan_value(v) for k, v in (kv.split("=") for kv in text.split(","))})
    for overrides in variants:
        layer = FusedLayer(cfg, weights, rank=0, device=dev, **overrides)
        t, ex = time_forward(layer, x, ids, w, args.iters, 2)
        check = ((layer.forward(x, ids, w, seq=args.iters + 5) - ref).norm() / ref.norm()).item()
        gates = layer.exposure_breakdown_s()
        print(f"sweep {overrides}: fused {t * 1e6:.0f} us = {t / t_serial:.3f} x serial; diff {check:.1e}; "
              "in-kernel " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in gates.items()))


if __name__ == "__main__":
    main()
