"""Issue 14i's figures: gzip / deflate request bodies against a real CPU server.

    python3 bench/compressed_bodies.py [--requests N]

Prints: a 1 MiB gzip body that decompresses to 1 GiB (HTTP) and a 256 MiB gRPC message sent gzip
(256 KiB on the wire), both against limits of 4 MiB: the answer, its seconds, the front end's peak
memory growth (VmHWM) and the slowest /v2/health/live meanwhile; then v2 binary requests of
T=64 and T=512 fp32 through tritonclient.http, plain, gzip and deflate, interleaved: the body's
size on the wire and the p50 latency, with its ratio to plain.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time
import zlib

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]  # bench/service.py shadows `service`
sys.path.insert(0, os.path.dirname(_HERE))

LIMIT = 4 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40, help="requests per cell")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.path.dirname(_HERE)
    import grpc
    import httpx
    import tritonclient.http as httpclient

    from bench.hardening import while_probing
    from service.api import grpc_codec
    from service.api.proto import grpc_predict_v2_pb2 as pb
    from tests.api.common import CFG, inputs
    from tests.api.test_e2e import triton_inputs
    from tests.serverproc import ServerProcess, rss_bytes

    log = os.path.join(tempfile.mkdtemp(), "server.log")
    flags = ("--max-request-bytes", str(LIMIT), "--grpc-max-message-bytes", str(LIMIT))
    with ServerProcess.serving(log, *flags) as server:
        print(f"server pid {server.pid}; flags {' '.join(flags)}; load {os.getloadavg()[0]:.1f}")
        stream = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        bomb = b"".join([stream.compress(bytes(1 << 20)) for _ in range(1024)] + [stream.flush()])
        n = 256 << 20
        head = pb.ModelInferRequest(model_name="moe")
        head.inputs.add(name="hidden_states", datatype="FP32", shape=[1, CFG.H])
        message = head.SerializeToString() + grpc_codec.key_and_length(7, n) + bytes(n)

        def http_bomb() -> str:
            r = httpx.post(f"{server.url}/v2/models/moe/infer", content=bomb, headers={"Content-Encoding": "gzip"},
                           timeout=120)
            return str(r.status_code)

        def grpc_bomb() -> str:
            with grpc.insecure_channel(server.grpc_url) as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                           request_serializer=bytes, response_deserializer=bytes)
                try:
                    call(message, compression=grpc.Compression.Gzip, timeout=120)
                    return "OK"
                except grpc.RpcError as e:
                    return e.code().name

        print("| bomb | on the wire | decompressed | answer | s | peak RSS growth MiB | slowest live ms |")
        print("|---|---|---|---|---|---|---|")
        for name, wire, size, send in (("HTTP gzip", len(bomb), 1 << 30, http_bomb),
                                       ("gRPC gzip", None, n, grpc_bomb)):
            before = rss_bytes(server.pid, "VmHWM")
            answer: list[str] = []
            t0 = time.perf_counter()
            worst = while_probing(server.url, lambda s=send, a=answer: a.append(s()))
            took = time.perf_counter() - t0
            grown = (rss_bytes(server.pid, "VmHWM") - before) / 2**20
            print(f"| {name} | {f'{wire >> 10} KiB' if wire else 'grpc-compressed'} | {size >> 20} MiB | "
                  f"{answer[0]} | {took:.2f} | {grown:.1f} | {worst * 1e3:.0f} |")

        client = httpclient.InferenceServerClient(server.http_hostport, connection_timeout=60, network_timeout=60)
        print("\n| T | encoding | body bytes | p50 ms | vs plain |")
        print("|---|---|---|---|---|")
        for T in (64, 512):
            x, ids, w = inputs(T, seed=T)
            tensors = triton_inputs(httpclient, x, ids, w)
            body, _ = client.generate_request_body(tensors)
            # tritonclient's own compression: gzip.compress / zlib.compress at their default levels
            sizes = {"plain": len(body), "gzip": len(gzip.compress(body)), "deflate": len(zlib.compress(body))}
            times: dict[str, list[float]] = {k: [] for k in sizes}
            for _ in range(args.requests):
                for enc in times:
                    t0 = time.perf_counter()
                    client.infer("moe", tensors, request_compression_algorithm=None if enc == "plain" else enc)
                    times[enc].append(time.perf_counter() - t0)
            plain = statistics.median(times["plain"])
            for enc, ts in times.items():
                p50 = statistics.median(ts)
                print(f"| {T} | {enc} | {sizes[enc]:,} | {p50 * 1e3:.2f} | {p50 / plain:.2f} |")
        print(f"load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
