"""JSON request decoding and answer encoding on one torch thread, as a served front end runs them
(no server, no network).

    python bench/json_decode.py [--tokens 16] [--reps 40] [--preset seed]

Median milliseconds of decoding a v2 JSON infer body (FP32 hidden_states, INT32 ids) and a
/moe/forward JSON body at the preset's H (seed: 4096), validation included, and of encoding the
[T, H] float32 answer of each (what holds the event loop, and the GIL, per request). To compare two trees,
run it with each tree on PYTHONPATH, interleaved (bench/NOTES.md, "Hardening from a user's trial").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from service.api import codecs
from service.config import preset


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--preset", default="seed")
    args = p.parse_args()
    torch.set_num_threads(1)  # as a served front end (service.fleet.set_frontend_threads)
    cfg = preset(args.preset)
    spec = codecs.ModelSpec.of(cfg, max_tokens=1 << 20)
    gen = torch.Generator().manual_seed(0)
    T = args.tokens
    x = torch.randn(T, cfg.H, generator=gen)
    ids = torch.randint(0, cfg.E, (T, cfg.K), generator=gen)
    w = torch.rand(T, cfg.K, generator=gen)
    v2 = json.dumps({"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": [T, cfg.H], "data": x.flatten().tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": [T, cfg.K], "data": ids.flatten().tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": [T, cfg.K], "data": w.flatten().tolist()}]}).encode()
    forward = json.dumps({"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}).encode()
    req = codecs.decode_v2_http(v2, None, spec)
    print(f"| T={T} H={cfg.H}, median of {args.reps} | v2 JSON ms | /moe/forward JSON ms |")
    print(f"| decode | {median_ms(lambda: codecs.decode_v2_http(v2, None, spec), args.reps):.2f} | "
          f"{median_ms(lambda: codecs.decode_forward_json(forward, spec), args.reps):.2f} |")
    print(f"| encode the answer | {median_ms(lambda: codecs.encode_v2_http(x, req, 'moe'), args.reps):.2f} | "
          f"{median_ms(lambda: codecs.encode_forward_json(x), args.reps):.2f} |")


if __name__ == "__main__":
    main()
