"""The compute core in one run on one GPU: the machine's matrix rate, this project's GEMMs and layers,
and the layer a user would run instead (issue 12).

    python bench/core.py --anchors PATH/bench_anchors.py [--tokens 2048] [--K 8] [--E 64] [--H 4096]
                         [--Ir 768] [--iters 100] [--w-desc off] [--split on,off] [--pair off,gemm1,on]
                         [--order static,queue] [--cuda-tile off,on,n256,noinc,mcast] [--repeats N]
                         [--routing balanced,skewed] [--json FILE] [--profile [--gemm1-only]] [--no-anchor]

Shape: the seed preset's per-rank share (T = 2048 tokens, K = 8, E = 64, H = 4096, Ir = 768), all on
one GPU (R = 1, C = T), bf16. Weights and routing come from the anchor script's own generators
(`make_weights`, `make_routing`), so every row sees the same numbers; this project's layers take
the weights transposed into its layout (W13 [E, H, 2*Ir], W2 [E, Ir, H]).

Rows, per routing:
    dense    one bf16 matmul of the same FLOPs, [T*K, H] x [H, 3*Ir] (the anchor's `run_dense`)
    gemm1    service.kernels.grouped_gemm.gemm1_swiglu, rows gathered through row_token (what both
             layers run); TFLOP/s over the real hits, 2*T*K*H*2*Ir
    gemm2    service.kernels.grouped_gemm.gemm2; 2*T*K*Ir*H
    serial   service.moe.serial.SerialLayer (Triton GEMMs), CUDA graph (graph=True)
    fused    service.moe.fused.FusedLayer, CUDA graph
    anchor   vLLM's Triton fused_moe with the tuned 128x256x64 table (the anchor's `run_vllm`, config
             tuned-H100-N768; its align is plain torch: vLLM's CUDA op takes ~20 us), and its GEMMs
each of this project's rows once per combination of --w-desc (GemmConfig.w_desc: weights through
TMA descriptors), --split (GemmConfig.split_tail: half tiles for tail blocks; "nosplit" rows run
full tiles everywhere), --pair (GemmConfig.pair: two full blocks of one expert in one 2*BM x BN/2
tile, stages as tuning.pair_config fits them; "on" in both GEMMs, "gemm1" in GEMM1 / kernel 1 only;
w_desc rows skip it) and --order values (GemmConfig.queue: the GEMM programs take tiles from an
atomic counter; pn_major: an expert's tiles column-tile-major) and --cuda-tile values (GemmConfig.cuda_tile
in GEMM1: the Hopper CUDA tile of csrc/gemm_sm90, tagged " cuda1"; only with the queue and split_tail
it implies, no pair or w_desc; serial layer rows only, the fused kernels have no CUDA tile; or a
mainloop variant of service.kernels.cuda_tile.VARIANTS by name, " cuda1 n256": its GEMM1 row only),
tagged by what differs from the defaults.
--profile: no timing, no layers, no anchor rows: each variant's GEMM1 and GEMM2 (--gemm1-only: GEMM1)
run once per routing (what `ncu -k regex:grouped_gemm --launch-count N` profiles, bench/gpu_core.sh;
bench/gpu_ncu_gemm1.sh).
Timing as the anchor times: our GEMMs and the dense matmul are captured in a graph
and replayed --iters times (the anchor's Timer); the layers replay their own graphs through
`forward` (one 16-byte control copy per step, which advances the step number the fused flags
need), --iters steps back to back, CUDA events around each; medians. Every layer's output is
checked against the anchor's fp32 reference (rel err). A row that fails is printed and recorded,
and the run goes on.
Ratios printed: fused / dense (goal <= 1.5), anchor / fused (goal >= 1.4), GEMM1 / 650 TFLOP/s,
GEMM2 / 550 TFLOP/s, fused / serial, fused / the weight-read floor (E*H*3*Ir bf16 at 4.3 TB/s; the
goal of the service's step, T=512 and I=3072: <= 1.3).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from service.config import BM, LayerConfig  # noqa: E402
from service.kernels.cuda_tile import VARIANTS  # noqa: E402

COPY_BYTES_PER_S = 4.3e12  # measured copy bandwidth of an H200 (bench/NOTES.md): the weight-read floor


def load_anchor(path: str):
    """The anchor script as a module, from its own path (it is not part of this project)."""
    spec = importlib.util.spec_from_file_location("bench_anchors", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).resolve().parent))  # it imports vllm_fused_moe beside it
    spec.loader.exec_module(module)
    return module


def time_steps(layer, x, ids, w, iters: int, seq0: int) -> float:
    """Median us of `iters` layer steps issued back to back (events around each forward, one sync
    at the end), after 3 warm-up steps; the rows sit in the layer's own input buffers."""
    x, ids, w = (buf[:t.shape[0]].copy_(t) for buf, t in zip(layer.inputs, (x, ids, w), strict=True))
    for i in range(3):
        layer.forward(x, ids, w, seq=seq0 + i)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (s, e) in enumerate(events):
        s.record()
        layer.forward(x, ids, w, seq=seq0 + 3 + i)
        e.record()
    torch.cuda.synchronize()
    layer.check_seq(seq0 + 2 + iters)
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


