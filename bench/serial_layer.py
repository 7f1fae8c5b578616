"""Per-stage time of the serial backend at the seed shape (GPU) and the CPU preset's time.

    python bench/serial_layer.py [--device cuda|cpu] [--iters 20]

GPU part (one device, R=1, in process): the layer for T = 2048 tokens (the seed preset's
R*C) x top-8 over 64 experts, H=4096, twice:
  - `tp4-share`: I = 768, one rank's tensor-parallel share of the seed layer's work;
  - `full`:      I = 3072, the whole layer on one GPU.
each with both GEMM implementations of the serial backend (`torch`: torch._grouped_mm + a
separate SwiGLU; `triton`: service.kernels.grouped_gemm with SwiGLU fused).
Each prints the median time of every stage (tables, all_gather, scatter, gemm1, swiglu, gemm2,
combine, reduce_scatter; with R=1 the collectives are local copies), the layer total, the
floor (GEMM FLOPs over the dense bf16 matmul rate measured in the same run) and the ratio.

CPU part: the `cpu` preset through a real 4-rank gloo group, full batches; the figure is the
median step wall time, and its ratio to the same layer computed in one process by the fp32
reference (the baseline of this run).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

# Run as a script: the repository's root on sys.path for `service` without an install.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from service.config import LayerConfig, preset  # noqa: E402


def dense_rate(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Measured bf16 matmul rate in FLOP/s (random data, median of `iters`)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n ** 3 / statistics.median(times)


def gpu_layer(cfg: LayerConfig, iters: int, rate: float, gemms: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    from service.moe.serial import SerialLayer
    from service.moe.weights import synthetic_rank_weights

    device = torch.device("cuda", 0)
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120), device_id=device)
    t0 = time.perf_counter()
    weights = synthetic_rank_weights(cfg, 0, seed=0, device=device)
    print(f"  synthetic weights {cfg.describe()}: {time.perf_counter() - t0:.1f} s", flush=True)
    layers = {g: SerialLayer(cfg, weights, rank=0, device=device, gemm=g) for g in gemms}
    del weights
    return {g: time_layer(layer, cfg, iters, rate) for g, layer in layers.items()}


def time_layer(layer, cfg: LayerConfig, iters: int, rate: float) -> dict:
    from service.moe.timing import StageTimer

    device = layer.device
    T = cfg.C
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, cfg.H, device=device, generator=gen).to(cfg.dtype)
    ids = torch.rand(T, cfg.E, device=device, generator=gen).argsort(dim=1)[:, :cfg.K].int()
    w = torch.softmax(torch.randn(T, cfg.K, device=device, generator=gen), dim=1)
    timer = StageTimer(device)
    per_stage: dict[str, list[float]] = {}
    for i in range(iters + 3):
        layer.forward(x, ids, w, seq=i + 1, timer=timer)
        stages = timer.seconds()
        if i >= 3:
            for k, v in stages.items():
                per_stage.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in per_stage.items()}
    total = statistics.median([sum(vals) for vals in zip(*per_stage.values(), strict=True)])
    flops = 2 * T * cfg.K * cfg.H * 3 * cfg.Ir  # GEMM1 (2*Ir columns) + GEMM2, real rows only
    return {"stages": med, "total": total, "flops": flops, "floor": flops / rate}


def cpu_preset(iters: int) -> dict:
    from service.moe.reference import full_weights, moe_reference
    from service.worker.group import WorkerGroup

    cfg = preset("cpu")
    T = cfg.tokens_per_step
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, cfg.H, generator=gen)
    ids = torch.rand(T, cfg.E, generator=gen).argsort(dim=1)[:, :cfg.K].int()
    w = torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1)
    weights = full_weights(cfg, 0)
    ref_times = []
    for _ in range(max(3, iters // 4)):
        t0 = time.perf_counter()
        moe_reference(x, ids, w, *weights)
        ref_times.append(time.perf_counter() - t0)
    with WorkerGroup(cfg, device="cpu") as group:
        for _ in range(3):
            group.forward(x, ids, w)
        walls = []
        for _ in range(iters):
            t0 = time.perf_counter()
            group.forward(x, ids, w)
            walls.append(time.perf_counter() - t0)
    return {"cfg": cfg, "T": T, "wall": statistics.median(walls), "ref": statistics.median(ref_times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    rows = []
    if args.device == "cuda":
        dev = torch.device("cuda", 0)
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
        rate = dense_rate(dev)
        print(f"dense bf16 8192^3 matmul: {rate / 1e12:.0f} TFLOP/s (the floor's rate)")
        seed = preset("seed")
        for name, I in (("tp4-share", seed.I // seed.R), ("full", seed.I)):
            cfg = LayerConfig(E=seed.E, H=seed.H, I=I, K=seed.K, R=1, C=seed.tokens_per_step, dtype=seed.dtype)
            for gemm, r in gpu_layer(cfg, args.iters, rate, ("torch", "triton")).items():
                stages = "  ".join(f"{k} {v * 1e6:.0f}" for k, v in r["stages"].items())
                print(f"{name} gemm={gemm}: T={cfg.C} I={I}: stages (us): {stages}")
                rows.append((f"{name} gemm={gemm}", r["total"] * 1e6, r["floor"] * 1e6, r["total"] / r["floor"],
                             r["flops"] / r["total"] / 1e12))
        torch.cuda.empty_cache()
    c = cpu_preset(args.iters)
    print(f"cpu preset {c['cfg'].describe()}, T={c['T']}: group step {c['wall'] * 1e3:.1f} ms, "
          f"single-process fp32 reference {c['ref'] * 1e3:.1f} ms")
    print("\n| layer | time (us) | floor (us) | time/floor | TFLOP/s |")
    print("|---|---|---|---|---|")
    for name, t, floor, ratio, tf in rows:
        print(f"| {name} | {t:.0f} | {floor:.0f} | {ratio:.2f} | {tf:.0f} |")
    print(f"| cpu preset, 4 gloo ranks (wall) | {c['wall'] * 1e6:.0f} | ref {c['ref'] * 1e6:.0f} | "
          f"{c['wall'] / c['ref']:.2f} x ref | - |")


if __name__ == "__main__":
    main()
