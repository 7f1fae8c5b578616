"""The floor of a small request at c=1: a shared-memory request's bytes and its small answer, over a
bare asyncio HTTP/1.1 echo, a bare grpc.aio echo, the same grpc.aio echo behind the service's
LenientParsing interceptor (service.api.grpc; `--baseline PATH`: also behind another checkout's),
and a synchronous grpc.server echo (its own thread pool), with no front end and no step.

    python bench/grpc_small_floor.py [--seconds 2] [--reps 3] [--baseline /work/main]

The server (one process, one event loop, as the service's) answers every request with a prepared
answer of the size the service sends for a grpc_shm / v2_shm request (a ModelInferResponse / a
JSON body with the output's name, datatype and shape, no data). The client (this process, one
connection, closed loop) is what bench/serve_load.py uses: http.client for HTTP, grpc's own
synchronous client (bytes in, bytes out) for gRPC. Cells alternate, --reps rounds. Prints p50,
mean, and the CPU time per call of the server process and of this client (/proc, process_time:
which side spends it): what grpc.aio's own path for a small call costs above HTTP's, here.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from service.api.proto import grpc_predict_v2_pb2 as pb  # noqa: E402

T, H = 512, 4096
INPUTS = (("hidden_states", "BF16", [T, H], T * H * 2), ("topk_ids", "INT32", [T, 8], T * 32),
          ("topk_weights", "FP32", [T, 8], T * 32))


def _region(params, name: str, offset: int, size: int) -> None:
    params["shared_memory_region"].string_param = name
    params["shared_memory_offset"].int64_param = offset
    params["shared_memory_byte_size"].int64_param = size


def grpc_messages() -> tuple[bytes, bytes]:
    """A grpc_shm request as serve_load.ShmJob builds it, and the service's answer to it."""
    r = pb.ModelInferRequest(model_name="moe")
    for name, datatype, shape, size in INPUTS:
        _region(r.inputs.add(name=name, datatype=datatype, shape=shape).parameters, "in-12345", 0, size)
    _region(r.outputs.add(name="output").parameters, "out-12345", 0, T * H * 2)
    a = pb.ModelInferResponse(model_name="moe", model_version="1")
    a.outputs.add(name="output", datatype="BF16", shape=[T, H])
    return r.SerializeToString(), a.SerializeToString()


def http_messages() -> tuple[bytes, bytes]:
    """A v2_shm body as serve_load.ShmJob builds it, and an answer of the service's size."""
    region = lambda name, size: {"shared_memory_region": name, "shared_memory_offset": 0,  # noqa: E731
                                 "shared_memory_byte_size": size}
    body = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": region("in-12345", b)}
                                  for n, d, s, b in INPUTS],
                       "outputs": [{"name": "output", "parameters": region("out-12345", T * H * 2)}]}).encode()
    output = {"name": "output", "datatype": "BF16", "shape": [T, H], "parameters": {"binary_data_size": T * H * 2}}
    answer = json.dumps({"model_name": "moe", "model_version": "1", "outputs": [output]}).encode()
    return body, answer


class HttpEcho(asyncio.Protocol):
    """Reads a request (headers and content-length bytes), answers a prepared JSON response."""

    answer = b""

    def connection_made(self, transport) -> None:
        self.transport, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin-1").lower()
            length = int(head.split("content-length: ", 1)[1].split("\r\n", 1)[0]) if "content-length: " in head else 0
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                 % len(self.answer) + self.answer)


