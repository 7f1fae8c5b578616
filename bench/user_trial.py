"""A user's latency check of a running CPU server: every documented route through the stock clients.

    python bench/user_trial.py --http 127.0.0.1:8000 --grpc 127.0.0.1:8001 [--sizes 1,8,512] [--calls 50]
        [--routes moe_json,moe_st,v2_json,v2_binary,grpc,curl_json,v2_shm,grpc_shm]

Each route is called as README shows it: `/moe/forward` with httpx (JSON, safetensors) and with curl
(one process and one connection per call, as the pasted example), the v2 routes with
tritonclient.http (JSON, binary tensors), gRPC with tritonclient.grpc, and Triton's system shared
memory through both clients (the server needs `--shared-memory system`). Every answer is compared
with the fp32 reference (synthetic weights of --seed, the cpu preset); a wrong one stops the run.
The table: route, T, calls, p50 / p90 / max ms, and how many calls took over 30 ms (the ~40 ms
delayed-ACK stall, a ~200 ms retransmit or a 1 s stall shows there, not in the p50 alone).

`--beside FORMAT:T` (`moe_json:512` or `moe_st:512`) keeps one more client (its own process and
connection) posting one prebuilt /moe/forward body of T tokens in a loop while the table is
measured: what one large request of that format costs every other client of the same front end
(head-of-line blocking).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
import torch
from safetensors.torch import load, save

from service.config import preset
from service.moe.reference import full_weights, moe_reference

STALL_MS = 30.0  # a CPU-default call at T <= 8 takes a few ms; a fixed stall is 40 ms or more
ROUTES = ("moe_json", "moe_st", "v2_json", "v2_binary", "grpc", "curl_json", "v2_shm", "grpc_shm")


def _inputs(cfg, T: int, gen: torch.Generator):
    x = torch.randn(T, cfg.H, generator=gen)                                   # [T, H]
    ids = torch.stack([torch.randperm(cfg.E, generator=gen)[:cfg.K] for _ in range(T)]).int()  # [T, K]
    w = torch.softmax(torch.randn(T, cfg.K, generator=gen), -1)                # [T, K]
    return x, ids, w


class Routes:
    def __init__(self, http: str, grpc: str):
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        self.http_addr = http
        self.session = httpx.Client(base_url=f"http://{http}", timeout=30)
        self.hc = httpclient.InferenceServerClient(http)
        self.gc = grpcclient.InferenceServerClient(grpc)
        self.httpclient, self.grpcclient = httpclient, grpcclient
        self.regions: dict = {}

    def moe_json(self, x, ids, w):
        body = {"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}
        r = self.session.post("/moe/forward", json=body)
        r.raise_for_status()
        return torch.tensor(r.json()["output"])

    def moe_st(self, x, ids, w):
        body = save({"hidden_states": x, "topk_ids": ids, "topk_weights": w})
        r = self.session.post("/moe/forward", content=body, headers={"content-type": "application/x-safetensors"})
        r.raise_for_status()
        return load(r.content)["output"]

    def curl_json(self, x, ids, w):
        body = json.dumps({"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()})
        out = subprocess.run(["curl", "-sS", "--fail-with-body", f"http://{self.http_addr}/moe/forward",
                              "-H", "content-type: application/json", "--data-binary", "@-"],
                             input=body.encode(), capture_output=True, check=True, timeout=30).stdout
        return torch.tensor(json.loads(out)["output"])

    def _v2(self, client, x, ids, w, binary: bool | None, shm: bool):
        arrays = (("hidden_states", x.numpy(), "FP32"), ("topk_ids", ids.numpy(), "INT32"),
                  ("topk_weights", w.numpy(), "FP32"))
        inputs = [client.InferInput(n, list(a.shape), d) for n, a, d in arrays]
        if not shm:
            for i, (_, a, _) in enumerate(arrays):
                if binary is None:
                    inputs[i].set_data_from_numpy(a)
                else:
                    inputs[i].set_data_from_numpy(a, binary_data=binary)
            out = client.InferRequestedOutput("output") if binary is None else \
                client.InferRequestedOutput("output", binary_data=binary)
            c = self.gc if client is self.grpcclient else self.hc
            return torch.from_numpy(c.infer("moe", inputs, outputs=[out]).as_numpy("output").copy())
        return self._shm(client, inputs, arrays, x)

    def _shm(self, client, inputs, arrays, x):
        import tritonclient.utils.shared_memory as shm
        c = self.gc if client is self.grpcclient else self.hc
        key = (id(c), x.shape[0])
        if key not in self.regions:
            nbytes = sum(a.nbytes for _, a, _ in arrays)
            tag = f"t14k_{'g' if c is self.gc else 'h'}{x.shape[0]}"
            inp = shm.create_shared_memory_region(f"{tag}_in", f"/{tag}_in", nbytes)
            out = shm.create_shared_memory_region(f"{tag}_out", f"/{tag}_out", x.numpy().nbytes)
            c.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", nbytes)
            c.register_system_shared_memory(f"{tag}_out", f"/{tag}_out", x.numpy().nbytes)
            self.regions[key] = (tag, inp, out, c)
        tag, inp, out, _ = self.regions[key]
        shm.set_shared_memory_region(inp, [a for _, a, _ in arrays])
        at = 0
        for i, (_, a, _) in enumerate(arrays):
            inputs[i].set_shared_memory(f"{tag}_in", a.nbytes, offset=at)
            at += a.nbytes
        o = client.InferRequestedOutput("output")
        o.set_shared_memory(f"{tag}_out", x.numpy().nbytes)
        c.infer("moe", inputs, outputs=[o])
        return torch.from_numpy(shm.get_contents_as_numpy(out, np.float32, list(x.shape)).copy())

    def v2_json(self, x, ids, w):
        return self._v2(self.httpclient, x, ids, w, False, False)

    def v2_binary(self, x, ids, w):
        return self._v2(self.httpclient, x, ids, w, True, False)

    def grpc(self, x, ids, w):
        return self._v2(self.grpcclient, x, ids, w, None, False)

    def v2_shm(self, x, ids, w):
        return self._v2(self.httpclient, x, ids, w, None, True)

    def grpc_shm(self, x, ids, w):
        return self._v2(self.grpcclient, x, ids, w, None, True)

    def close(self):
        import tritonclient.utils.shared_memory as shm
        for tag, inp, out, c in self.regions.values():
            c.unregister_system_shared_memory(f"{tag}_in")
            c.unregister_system_shared_memory(f"{tag}_out")
            shm.destroy_shared_memory_region(inp)
            shm.destroy_shared_memory_region(out)


def _loop(http: str, beside: str, cfg, stop) -> None:
    """POST one prebuilt /moe/forward body (moe_json or moe_st) in a loop; the answer is read, not parsed."""
    name, T = beside.split(":")
    x, ids, w = _inputs(cfg, int(T), torch.Generator().manual_seed(99))
    if name == "moe_json":
        body = json.dumps({"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}).encode()
        kind = "application/json"
    else:
        body, kind = save({"hidden_states": x, "topk_ids": ids, "topk_weights": w}), "application/x-safetensors"
    with httpx.Client(base_url=f"http://{http}", timeout=30) as c:
        while not stop.is_set():
            c.post("/moe/forward", content=body, headers={"content-type": kind}).raise_for_status()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--http", default="127.0.0.1:8000")
    p.add_argument("--grpc", default="127.0.0.1:8001")
    p.add_argument("--sizes", default="1,8,512")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--routes", default=",".join(ROUTES[:6]))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="cpu")
    p.add_argument("--beside", default="", help="moe_json:T or moe_st:T, posted in a loop by one more client meanwhile")
    args = p.parse_args()
    cfg = preset(args.preset)
    weights = full_weights(cfg, args.seed)
    gen = torch.Generator().manual_seed(1234)
    rows = []
    ctx = mp.get_context("spawn")  # never fork a process that holds grpc channels
    stop = ctx.Event()
    beside = None
    if args.beside:  # its own process: its client-side encoding must not hold this one's GIL
        beside = ctx.Process(target=_loop, args=(args.http, args.beside, cfg, stop), daemon=True)
        beside.start()
        time.sleep(1.0)
    routes = Routes(args.http, args.grpc)
    try:
        for T in (int(s) for s in args.sizes.split(",")):
            for name in args.routes.split(","):
                call = getattr(routes, name)
                times = []
                for i in range(args.calls + 2):
                    x, ids, w = _inputs(cfg, T, gen)
                    t0 = time.perf_counter()
                    out = call(x, ids, w)
                    ms = (time.perf_counter() - t0) * 1e3
                    ref = moe_reference(x, ids.long(), w, *weights)
                    err = float((out.double() - ref.double()).norm() / ref.double().norm())
                    if not err <= 1e-5:
                        raise SystemExit(f"{name} T={T} call {i}: relative error {err:.2e}")
                    if i >= 2:  # two warm-up calls: connection set-up, the first region registered
                        times.append(ms)
                times.sort()
                rows.append((name, T, len(times), statistics.median(times), times[int(0.9 * len(times))],
                             times[-1], sum(t > STALL_MS for t in times)))
    finally:
        stop.set()
        if beside is not None:
            beside.join(timeout=60)
        routes.close()
    out = io.StringIO()
    if args.beside:
        out.write(f"(beside one client sending {args.beside} in a loop)\n")
    out.write(f"{'route':<10} {'T':>4} {'calls':>5} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8} {'>30ms':>6}\n")
    for name, T, n, p50, p90, mx, slow in rows:
        out.write(f"{name:<10} {T:>4} {n:>5} {p50:>8.2f} {p90:>8.2f} {mx:>8.2f} {slow:>6}\n")
    sys.stdout.write(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
