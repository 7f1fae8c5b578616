"""Start-up cost of reading one rank's slice of a real checkpoint layer, by layout (CPU).

    python bench/load_weights.py [--E 64 --H 2048 --I 768 --R 4] [--dir /tmp/moe-load]

Writes one layer in four layouts (bf16 unless noted) into a model directory each, with
config.json and an index, then times `load_rank_weights` of rank 1 (median of `--iters`; the
files are in the page cache after the first read, so this is the slicing and copying cost, not
the disk's):
  - `per-expert`: experts.{e}.gate_proj / up_proj / down_proj (the baseline of this run);
  - `fused`:      experts.gate_up_proj [E, 2I, H] + experts.down_proj [E, H, I] (transformers);
  - `fused_t`:    the transposed [E, H, 2I] + [E, I, H] (qwen3-vl hub files: strided slices);
  - `fp8`:        per-expert F8_E4M3 with 128x128 weight_scale_inv (dequantized while read).
Prints each time and its ratio to `per-expert`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Run as a script, bench/ would come first on sys.path and bench/service.py shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from service.config import LayerConfig, round_up  # noqa: E402
from service.moe.weights import checkpoint_layer, load_rank_weights  # noqa: E402

BLOCK = 128  # FP8 scale block


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    o, i = w.shape
    pad = torch.zeros(round_up(o, BLOCK), round_up(i, BLOCK))
    pad[:o, :i] = w
    blocks = pad.reshape(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [o/128, i/128]
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:o, :i]
    return (w / full).to(torch.float8_e4m3fn), scale


def write(directory: Path, layout: str, E: int, H: int, I: int) -> None:  # noqa: E741
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(E, I, H, generator=gen) / H ** 0.5 for _ in range(2))
    down = torch.randn(E, H, I, generator=gen) / I ** 0.5
    p = "model.layers.0.mlp."
    t: dict[str, torch.Tensor] = {}
    if layout in ("per-expert", "fp8"):
        for e in range(E):
            for name, m in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
                key = f"{p}experts.{e}.{name}.weight"
                if layout == "fp8":
                    t[key], t[key + "_scale_inv"] = _fp8(m)
                else:
                    t[key] = m.bfloat16()
    elif layout == "fused":
        t[p + "experts.gate_up_proj"] = torch.cat([gate, up], 1).bfloat16()  # [E, 2I, H]
        t[p + "experts.down_proj"] = down.bfloat16()  # [E, H, I]
    else:
        t[p + "experts.gate_up_proj"] = torch.cat([gate, up], 1).transpose(1, 2).contiguous().bfloat16()
        t[p + "experts.down_proj"] = down.transpose(1, 2).contiguous().bfloat16()
    save_file(t, str(directory / "model.safetensors"), metadata={"format": "pt"})
    json.dump({"weight_map": {k: "model.safetensors" for k in t}},
              open(directory / "model.safetensors.index.json", "w"))
    config = {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 8, "hidden_act": "silu"}
    if layout == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    json.dump(config, open(directory / "config.json", "w"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--R", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/moe-load")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one rank's share of a 4-rank CPU host
    base = LayerConfig(E=8, H=8, I=8, K=1, R=args.R, C=16, dtype=torch.bfloat16)
    print(f"# E={args.E} H={args.H} I={args.I} R={args.R}, rank 1's slice, bf16 layer; torch {torch.__version__}; "
          f"{os.cpu_count()} CPU cores")
    times = {}
    for layout in ("per-expert", "fused", "fused_t", "fp8"):
        d = Path(args.dir) / layout
        write(d, layout, args.E, args.H, args.I)
        cfg, spec = checkpoint_layer(base, str(d))
        runs = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            load_rank_weights(str(d), cfg, 1, prefix=spec.prefix)
            runs.append(time.perf_counter() - t0)
        times[layout] = statistics.median(runs)
        print(f"{layout:11s} ({spec.layout:7s} {spec.dtype}): {times[layout] * 1e3:8.1f} ms  "
              f"x{times[layout] / times['per-expert']:.2f} per-expert")


if __name__ == "__main__":
    main()
