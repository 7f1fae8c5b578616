"""Are a running server's answers right? gRPC and v2 binary, bf16 on the wire, each answer against the
fp32 reference, alone and all at once; a NaN row's error; the wire arena's share of the rows.

    python bench/served_check.py --url http://127.0.0.1:8000 --grpc 127.0.0.1:8001 [--sizes 1,8,100,512,2048]
        [--seed 0] [moe-serve flags ...]

For a GPU host, where the tests' stock clients are not installed: raw gRPC (grpcio) and http.client
only. The layer is what the given `moe-serve` flags (or the server's defaults) make, its synthetic
weights of --seed drawn here in fp32 (on the GPU when there is one: the reference runs there). Every
request (each protocol x each T; distinct rows) is sent once alone and once with all the others at
the same time (so that they share steps); each answer's relative error against the reference must be
at most TOL (a bf16 layer, a bf16 answer). Then a request of T=100 with a NaN at row 37 must be
refused naming that row, over both protocols. Prints one line per check and the growth of
moe_wire_arena_rows_total (the rows the ranks read from the wire arena: v2 binary bodies, and gRPC
messages with --wire-arena-grpc). Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import sys
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import _tensors, grpc_body, grpc_channel, v2_binary_body  # noqa: E402

TOL = 2e-2  # bf16 weights and activations with fp32 accumulation, the answer rounded to bf16 once more
MODEL = "moe"


def weights(cfg, seed: int, device: str):
    """gate, up [E, I, H], down [E, H, I] in fp32 on `device`: the synthetic checkpoint's, drawn in threads."""
    from service.moe.weights import synthetic_expert

    gate = torch.empty(cfg.E, cfg.I, cfg.H, device=device)
    up = torch.empty(cfg.E, cfg.I, cfg.H, device=device)
    down = torch.empty(cfg.E, cfg.H, cfg.I, device=device)

    def fill(e: int) -> None:
        g, u, d = synthetic_expert(cfg, seed, e)
        gate[e].copy_(g)
        up[e].copy_(u)
        down[e].copy_(d)

    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(cfg.E)))
    return gate, up, down


def as_tensors(cfg, tensors):
    """The request's x [T, H] (fp32 of the bf16 sent), ids [T, K] int64, w [T, K] fp32."""
    (_, _, xs, xb), (_, _, ids_s, ib), (_, _, ws, wb) = tensors
    x = torch.frombuffer(bytearray(xb), dtype=torch.bfloat16).view(*xs).float()
    ids = torch.frombuffer(bytearray(ib), dtype=torch.int32).view(*ids_s).long()
    w = torch.frombuffer(bytearray(wb), dtype=torch.float32).view(*ws)
    return x, ids, w


def call_grpc(target: str, body: bytes) -> tuple[str, torch.Tensor | str]:
    """("ok", the answer [T, H] in fp32) or (status code name, message)."""
    import grpc

    from service.api.proto import grpc_predict_v2_pb2 as pb

    channel = grpc_channel(target)
    try:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(body, timeout=60)
    except grpc.RpcError as err:
        return err.code().name, err.details()
    finally:
        channel.close()
    r = pb.ModelInferResponse.FromString(raw)
    shape = list(r.outputs[0].shape)
    return "ok", torch.frombuffer(bytearray(r.raw_output_contents[0]), dtype=torch.bfloat16).view(*shape).float()


def call_v2(url: str, body: bytes, header_len: int) -> tuple[str, torch.Tensor | str]:
    host = url.split("//", 1)[-1]
    conn = http.client.HTTPConnection(host, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/infer", body=body,
                     headers={"Inference-Header-Content-Length": str(header_len),
                              "Content-Type": "application/octet-stream"})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    if r.status != 200:
        return str(r.status), json.loads(data).get("error", "")
    n = int(r.getheader("Inference-Header-Content-Length"))
    shape = json.loads(data[:n])["outputs"][0]["shape"]
    return "ok", torch.frombuffer(bytearray(data[n:]), dtype=torch.bfloat16).view(*shape).float()


def arena_rows(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(next((line.split()[1] for line in text.splitlines() if line.startswith("moe_wire_arena_rows_total")),
                      "nan"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--grpc", default="127.0.0.1:8001")
    p.add_argument("--sizes", default="1,8,100,512,2048")
    p.add_argument("--seed", type=int, default=0)
    args, serve_flags = p.parse_known_args()
    from service.cli import parse_settings
    from service.moe.reference import moe_reference

    settings = parse_settings(serve_flags)
    device, _ = settings.resolve_device()
    cfg = settings.layer_config(device)
    ref_device = "cuda" if torch.cuda.is_available() else "cpu"
    gate, up, down = weights(cfg, settings.seed, ref_device)
    print(f"# {cfg.describe()}; reference on {ref_device}", flush=True)

    work = []  # (protocol, T, send, reference)
    for i, T in enumerate(int(s) for s in args.sizes.split(",")):
        for j, proto in enumerate(("grpc", "v2_binary")):
            tensors = _tensors(cfg, T, seed=1000 + 10 * i + j, wire="bf16")
            x, ids, w = as_tensors(cfg, tensors)
            ref = moe_reference(x.to(ref_device), ids.to(ref_device), w.to(ref_device), gate, up, down).cpu()
            if proto == "grpc":
                body = grpc_body(MODEL, tensors)
                send = lambda body=body: call_grpc(args.grpc, body)  # noqa: E731
            else:
                body, n = v2_binary_body(MODEL, tensors)
                send = lambda body=body, n=n: call_v2(args.url, body, n)  # noqa: E731
            work.append((proto, T, send, ref))

    failed = 0

    def judge(what: str, proto: str, T: int, got, ref) -> None:
        nonlocal failed
        status, out = got
        if status != "ok":
            failed += 1
            print(f"FAIL {what} {proto} T={T}: {status} {out}")
            return
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        ok = out.shape == ref.shape and err <= TOL
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what} {proto} T={T}: relative error {err:.2e}")

    before = arena_rows(args.url)
    for proto, T, send, ref in work:
        judge("alone", proto, T, send(), ref)
    alone = arena_rows(args.url)
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(send) for *_, send, _ in work]
        for (proto, T, _, ref), f in zip(work, futures, strict=True):
            judge("at once", proto, T, f.result(), ref)
    together = arena_rows(args.url)

    tensors = _tensors(cfg, 100, seed=77, wire="bf16")
    x = bytearray(tensors[0][3])
    at = (37 * cfg.H + 3) * 2
    x[at:at + 2] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    bad = [(tensors[0][0], tensors[0][1], tensors[0][2], bytes(x)), *tensors[1:]]
    expected = "hidden_states contains NaN or infinity (row 37)"
    for proto, got in (("grpc", call_grpc(args.grpc, grpc_body(MODEL, bad))),
                       ("v2_binary", call_v2(args.url, *v2_binary_body(MODEL, bad)))):
        ok = got[0] in ("INVALID_ARGUMENT", "400") and expected in str(got[1])
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} NaN row {proto}: {got[0]} {got[1]}")
    sent = sum(T for _, T, _, _ in work)
    print(f"wire arena rows: alone {alone - before:.0f} of {sent}, at once {together - alone:.0f} of {sent}")
    print(f"{'all checks passed' if not failed else f'{failed} check(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
