"""Grouped GEMM and schedule-build benchmark (issue 5), one run, every figure with its baseline.

    python bench/gemm.py [--tokens 2048] [--K 8] [--E 64] [--H 4096] [--Ir 768] [--json out.json]

Dimension letters: T tokens (R*C of one step), K top-k, E experts, H hidden, Ir intermediate
slice, S rows of the gathered layout, BM = 128.

GEMM figures are TFLOP/s over the useful work, real hits only (padding rows excluded):
    GEMM1 (+SwiGLU)  2 * T*K * H * 2*Ir      GEMM2  2 * T*K * Ir * H
for three implementations, balanced and skewed routing:
    triton    service.kernels.grouped_gemm over the padded layout
    triton_gather           GEMM1 reading row s as token row_token[s] (what both layers run)
    triton_identity_gather  the gather code path on the laid-out rows (row_token = identity)
    grouped   torch._grouped_mm on the unpadded hits + a separate SwiGLU (the baseline, ratio 1.0)
    loop      one cuBLAS matmul per expert on host-known offsets (what a naive layer does)
Schedule build time (us) for the CUDA op moe::build_tables (graph replay), the vectorized torch
builder (graph replay and eager) and an eager argsort chain (the baseline, ratio 1.0).
Top-k combine (us and GB/s over service.kernels.combine.bytes_moved) for the Triton kernel
against the serial backend's torch loop (K rounds of index_select + cast + addcmul; ratio 1.0).
Timings: triton.testing.do_bench (median, L2 flushed between runs) or do_bench_cudagraph.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from service.config import BM, round_up  # noqa: E402
from service.kernels import schedule  # noqa: E402
from service.kernels.combine import bytes_moved, combine  # noqa: E402
from service.kernels.grouped_gemm import flops, gemm1_swiglu, gemm2  # noqa: E402
from service.kernels.tuning import lookup_for_device  # noqa: E402
from service.moe import tables as torch_tables  # noqa: E402


def routing(T: int, E: int, K: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """ids [T, K]: K distinct experts per token; balanced (uniform) or skewed (p ~ 1/(e+1))."""
    probs = torch.ones(E) if kind == "balanced" else 1.0 / (torch.arange(E, dtype=torch.float32) + 1)
    return torch.multinomial(probs.expand(T, E), K, replacement=False, generator=gen)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_gemms(args, kind: str, dev: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0 if kind == "balanced" else 1)
    T, K, E, H, Ir = args.tokens, args.K, args.E, args.H, args.Ir
    hits = T * K
    S = round_up(hits + E * (BM - 1), BM)
    dtype = getattr(torch, args.dtype)
    ids = routing(T, E, K, kind, gen).to(dev, torch.int32)  # [T, K]
    counts = torch.tensor([T], dtype=torch.int32, device=dev)  # one "rank" holding all T tokens
    tables = torch_tables.build_tables(ids, counts, E, T, S)
    rows_per_expert = torch.bincount(ids.view(-1).long(), minlength=E)  # [E]
    w13 = torch.randn(E, H, 2 * Ir, device=dev, dtype=dtype) / math.sqrt(H)  # [E, H, 2*Ir]
    w2 = torch.randn(E, Ir, H, device=dev, dtype=dtype) / math.sqrt(Ir)  # [E, Ir, H]
    x = torch.randn(T, H, device=dev, dtype=dtype)  # [T, H]

    # Padded layout for the Triton kernel: scatter token rows by slot, padding rows zero.
    a_pad = torch.zeros(S, H, device=dev, dtype=dtype)  # [S, H]
    real_rows = tables.row_token >= 0
    a_pad[real_rows] = x[tables.row_token[real_rows].long()]
    # Unpadded layout for torch._grouped_mm and the loop: hits sorted by expert.
    order = torch.argsort(ids.view(-1), stable=True)
    a_hits = x[(order // K)].contiguous()  # [T*K, H]
    offs = torch.cumsum(rows_per_expert, 0).to(torch.int32)  # [E] cumulative ends
    ends = [0] + offs.tolist()  # host copy for the loop (outside the timing)

    cfg1 = lookup_for_device(dev, "gemm1", E, H, Ir, M=hits)
    cfg2 = lookup_for_device(dev, "gemm2", E, H, Ir, M=hits)
    act_pad = torch.empty(S, Ir, device=dev, dtype=dtype)
    d_pad = torch.empty(S, H, device=dev, dtype=dtype)
    be = tables.block_expert

    def triton1():
        gemm1_swiglu(a_pad, w13, be, config=cfg1, out=act_pad)

    def triton2():
        gemm2(act_pad, w2, be, config=cfg2, out=d_pad)

    # GEMM1 reading its rows through row_token from the token matrix (what both layers run), and
    # the same code path on the laid-out rows (row_token = identity): code cost vs access pattern.
    identity = torch.arange(S, device=dev, dtype=torch.int32)
    act_g = torch.empty(S, Ir, device=dev, dtype=dtype)

    def gather1():
        gemm1_swiglu(x, w13, be, config=cfg1, out=act_g, row_token=tables.row_token)

    def identity1():
        gemm1_swiglu(a_pad, w13, be, config=cfg1, out=act_g, row_token=identity)

    def grouped1():
        h = torch._grouped_mm(a_hits, w13, offs=offs)  # [T*K, 2*Ir]
        return F.silu(h[:, :Ir]) * h[:, Ir:]

    act_hits = grouped1()

    def grouped2():
        return torch._grouped_mm(act_hits, w2, offs=offs)

    def loop1():
        out = torch.empty(hits, Ir, device=dev, dtype=dtype)
        for e in range(E):
            if ends[e + 1] > ends[e]:
                h = a_hits[ends[e]:ends[e + 1]] @ w13[e]
                out[ends[e]:ends[e + 1]] = F.silu(h[:, :Ir]) * h[:, Ir:]
        return out

    def loop2():
        out = torch.empty(hits, H, device=dev, dtype=dtype)
        for e in range(E):
            if ends[e + 1] > ends[e]:
                torch.mm(act_hits[ends[e]:ends[e + 1]], w2[e], out=out[ends[e]:ends[e + 1]])
        return out

    # Correctness of what is timed: the Triton rows vs the grouped_mm rows, hit by hit.
    triton1()
    triton2()
    slot_of_sorted = tables.slots.view(-1)[order].long()  # row of the layout holding sorted hit q
    err1 = rel_err(act_pad[slot_of_sorted], act_hits)
    gemm2(act_pad, w2, be, config=cfg2, out=d_pad)
    err2 = rel_err(d_pad[slot_of_sorted], grouped2())

    f1, f2 = flops(hits, H, Ir, swiglu=True), flops(hits, Ir, H, swiglu=False)
    result = {"routing": kind, "rows_used": int(tables.expert_offsets[-1]), "hits": hits,
              "max_rows_per_expert": int(rows_per_expert.max()), "cfg1": str(cfg1), "cfg2": str(cfg2),
              "rel_err_vs_grouped": [err1, err2]}
    gather1()
    result["rel_err_gather_vs_layout"] = rel_err(act_g[real_rows], act_pad[real_rows])
    for name, fn in (("triton_gather", gather1), ("triton_identity_gather", identity1)):
        ms1 = do_bench(fn, warmup=25, rep=200)
        result[name] = {"gemm1_ms": ms1, "gemm1_tflops": f1 / ms1 / 1e9}
    for name, fn1, fn2 in (("triton", triton1, triton2), ("grouped", grouped1, grouped2), ("loop", loop1, loop2)):
        ms1, ms2 = do_bench(fn1, warmup=25, rep=200), do_bench(fn2, warmup=25, rep=200)
        result[name] = {"gemm1_ms": ms1, "gemm2_ms": ms2,
                        "gemm1_tflops": f1 / ms1 / 1e9, "gemm2_tflops": f2 / ms2 / 1e9}
    return result


def argsort_chain(ids: torch.Tensor, counts: torch.Tensor, E: int, C: int, S: int):
    """The eager baseline: argsort by expert, bincount, padded cumsum, scatters (vLLM-like, no pull/job orders)."""
    T, K = ids.shape
    g = torch.arange(T, device=ids.device)
    real = (g % C) < counts.long()[g // C]
    expert = torch.where(real[:, None], ids.long(), E).view(-1)  # [T*K]
    order = torch.argsort(expert, stable=True)
    n = torch.bincount(expert, minlength=E + 1)[:E]
    off = torch.cat([n.new_zeros(1), ((n + BM - 1) // BM * BM).cumsum(0)])
    start = torch.cat([n.new_zeros(1), n.cumsum(0)])
    se = expert[order].clamp(max=E - 1)
    rows = off[se] + torch.arange(T * K, device=ids.device) - start[se]
    slots = torch.empty_like(rows).scatter_(0, order, rows)
    block_expert = torch.searchsorted(off[1:], torch.arange(S // BM, device=ids.device) * BM, right=True)
    return off, slots, block_expert


def bench_schedule(args, dev: torch.device) -> dict:
    T, K, E = args.tokens, args.K, args.E
    R = 4
    C = T // R
    S = round_up(T * K + E * (BM - 1), BM)
    gen = torch.Generator().manual_seed(2)
    ids = routing(T, E, K, "balanced", gen).to(dev, torch.int32)
    counts = torch.full((R,), C, dtype=torch.int32, device=dev)
    result = {"argsort_eager_us": do_bench(lambda: argsort_chain(ids, counts, E, C, S), warmup=25, rep=200) * 1e3,
              "torch_builder_eager_us": do_bench(lambda: torch_tables.build_tables(ids, counts, E, C, S),
                                                 warmup=25, rep=200) * 1e3}
    with torch.cuda.stream(torch.cuda.Stream()):
        result["torch_builder_graph_us"] = do_bench_cudagraph(
            lambda: torch_tables.build_tables(ids, counts, E, C, S), rep=200) * 1e3
    available, reason = schedule.load()
    if available:
        out = schedule.build_tables_cuda(ids, counts, E, C, S)
        golden = torch_tables.build_tables(ids, counts, E, C, S)
        result["cuda_op_equal_to_torch_builder"] = all(
            torch.equal(a, getattr(golden, f)) for f, a in zip(schedule.FIELDS, out, strict=True))
        result["cuda_op_eager_us"] = do_bench(lambda: schedule.build_tables_cuda(ids, counts, E, C, S, out=out),
                                              warmup=25, rep=200) * 1e3
        with torch.cuda.stream(torch.cuda.Stream()):
            result["cuda_op_graph_us"] = do_bench_cudagraph(
                lambda: schedule.build_tables_cuda(ids, counts, E, C, S, out=out), rep=200) * 1e3
    else:
        result["cuda_op_missing"] = reason
    return result


def torch_combine(d: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The serial backend's step 5 as it was (service/moe/serial.py): the baseline, ratio 1.0."""
    N, K = slots.shape
    slots_c = slots.long().clamp(min=0)  # [N, K]
    partial = torch.zeros(N, d.shape[1], dtype=torch.float32, device=d.device)  # [N, H]
    for k in range(K):
        partial.addcmul_(d.index_select(0, slots_c[:, k]).float(), w[:, k:k + 1])
    return torch.where(real[:, None], partial, 0.0)


