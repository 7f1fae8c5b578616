"""perf_analyzer's --input-data file for the default server's layer: ROWS distinct token rows.

    python bench/pa_rows.py --rows 2048 --out rows.json [--wire-dtype bf16|fp16|fp32] [moe-serve flags ...]

perf_analyzer cannot write BF16 from a JSON list ("Can not use explicit tensor description for bf16
datatype"), so every tensor goes as its raw little-endian bytes in base64 ({"b64": ...}). With
`-b T` perf_analyzer fills a request's T rows from T consecutive data steps (its UpdateInputs:
step (step_index + i) mod steps), so ROWS >= T gives every request T distinct rows, routed over the
experts as bench/serve_load.py's requests are (same generator, bench/serve_load.py `_tensors`), and
the two clients load the server with the same work. The layer's shape is what the given
`moe-serve` flags (or the server's defaults) give; the wire dtype must be the server's declared one.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import WIRE, _tensors  # noqa: E402


def rows(cfg, n: int, seed: int, wire: str) -> list[dict]:
    """n rows, each input's bytes of one token in base64."""
    out = [{} for _ in range(n)]
    for name, _dtype, shape, raw in _tensors(cfg, n, seed=seed, wire=wire):
        width = len(raw) // shape[0]
        for i, row in enumerate(out):
            row[name] = {"b64": base64.b64encode(raw[i * width:(i + 1) * width]).decode()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048, help="distinct token rows (>= perf_analyzer's -b)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wire-dtype", choices=sorted(WIRE), help="default: the layer's dtype (the server declares it)")
    args, serve_flags = p.parse_known_args()
    from service.cli import parse_settings
    from service.config import DTYPE_NAMES

    settings = parse_settings(serve_flags)
    device, _ = settings.resolve_device()
    cfg = settings.layer_config(device)
    wire = args.wire_dtype or {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[DTYPE_NAMES[cfg.dtype]]
    with open(args.out, "w") as f:
        json.dump({"data": rows(cfg, args.rows, args.seed, wire)}, f)
    print(f"# {args.rows} rows of {cfg.describe()} ({WIRE[wire]} hidden_states) in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