VARIED = (("w_desc", "w_desc", "w_desc"), ("split", "split_tail", "split"))
ORDERS = {"static": {}, "queue": {"queue": True}, "pn_major": {"pn_major": True},
          "queue+pn_major": {"queue": True, "pn_major": True}}  # --order: GemmConfig tile orders
TAGGED = (("queue", "queue", "queue"), ("pn_major", "pn_major", "pn_major"))
# --pair: GemmConfig.pair in (GEMM1, GEMM2), tagged " pair" (both) / " pair1" (GEMM1's only).
PAIRS = {"off": (False, False), "gemm1": (True, False), "on": (True, True)}
# --cuda-tile: off (Triton), on (GemmConfig.cuda_tile, the tile's default mainloop, " cuda1") or a
# service.kernels.cuda_tile.VARIANTS name (that mainloop, GEMM1 rows only, " cuda1 <name>").
CUDA_VARIANT = {"off": None, "on": "base", **{v: v for v in VARIANTS if v != "base"}}
CUDA_TAGS = {"off": "", "on": " cuda1", **{v: f" cuda1 {v}" for v in VARIANTS if v != "base"}}


def variant_list(args, base) -> list[tuple[str, dict]]:
    """(tag, fields) for every combination of the --w-desc, --split, --pair and --order values: the
    GemmConfig fields of both GEMMs, but `pair` and `pair2` (GEMM1's and GEMM2's pair, `tile_configs`);
    the tag names what differs from `base` (" nosplit", " queue", " pair", ...)."""
    choices = [[(field, v == "on") for v in getattr(args, arg.replace("-", "_")).split(",")]
               for arg, field, _ in VARIED]
    out = []
    for combo, pair, cuda in itertools.product(itertools.product(*choices), args.pair.split(","),
                                               args.cuda_tile.split(",")):
        if dict(combo)["w_desc"] and PAIRS[pair][0]:
            continue  # GemmConfig refuses the pair (pointer loads only)
        for order in args.order.split(","):
            change = {**dict(combo), "queue": False, "pn_major": False, **ORDERS[order]}
            if cuda != "off" and not (change["queue"] and change["split_tail"] and not change["pn_major"]
                                     and not change["w_desc"] and pair == "off"):
                continue  # what the CUDA tile runs (GemmConfig.cuda_tile): the queue, split_tail, nothing else
            tag = "".join(f" {name}" if change[field] else f" no{name}"
                          for _, field, name in (*VARIED, *TAGGED) if change[field] != getattr(base, field))
            tag += {"off": "", "gemm1": " pair1", "on": " pair"}[pair] + CUDA_TAGS[cuda]
            out.append((tag, {**change, "pair": PAIRS[pair][0], "pair2": PAIRS[pair][1], "cuda_tile": cuda != "off",
                              "cuda_variant": CUDA_VARIANT[cuda]}))
    return out