def bench_combine(args, dev: torch.device) -> dict:
    T, K, E, H = args.tokens, args.K, args.E, args.H
    R = 4
    C = T // R
    S = round_up(T * K + E * (BM - 1), BM)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(3)
    ids = routing(T, E, K, "balanced", gen).to(dev, torch.int32)
    counts = torch.tensor([C, C, C, C - 37], dtype=torch.int32, device=dev)  # a few padding tokens
    tables = torch_tables.build_tables(ids, counts, E, C, S)
    g = torch.arange(T, device=dev)
    real = (g % C) < counts.long()[g // C]  # [T]
    d = torch.randn(S, H, device=dev, dtype=dtype)  # [S, H] the GEMM2 output
    w = torch.rand(T, K, device=dev) * real[:, None]  # [T, K] padding tokens: weight 0, as serial.py sets
    out = torch.empty(T, H, device=dev)
    ref = torch_combine(d, tables.slots, w, real)
    combine(d, tables.slots, w, out=out)
    moved = bytes_moved(T, K, H, d.element_size(), real_tokens=int(real.sum()))
    result = {"rel_err_vs_torch": rel_err(out, ref), "bytes": moved,
              "triton_us": do_bench(lambda: combine(d, tables.slots, w, out=out), warmup=25, rep=200) * 1e3,
              "torch_us": do_bench(lambda: torch_combine(d, tables.slots, w, real), warmup=25, rep=200) * 1e3}
    for name in ("triton", "torch"):
        result[f"{name}_gbps"] = moved / result[f"{name}_us"] / 1e3
    return result


def dense_reference(dev: torch.device) -> float:
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return 2 * n**3 / do_bench(lambda: a @ b, warmup=10, rep=100) / 1e9


def print_report(report: dict) -> None:
    print(f"\ndevice {report['device']}  torch {report['torch']}  triton {report['triton']}  "
          f"T={report['shape']['tokens']} K={report['shape']['K']} E={report['shape']['E']} "
          f"H={report['shape']['H']} Ir={report['shape']['Ir']} {report['shape']['dtype']}")
    if "gemm" in report:
        print_gemms(report)
    if "schedule" in report:
        print_schedule(report["schedule"])
    if "combine" in report:
        print_combine(report["combine"])


def print_gemms(report: dict) -> None:
    print(f"dense cuBLAS 8192^3: {report['dense_tflops']:.0f} TFLOP/s")
    print(f"{'routing':9s} {'impl':8s} {'GEMM1+SwiGLU':>14s} {'ratio':>6s} {'GEMM2':>10s} {'ratio':>6s}   "
          "(TFLOP/s, real hits)")
    for r in report["gemm"]:
        base = r["grouped"]
        for name in ("triton", "grouped", "loop"):
            v = r[name]
            print(f"{r['routing']:9s} {name:8s} {v['gemm1_tflops']:14.0f} "
                  f"{v['gemm1_tflops'] / base['gemm1_tflops']:6.2f} "
                  f"{v['gemm2_tflops']:10.0f} {v['gemm2_tflops'] / base['gemm2_tflops']:6.2f}")
        for name in ("triton_gather", "triton_identity_gather"):
            v = r[name]
            print(f"{r['routing']:9s} {name:8s} {v['gemm1_tflops']:14.0f} "
                  f"{v['gemm1_tflops'] / base['gemm1_tflops']:6.2f}")
        print(f"{'':9s} rows used {r['rows_used']} for {r['hits']} hits; max rows/expert {r['max_rows_per_expert']}; "
              f"triton vs grouped rel err {r['rel_err_vs_grouped'][0]:.1e} / {r['rel_err_vs_grouped'][1]:.1e}; "
              f"gather vs layout {r['rel_err_gather_vs_layout']:.1e}")


def print_schedule(s: dict) -> None:
    base = s["argsort_eager_us"]
    print("schedule build (us; ratio = time / eager argsort chain, lower is better):")
    for key in ("argsort_eager_us", "torch_builder_eager_us", "torch_builder_graph_us", "cuda_op_eager_us",
                "cuda_op_graph_us"):
        if key in s:
            print(f"  {key[:-3]:24s} {s[key]:8.1f} {s[key] / base:6.3f}")
    if "cuda_op_missing" in s:
        print(f"  cuda op not measured: {s['cuda_op_missing']}")
    elif not s.get("cuda_op_equal_to_torch_builder", False):
        print("  WARNING: the CUDA op's tables differ from the torch builder's")


def print_combine(c: dict) -> None:
    print(f"top-k combine (us, GB/s of {c['bytes'] / 1e6:.0f} MB; ratio = torch loop time / time, higher is better):")
    for name in ("torch", "triton"):
        print(f"  {name:24s} {c[name + '_us']:8.1f} {c['torch_us'] / c[name + '_us']:6.2f}x "
              f"{c[name + '_gbps']:7.0f} GB/s")
    print(f"  triton vs torch rel err {c['rel_err_vs_torch']:.1e}")


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The problem shape, seed share by default: T tokens x top-K over E experts, H, Ir."""
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--K", type=int, default=8)
    parser.add_argument("--E", type=int, default=64)
    parser.add_argument("--H", type=int, default=4096)
    parser.add_argument("--Ir", type=int, default=768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--parts", default="gemm,schedule,combine", help="comma-separated subset to measure")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemm.py needs a CUDA GPU")
    dev = torch.device("cuda")
    parts = set(args.parts.split(","))
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"tokens": args.tokens, "K": args.K, "E": args.E, "H": args.H, "Ir": args.Ir,
                        "dtype": args.dtype},
              "parts": sorted(parts)}
    if "gemm" in parts:
        report["dense_tflops"] = dense_reference(dev)
        report["gemm"] = [bench_gemms(args, kind, dev) for kind in ("balanced", "skewed")]
    if "schedule" in parts:
        report["schedule"] = bench_schedule(args, dev)
    if "combine" in parts:
        report["combine"] = bench_combine(args, dev)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
