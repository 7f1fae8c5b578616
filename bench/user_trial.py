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

`--checks` first calls what a user calls besides inference, each answer checked: health, metadata,
configuration, statistics and the repository index through both stock clients, /metrics (text and
OpenMetrics), and bad inputs on every protocol (each must get its documented status and a message
naming the problem); a failed check stops the run, listed.

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


def _checks(http: str, grpc: str, cfg) -> list[str]:
    """The documented non-inference answers and refusals; returns what failed (empty: all held)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    hc, gc = httpclient.InferenceServerClient(http), grpcclient.InferenceServerClient(grpc)
    s = httpx.Client(base_url=f"http://{http}", timeout=30)
    failed: list[str] = []

    def check(what: str, ok) -> None:
        try:
            held = bool(ok())
        except Exception as exc:  # noqa: BLE001  a raising check is a failed one, named
            held, what = False, f"{what} ({type(exc).__name__}: {exc})"
        print(f"{'ok ' if held else 'BAD'} {what}")
        if not held:
            failed.append(what)

    def refused(call, status: str, words: str):
        try:
            call()
        except InferenceServerException as exc:
            return str(exc.status()) == status and words in exc.message()
        return False

    def answered(r: httpx.Response, status: int, words: str) -> bool:
        return r.status_code == status and words in r.json()["error"]

    shapes = [[-1, cfg.H], [-1, cfg.K], [-1, cfg.K]]
    for name, c in (("http", hc), ("grpc", gc)):
        as_json = {"as_json": True} if c is gc else {}
        not_found = "StatusCode.NOT_FOUND" if c is gc else "404"
        check(f"{name}: live, ready, model ready",
              lambda c=c: c.is_server_live() and c.is_server_ready() and c.is_model_ready("moe"))
        check(f"{name}: model metadata shapes {shapes}",
              lambda c=c, kw=as_json: _shapes(c.get_model_metadata("moe", **kw)) == shapes)
        check(f"{name}: model config names the inputs",  # gRPC's JSON wraps it in "config"
              lambda c=c, kw=as_json: [t["name"] for t in _config(c.get_model_config("moe", **kw))["input"]] == INPUTS)
        check(f"{name}: statistics of 'moe'",
              lambda c=c, kw=as_json: c.get_inference_statistics("moe", **kw)["model_stats"][0]["name"] == "moe")
        check(f"{name}: unknown model refused",
              lambda c=c, nf=not_found: refused(lambda: c.get_model_metadata("nope"), nf, "unknown model"))
    index = [{"name": "moe", "version": "1", "state": "READY"}]
    check("http: repository index", lambda: hc.get_model_repository_index() == index)
    check("http: load refused saying why",
          lambda: refused(lambda: hc.load_model("moe"), "400", "cannot load or unload"))
    check("/metrics: moe_ready 1", lambda: "\nmoe_ready 1.0\n" in s.get("/metrics").text)
    om = s.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    check("/metrics: OpenMetrics when asked",
          lambda: om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n"))

    ok_ids, ok_w = [list(range(cfg.K))], [[1.0 / cfg.K] * cfg.K]

    def body(rows) -> bytes:
        return json.dumps({"hidden_states": rows, "topk_ids": ok_ids, "topk_weights": ok_w}).encode()

    bad = {  # what: (body, status, words of the message)
        "malformed JSON": (b"{not json", 400, "malformed JSON"),
        "T = 0": (json.dumps({"hidden_states": [], "topk_ids": [], "topk_weights": []}).encode(), 400, "no rows"),
        "wrong H": (body([[0.5] * (cfg.H - 1)]), 400, f"must have shape [T, {cfg.H}]"),
        "NaN": (body([[float("nan")] * cfg.H]), 400, "NaN or infinity"),
        "expert id E": (json.dumps({"hidden_states": [[0.5] * cfg.H], "topk_ids": [[cfg.E] * cfg.K],
                                    "topk_weights": ok_w}).encode(), 400, "is not an expert id"),
    }
    for what, (content, status, words) in bad.items():
        r = s.post("/moe/forward", content=content, headers={"content-type": "application/json"})
        check(f"/moe/forward {what}: {status}", lambda r=r, status=status, words=words: answered(r, status, words))
    r = s.post("/moe/forward", content=bad["wrong H"][0], headers={"content-type": "text/plain"})
    check("/moe/forward text/plain: 415", lambda: answered(r, 415, "Content-Type"))
    r2 = s.post("/v2/models/nope/infer", json={"inputs": []})
    check("v2 unknown model: 404", lambda: answered(r2, 404, "unknown model"))
    arrays = (("hidden_states", np.full((1, cfg.H), np.nan, dtype=np.float32), "FP32"),
              ("topk_ids", np.array(ok_ids, np.int32), "INT32"), ("topk_weights", np.array(ok_w, np.float32), "FP32"))
    ins = []
    for n, a, d in arrays:
        ins.append(grpcclient.InferInput(n, list(a.shape), d))
        ins[-1].set_data_from_numpy(a)
    check("gRPC NaN: INVALID_ARGUMENT",
          lambda: refused(lambda: gc.infer("moe", ins), "StatusCode.INVALID_ARGUMENT", "NaN"))
    return failed


INPUTS = ["hidden_states", "topk_ids", "topk_weights"]


def _config(doc: dict) -> dict:
    return doc.get("config", doc)


def _shapes(meta: dict) -> list[list[int]]:
    return [[int(d) for d in t["shape"]] for t in meta["inputs"]]


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
    p.add_argument("--checks", action="store_true", help="check the non-inference routes and bad inputs first")
    p.add_argument("--beside", default="", help="moe_json:T or moe_st:T, posted in a loop by one more client meanwhile")
    args = p.parse_args()
    cfg = preset(args.preset)
    weights = full_weights(cfg, args.seed)
    gen = torch.Generator().manual_seed(1234)
    if args.checks and (failed := _checks(args.http, args.grpc, cfg)):
        raise SystemExit(f"{len(failed)} check(s) failed: {failed}")
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