def serve(http_port: int, bare_port: int, lenient_port: int, sync_port: int, baseline_port: int,
          baseline: str) -> None:
    import importlib.util
    from concurrent import futures

    import grpc

    from service.api.grpc import LenientParsing

    HttpEcho.answer = http_messages()[1]
    answer = grpc_messages()[1]

    async def infer(request: bytes, context) -> bytes:
        return answer

    def generic():
        handler = grpc.unary_unary_rpc_method_handler(infer, request_deserializer=bytes)
        return (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelInfer": handler}),)

    sync_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))  # its own threads
    sync_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(lambda request, context: answer)}),))
    sync_server.add_insecure_port(f"127.0.0.1:{sync_port}")
    sync_server.start()
    variants = [(bare_port, []), (lenient_port, [LenientParsing()])]
    if baseline:  # another checkout's LenientParsing: before/after in one run
        spec = importlib.util.spec_from_file_location("baseline_grpc", os.path.join(baseline, "service/api/grpc.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        variants.append((baseline_port, [module.LenientParsing()]))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(HttpEcho, "127.0.0.1", http_port)
        servers = []
        for port, interceptors in variants:
            g = grpc.aio.server(interceptors=interceptors)
            g.add_generic_rpc_handlers(generic())
            g.add_insecure_port(f"127.0.0.1:{port}")
            await g.start()
            servers.append(g)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_http(port: int, seconds: float) -> list[float]:
    body, answer = http_messages()
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lats: list[float] = []
    end = time.perf_counter() + seconds
    while (t0 := time.perf_counter()) < end:
        conn.request("POST", "/v2/models/moe/infer", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        got = r.read()
        lats.append(time.perf_counter() - t0)
        assert r.status == 200 and len(got) == len(answer), (r.status, len(got))
    conn.close()
    return lats


def run_grpc(port: int, seconds: float) -> list[float]:
    import grpc

    request, answer = grpc_messages()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    call(request, timeout=10)
    lats: list[float] = []
    end = time.perf_counter() + seconds
    while (t0 := time.perf_counter()) < end:
        got = call(request, timeout=10)
        lats.append(time.perf_counter() - t0)
        assert got == answer
    channel.close()
    return lats


def _wait_listening(proc: subprocess.Popen, ports: list[int], timeout_s: float = 120.0) -> None:
    """Until every echo server accepts connections (the server process imports torch and the service
    first: a fixed sleep was too short on the H200 host), or its process exited."""
    end = time.monotonic() + timeout_s
    for port in ports:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the echo servers exited with {proc.returncode} before listening")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > end:
                    raise SystemExit(f"no echo server listens on port {port} after {timeout_s:g} s") from None
                time.sleep(0.1)


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--baseline", default="", help="also a grpc.aio echo behind this checkout's LenientParsing")
    p.add_argument("--serve", nargs=5, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(*args.serve, args.baseline)
        return 0
    ports = [_free_port() for _ in range(5)]
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *map(str, ports),
                             "--baseline", args.baseline])
    try:
        _wait_listening(proc, ports[:4] + ports[4:5] * bool(args.baseline))
        cells = {"http (asyncio echo)": lambda: run_http(ports[0], args.seconds),
                 "grpc.aio echo": lambda: run_grpc(ports[1], args.seconds),
                 "grpc.aio echo + LenientParsing": lambda: run_grpc(ports[2], args.seconds),
                 "grpc.server (sync, thread pool) echo": lambda: run_grpc(ports[3], args.seconds)}
        if args.baseline:
            cells[f"grpc.aio echo + {args.baseline}'s LenientParsing"] = lambda: run_grpc(ports[4], args.seconds)
        results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in cells}
        for _ in range(args.reps):
            for name, cell in cells.items():
                server0, client0 = _cpu_s(proc.pid), time.process_time()
                lats = cell()
                server_s, client_s = _cpu_s(proc.pid) - server0, time.process_time() - client0
                results[name].append((statistics.median(lats) * 1e3, statistics.fmean(lats) * 1e3,
                                      server_s / len(lats) * 1e3, client_s / len(lats) * 1e3))
        print(f"# request {len(grpc_messages()[0])} B (gRPC) / {len(http_messages()[0])} B (HTTP body), "
              f"{args.seconds:g} s per cell, {args.reps} rounds interleaved, {os.cpu_count()} CPU cores")
        print("| server | p50 ms per round | mean ms | server CPU ms per call | client CPU ms per call |")
        print("|---|---|---|---|---|")
        for name, rows in results.items():
            print(f"| {name} | " + " | ".join(" / ".join(f"{r[i]:.3f}" for r in rows) for i in range(4)) + " |")
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