def run(args) -> dict:
    from service.kernels import cuda_tile
    from service.kernels.grouped_gemm import gemm1_swiglu, gemm2
    from service.kernels.tuning import lookup_for_device, pair_config, smem_per_block
    from service.moe.fused import FusedLayer
    from service.moe.serial import SerialLayer, build_tables
    from service.moe.weights import RankWeights

    A = load_anchor(args.anchors)
    dev = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    T, K, E, H, Ir = args.tokens, args.K, args.E, args.H, args.Ir
    f1, f2 = 2 * T * K * H * 2 * Ir, 2 * T * K * Ir * H
    cfg = LayerConfig(E=E, H=H, I=Ir, K=K, R=1, C=T, dtype=torch.bfloat16)
    timer = A.Timer(args.iters, 20, cuda=True)
    x, w13_v, w2_v = A.make_weights(T, E, H, Ir, torch.bfloat16, dev, 0)  # vLLM layout: [E, 2I, H], [E, H, I]
    weights = RankWeights(w13=w13_v.transpose(1, 2).contiguous(), w2=w2_v.transpose(1, 2).contiguous())
    print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {cfg.describe()}; "
          f"FLOPs (real hits) {(f1 + f2) / 1e9:.1f} G; iters {args.iters}", flush=True)
    rows: list[dict] = []

    def attempt(name, routing, fn):
        """fn(); a failure is printed and recorded, and the run goes on (one device call, every figure)."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a benchmark row, reported, never hidden
            rows.append(dict(name=name, routing=routing, us=None, error=f"{type(exc).__name__}: {exc}"))
            print(f"  !! {name} {routing}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            torch.cuda.synchronize()

    def record(name, routing, us, flops=None, err=None, **extra):
        row = {"name": name, "routing": routing, "us": us, "tflops": flops / us / 1e6 if flops and us else None,
               "err": err, **extra}
        rows.append(row)
        tf = f" {row['tflops']:6.1f} TFLOP/s" if row["tflops"] else ""
        spread = f"  [{extra['spread'][0]:.1f}, {extra['spread'][1]:.1f}]" if len(extra.get("spread", [])) == 2 else ""
        print(f"  {name:<34} {routing:<9} {us:9.1f} us{tf}{spread}"
              + (f"  rel err {err:.2e}" if err is not None else ""), flush=True)

    dense_us = float("nan")
    if not args.profile:
        A.run_dense(timer, T, K, H, Ir, torch.bfloat16, dev)  # prints its rows; the first is the same-FLOPs mm
        dense_us = A.ROWS[-4].get("graph", {}).get("median_us", float("nan"))
        record("dense mm, same FLOPs", "-", dense_us, f1 + f2)
    base1 = lookup_for_device(dev, "gemm1", E, H, Ir)  # what both layers look up
    base2 = lookup_for_device(dev, "gemm2", E, H, Ir)
    smem = smem_per_block(dev)

    def tile_configs(change: dict):
        """(GEMM1, GEMM2) configs of a variant (variant_list); pair tiles with their stages fitted to the device."""
        fields = {k: v for k, v in change.items() if k not in ("pair", "pair2", "cuda_tile", "cuda_variant")}
        c1, c2 = dataclasses.replace(base1, **fields), dataclasses.replace(base2, **fields)
        if change["cuda_tile"]:  # GEMM1 on the CUDA tile, whose shape the config must state
            c1 = dataclasses.replace(c1, BN=128, BK=64, cuda_tile=True)
        return (pair_config(c1, smem, swiglu=True) if change["pair"] else c1,
                pair_config(c2, smem, swiglu=False) if change["pair2"] else c2)
    variants = variant_list(args, base1)
    layers = {}

    next_seq: dict = {}  # layer key -> its next step number (flags target seq: never reuse one)

    def layer_measure(kind: str, tag: str, change: dict, ids, tw, ref, routing: str):
        """A closure: one timing of this layer (built, checked against the reference and its error
        kept on the first call), in us; every call continues the layer's step numbers."""
        key = (kind, tag)

        def measure() -> tuple[float, float | None]:
            if key not in layers:
                c1, c2 = tile_configs(change)
                if kind == "serial":
                    layer = SerialLayer(cfg, weights, rank=0, device=dev, gemm="triton")
                    # The A/B switch for this run: the tile configs' fields (JSON fields in service use).
                    layer.gemms.configs = [c1, c2]
                    layer._capture()
                else:
                    layer = FusedLayer(cfg, weights, rank=0, device=dev, config1=c1, config2=c2)
                layers[key] = layer
                next_seq[key] = 1
            layer = layers[key]
            seq = next_seq[key]
            if (key, routing) not in checked:  # the first step of this routing: the output checked
                out = layer.forward(x, ids, tw, seq=seq).clone()
                layer.check_seq(seq)
                checked[(key, routing)] = A.rel_err(out, ref)
                seq += 1
            us = time_steps(layer, x, ids, tw, args.iters, seq0=seq)
            next_seq[key] = seq + 3 + args.iters
            return us, checked[(key, routing)]

        return measure

    checked: dict = {}

    for routing in args.routing.split(","):
        ids, tw = (t.to(dev) for t in A.make_routing(T, E, K, routing, 0))
        ref = None if args.profile else A.reference_fp32(x, w13_v, w2_v, ids, tw)
        print(f"--- {routing}: {A.routing_stats(ids.cpu(), E, [128])}", flush=True)
        tables = build_tables(ids, torch.tensor([T], dtype=torch.int32, device=dev), E, T, cfg.S)
        used = int(tables.expert_offsets[-1])
        nb = [(hi - lo) // BM for lo, hi in itertools.pairwise(tables.expert_offsets.tolist())]
        tails = (tables.row_token.view(-1, BM)[:, BM // 2] < 0).tolist()  # per block: a half tail (if used)
        half = sum(tails[:used // BM])  # blocks that run a half tile
        ends = list(itertools.accumulate(nb))
        pairs = sum((n - int(n > 0 and tails[end - 1])) // 2 for n, end in zip(nb, ends, strict=True))
        print(f"    layout rows {used} for {T * K} hits; with split_tail {used - half * BM // 2} computed "
              f"({half} half tiles of {used // BM} blocks); pair tiles would pair {2 * pairs} blocks", flush=True)
        act = torch.empty(cfg.S, Ir, device=dev, dtype=cfg.dtype)
        d = torch.empty(cfg.S, H, device=dev, dtype=cfg.dtype)
        timed: list = []  # (row name, measure() -> (us, rel err or None), FLOPs, extra fields)
        for tag, change in variants:
            c1, c2 = tile_configs(change)
            run1 = partial(gemm1_swiglu, x, weights.w13, tables.block_expert, config=c1, out=act,
                           row_token=tables.row_token, expert_offsets=tables.expert_offsets)
            named = change["cuda_variant"] not in (None, "base")  # a named mainloop: GEMM1 rows only
            if named:  # the tile's own launcher
                run1 = partial(cuda_tile.gemm1_swiglu, x, weights.w13, tables.block_expert, out=act,
                               row_token=tables.row_token, variant=change["cuda_variant"])
            run2 = partial(gemm2, act, weights.w2, tables.block_expert, config=c2, out=d, row_token=tables.row_token,
                           expert_offsets=tables.expert_offsets)
            if args.profile:
                run1()
                if not args.gemm1_only:
                    run2()
                torch.cuda.synchronize()
                print(f"    profiled launches: gemm1{tag}" + ("" if args.gemm1_only else f", gemm2{tag}")
                      + f" ({c1}, {c2})", flush=True)
                continue
            computed = used - half * BM // 2 if c1.split_tail else used
            gemms = ((f"gemm1+swiglu{tag}", run1, f1, c1), (f"gemm2{tag}", run2, f2, c2))
            for name, fn, flops, config in gemms[:1] if named else gemms:
                timed.append((name, lambda fn=fn: (timer.graph(fn)["median_us"], None), flops,
                              dict(rows_used=computed, config=str(config))))
        if args.profile:
            continue
        for tag, change in variants:
            if change["cuda_variant"] not in (None, "base"):
                continue  # a named mainloop: the layers run GemmConfig.cuda_tile's default mainloop
            for kind in ("serial",) if change["cuda_tile"] else ("serial", "fused"):
                timed.append((f"{kind} layer (graph){tag}", layer_measure(kind, tag, change, ids, tw, ref, routing),
                              f1 + f2, {}))
        # Rounds over every row, interleaved, so that a drift of the machine's speed touches all
        # variants alike; each row reports the median of its rounds and their spread.
        samples: dict = {name: [] for name, *_ in timed}
        for _ in range(args.repeats):
            for name, measure, _, _ in timed:
                attempt(name, routing, lambda got=samples[name], measure=measure: got.append(measure()))
        for name, _, flops, extra in timed:
            if samples[name]:
                times = [us for us, _ in samples[name]]
                record(name, routing, statistics.median(times), flops, samples[name][0][1],
                       spread=[min(times), max(times)], **extra)
        if args.no_anchor:  # an A/B of this project's variants: the anchor's rows are another call's
            torch.cuda.empty_cache()
            continue
        A.run_vllm(timer, x, w13_v, w2_v, ids, tw, ref, routing, "tuned-H100-N768",
                   A.CONFIG_SOURCES["tuned-H100-N768"][1](T, E, Ir, H, K))
        for r in A.ROWS[-7:]:
            if r.get("routing") == routing and r.get("part") in ("layer", "gemm1", "gemm2", "align") and "graph" in r:
                record(f"anchor {r['impl'].strip()}", routing, r["graph"]["median_us"], r.get("flops"),
                       r.get("rel_err"))
        torch.cuda.empty_cache()
    return {"rows": rows, "dense_us": dense_us, "device": torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "shape": dict(T=T, K=K, E=E, H=H, Ir=Ir)}


def summary(result: dict) -> None:
    """The issue's ratios, per routing and w_desc setting."""
    rows, dense = result["rows"], result["dense_us"]
    by = {(r["name"], r["routing"]): r for r in rows if r.get("us")}  # failed rows are listed above
    print("\n| routing | weights | GEMM1 TFLOP/s (/650) | GEMM2 TFLOP/s (/550) | serial us | fused us | "
          "anchor us | fused / dense (goal <= 1.5) | anchor / fused (goal >= 1.4) | fused / serial |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tags = sorted({r["name"][len("gemm2"):] for r in rows if r["name"].startswith("gemm2")})
    for routing in sorted({r["routing"] for r in rows if r["routing"] != "-"}):
        anchor = by.get(("anchor vllm fused_moe layer", routing))
        for tag in tags:
            g1, g2 = by.get((f"gemm1+swiglu{tag}", routing)), by.get((f"gemm2{tag}", routing))
            s, f = by.get((f"serial layer (graph){tag}", routing)), by.get((f"fused layer (graph){tag}", routing))
            if not (g1 and g2 and s):
                continue
            a = anchor["us"] if anchor else float("nan")
            fused = f["us"] if f else float("nan")  # none for the CUDA tile's rows (serial only)
            weights = tag.strip() or "defaults"
            print(f"| {routing} | {weights} | {g1['tflops']:.0f} ({g1['tflops'] / 650:.2f}) | "
                  f"{g2['tflops']:.0f} ({g2['tflops'] / 550:.2f}) | {s['us']:.0f} | {fused:.0f} | {a:.0f} | "
                  f"{fused / dense:.2f} | {a / fused:.2f} | {fused / s['us']:.3f} |")
    sh = result["shape"]
    floor = sh["E"] * sh["H"] * 3 * sh["Ir"] * 2 / COPY_BYTES_PER_S * 1e6  # bf16 W13 + W2, read once
    print(f"dense bf16 matmul of the same FLOPs: {dense:.0f} us; weight-read floor {floor:.0f} us "
          f"({sh['E'] * sh['H'] * 3 * sh['Ir'] * 2 / 1e9:.2f} GB at {COPY_BYTES_PER_S / 1e12:.1f} TB/s)")
    for r in by.values():
        if r["name"].startswith("fused layer"):
            print(f"  {r['name']} {r['routing']}: {r['us'] / floor:.2f} x the weight-read floor (goal at T=512, "
                  f"I=3072: <= 1.3)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--anchors", required=True, help="path of the anchor script bench_anchors.py (outside the project)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--K", type=int, default=8)
    p.add_argument("--E", type=int, default=64)
    p.add_argument("--H", type=int, default=4096)
    p.add_argument("--Ir", type=int, default=768)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--w-desc", default="off", help="GemmConfig.w_desc values to time: off, on or both")
    p.add_argument("--split", default="on,off", help="GemmConfig.split_tail values to time: on, off or both")
    p.add_argument("--pair", default="off", help=f"GemmConfig.pair settings to time, of {sorted(PAIRS)} "
                   "(gemm1: GEMM1's tiles only)")
    p.add_argument("--order", default="static", help=f"tile orders to time, of {sorted(ORDERS)} (GemmConfig.queue, "
                   "pn_major)")
    p.add_argument("--cuda-tile", default="off", help="GemmConfig.cuda_tile values for GEMM1: off, on or both "
                   "(the Hopper CUDA tile; needs the csrc library built for 9.0), or mainloop variants of it by name "
                   f"({', '.join(v for v in CUDA_VARIANT if v not in ('off', 'on'))}: GEMM1 rows only; 'on' is 'base')")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all variants, interleaved; medians of rounds")
    p.add_argument("--profile", action="store_true", help="run each variant's GEMMs once, untimed (under ncu)")
    p.add_argument("--gemm1-only", action="store_true", help="--profile: GEMM1 launches only")
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--no-anchor", action="store_true", help="skip the vLLM anchor rows (A/B runs of our variants)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = run(args)
    if args.profile:
        return
    summary(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
