"""Tune the grouped GEMM tile configs on this GPU and write them as JSON (GPU only, never on the
request path): service/kernels/configs/<device>__<mode>__E<E>_H<H>_N<Ir>.json.

    python bench/tune_gemm.py [--tokens 2048] [--K 8] [--E 64] [--H 4096] [--Ir 768] [--quick] [--dry-run]

Each candidate (BN, BK, warps, stages, programs per SM) is compiled and timed with
triton.testing.do_bench on the layout of a balanced routing, as the layers run the GEMMs: GEMM1
gathers its rows through row_token, both take row_token for the half tail tiles
(GemmConfig.split_tail), in the tile order the current file sets (split_tail, queue, pn_major, pair:
bench/core.py measures those on the layers); candidates that do not fit the device's shared memory fail
to compile and are skipped. The best one per mode is written with `"tuned": true`, the
measurement and the runner-up, and printed next to the previous file's config (same run).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench.gemm import add_shape_args  # noqa: E402
from service.config import BM, round_up  # noqa: E402
from service.kernels import tuning  # noqa: E402
from service.kernels.grouped_gemm import GemmConfig, flops, gemm1_swiglu, gemm2  # noqa: E402
from service.moe import tables as torch_tables  # noqa: E402


def candidates(mode: str, quick: bool) -> list[GemmConfig]:
    if quick:
        bns = (64, 128) if mode == "gemm1" else (128, 256)
        grid = itertools.product(bns, (64,), (8,), (3, 4), (1,))
    else:
        bns = (32, 64, 128) if mode == "gemm1" else (64, 128, 256)
        grid = itertools.product(bns, (32, 64, 128), (4, 8), (2, 3, 4, 5), (1,))
    # Two programs per SM where two tiles' stages fit the shared memory (<= ~113 KB each): one
    # program's prologue and epilogue then run under the other's main loop.
    bn2 = 64 if mode == "gemm1" else 128
    small = [(bn2, 64, 8, 2, 2), (bn2, 64, 8, 3, 2)]
    return [GemmConfig(BN=bn, BK=bk, num_warps=w, num_stages=s, ctas_per_sm=c)
            for bn, bk, w, s, c in [*grid, *small]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--quick", action="store_true", help="a handful of candidates (minutes, not tens)")
    parser.add_argument("--dry-run", action="store_true", help="print, do not write the JSON files")
    parser.add_argument("--out-dir", type=Path, default=tuning.CONFIG_DIR)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/tune_gemm.py needs a CUDA GPU")
    dev = torch.device("cuda")
    device_name = torch.cuda.get_device_name(dev)
    T, K, E, H, Ir = args.tokens, args.K, args.E, args.H, args.Ir
    hits = T * K
    S = round_up(hits + E * (BM - 1), BM)
    gen = torch.Generator().manual_seed(0)
    ids = torch.multinomial(torch.ones(E).expand(T, E), K, replacement=False, generator=gen).to(dev, torch.int32)
    tables = torch_tables.build_tables(ids, torch.tensor([T], dtype=torch.int32, device=dev), E, T, S)
    be = tables.block_expert
    dtype = torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=dtype)  # the tokens: GEMM1 gathers its rows through row_token
    w13 = torch.randn(E, H, 2 * Ir, device=dev, dtype=dtype) / math.sqrt(H)
    act = torch.randn(S, Ir, device=dev, dtype=dtype)
    w2 = torch.randn(E, Ir, H, device=dev, dtype=dtype) / math.sqrt(Ir)
    out1 = torch.empty(S, Ir, device=dev, dtype=dtype)
    out2 = torch.empty(S, H, device=dev, dtype=dtype)
    runs = {
        "gemm1": (lambda cfg: gemm1_swiglu(x, w13, be, config=cfg, out=out1, row_token=tables.row_token,
                                           expert_offsets=tables.expert_offsets), flops(hits, H, Ir, swiglu=True)),
        "gemm2": (lambda cfg: gemm2(act, w2, be, config=cfg, out=out2, row_token=tables.row_token,
                                    expert_offsets=tables.expert_offsets), flops(hits, Ir, H, swiglu=False)),
    }
    for mode, (run, work) in runs.items():
        previous = tuning.lookup(device_name, mode, E, H, Ir, M=hits, directory=args.out_dir,
                                 smem_per_block=tuning.smem_per_block(dev))
        results = []
        # The tile order fields stay as the current file has them (bench/core.py --order / --split
        # measure those on the layers); this script tunes the tile's shape.
        order = dict(split_tail=previous.split_tail, queue=previous.queue, pn_major=previous.pn_major,
                     pair=previous.pair)
        for cfg in [dataclasses.replace(c, **order) for c in candidates(mode, args.quick)] + [previous]:
            try:
                run(cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # OutOfResources, or a compiler failure on small-smem parts
                print(f"{mode} {cfg}: skipped ({type(exc).__name__})")
                continue
            ms = do_bench(lambda run=run, cfg=cfg: run(cfg), warmup=10, rep=100)
            results.append((ms, cfg))
            print(f"{mode} {cfg}: {ms * 1e3:8.1f} us {work / ms / 1e9:6.0f} TFLOP/s")
        results.sort(key=lambda r: r[0])
        (best_ms, best), runner_up = results[0], results[1] if len(results) > 1 else None
        prev_ms = next(ms for ms, cfg in results if cfg == previous)
        print(f"{mode}: best {best} {work / best_ms / 1e9:.0f} TFLOP/s; previous {previous} "
              f"{work / prev_ms / 1e9:.0f} TFLOP/s (ratio {prev_ms / best_ms:.2f})")
        entry = {"device": tuning.device_key(device_name), "mode": mode, "E": E, "H": H, "N": Ir,
                 "triton_version": triton.__version__, "tuned": True,
                 "source": f"bench/tune_gemm.py on {device_name}, T={T} K={K} balanced, torch {torch.__version__}",
                 "measured": {"us": best_ms * 1e3, "tflops": work / best_ms / 1e9,
                              "runner_up": tuning.config_to_dict(runner_up[1]) if runner_up else None},
                 "configs": {str(hits): tuning.config_to_dict(best)}}
        path = tuning.config_path(device_name, mode, E, H, Ir, args.out_dir)
        if args.dry_run:
            print(json.dumps(entry, indent=2))
        else:
            path.write_text(json.dumps(entry, indent=2) + "\n")
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
