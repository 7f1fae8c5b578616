"""The JSON routes' own latency against a running server, the client's JSON work left out.

    python bench/json_route.py --http 127.0.0.1:8000 [--sizes 8,512] [--calls 40]

One prebuilt body per route and T (/moe/forward JSON, v2 JSON with JSON output), posted --calls
times on one keep-alive connection after 2 warm-up calls; the answer is read, not parsed, inside
the timing (bench/user_trial.py's moe_json and v2_json also time the client's json.dumps/loads,
~150 ms of its ~250 ms at T=512). Each route's answer is parsed once, outside the timing, and
compared with the fp32 reference (a wrong one stops the run). Table: route, T, p50 / p90 / max ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx
import torch

from bench.user_trial import _inputs
from service.config import preset
from service.moe.reference import full_weights, moe_reference


def bodies(x, ids, w) -> dict[str, tuple[str, bytes]]:
    v2 = {"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": list(x.shape), "data": x.flatten().tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": list(ids.shape), "data": ids.flatten().tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": list(w.shape), "data": w.flatten().tolist()}]}
    forward = {"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}
    return {"moe_json": ("/moe/forward", json.dumps(forward).encode()),
            "v2_json": ("/v2/models/moe/infer", json.dumps(v2).encode())}


def answer(route: str, content: bytes, shape) -> torch.Tensor:
    doc = json.loads(content)
    data = doc["output"] if route == "moe_json" else doc["outputs"][0]["data"]
    return torch.tensor(data, dtype=torch.float32).reshape(shape)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--http", default="127.0.0.1:8000")
    p.add_argument("--sizes", default="8,512")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="cpu")
    args = p.parse_args()
    cfg = preset(args.preset)
    weights = full_weights(cfg, args.seed)
    gen = torch.Generator().manual_seed(4321)
    lines = [f"{'route':<10} {'T':>4} {'calls':>5} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8}"]
    with httpx.Client(base_url=f"http://{args.http}", timeout=60) as c:
        for T in (int(s) for s in args.sizes.split(",")):
            x, ids, w = _inputs(cfg, T, gen)
            ref = moe_reference(x, ids.long(), w, *weights).double()
            for route, (path, body) in bodies(x, ids, w).items():
                times = []
                for i in range(args.calls + 2):
                    t0 = time.perf_counter()
                    r = c.post(path, content=body, headers={"content-type": "application/json"})
                    r.raise_for_status()
                    ms = (time.perf_counter() - t0) * 1e3
                    if i >= 2:
                        times.append(ms)
                err = float((answer(route, r.content, x.shape).double() - ref).norm() / ref.norm())
                if not err <= 1e-5:
                    raise SystemExit(f"{route} T={T}: relative error {err:.2e}")
                times.sort()
                lines.append(f"{route:<10} {T:>4} {len(times):>5} {statistics.median(times):>8.2f} "
                             f"{times[int(0.9 * len(times))]:>8.2f} {times[-1]:>8.2f}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
