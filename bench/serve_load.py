"""Served tokens/s and latency against the layer alone at the same step shape, in one run.

    python bench/serve_load.py [--url http://HOST:8000 --grpc HOST:8001] [--protocols v2_binary,grpc,v2_shm,grpc_shm]
        [--sizes 512,2048] [--concurrency 1,4,16] [--wire-dtype bf16] [--seconds 5] [moe-serve flags ...]

Without --url a `moe-serve` process is started with the remaining flags (`python -m service ...`,
as a user would) and stopped at the end; with --url/--grpc the running server is loaded. The
layer shape (for the direct figure and the request shapes) is what those flags or the server's
defaults give (pass the same flags as the server's when targeting one).

Load: closed loop, one client *process* per concurrent caller with one connection each, so that the
load generator is not the bottleneck. Request bodies are built before the timed loop (v2 binary:
the JSON header and the raw tensors; gRPC: the serialized ModelInferRequest sent as bytes), so a
cell times the wire, the server and reading the answer, not client-side tensor conversion. The
answer's tensor is viewed in the received bytes, not copied out of them (as tritonclient's
np.frombuffer does; until 2026-12-05 each call sliced a copy, ~0.3-1 ms per 4 MiB). Each answer's
size is checked; one answer per cell is checked for finite values.

v2_shm and grpc_shm: Triton's system shared-memory extension (the server needs `--shared-memory
system`; one is added to the flags of a server started here). Each client process creates its own
input and output objects in /dev/shm, writes the tensors once, registers both regions (over HTTP
or gRPC, before the timed loop) and then sends requests that carry only the regions' names (a JSON
body; a small ModelInferRequest): the answer lands in its output region, which is what the client
then reads (as a view: a client on the same host reads it in place). Regions are unregistered at
the end of each cell.

Direct: the same layer (preset, backend, C, synthetic weights of the same seed) built in this
process on R=1, fed the way the rank feeds it (rows already in the layer's input buffers), timed
over --direct-steps steps at the step shape the server runs: min(R*C, T * concurrency) tokens.
It runs after the load (never at the same time on the same device). At R > 1 the direct figure
is bench/multigpu.py layer's job and is not printed here.

The table: protocol, T, concurrency, requests, tokens/s, p50/p99 ms, the direct tokens/s at that
step shape and the ratio; then the server's own moe_layer_seconds over the load (device busy).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

WIRE = {"bf16": "BF16", "fp16": "FP16", "fp32": "FP32"}
# bytes per value, and how a non-finite value looks in its bits (numpy dtype, mask, exponent all ones)
WIRE_BITS = {"bf16": (2, ("uint16", 0x7FFF, 0x7F80)), "fp16": (2, ("uint16", 0x7FFF, 0x7C00)),
             "fp32": (4, ("uint32", 0x7FFFFFFF, 0x7F800000))}
START_TIMEOUT_S = 300.0
SHM_PROTOCOLS = ("v2_shm", "grpc_shm")  # Triton's system shared memory over HTTP, gRPC


# ---- request bodies (built once, before any timing) ---------------------------------------------


def _tensors(cfg, T: int, seed: int, wire: str):
    """Raw little-endian bytes of x [T, H] (wire dtype), ids [T, K] int32, w [T, K] fp32."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.H, generator=gen).to({"bf16": torch.bfloat16, "fp16": torch.float16,
                                                   "fp32": torch.float32}[wire])      # [T, H]
    ids = torch.argsort(torch.rand(T, cfg.E, generator=gen), dim=1)[:, :cfg.K].int()  # [T, K] distinct experts
    w = torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1)                    # [T, K]
    raw = lambda t: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()  # noqa: E731
    return [("hidden_states", WIRE[wire], [T, cfg.H], raw(x)), ("topk_ids", "INT32", [T, cfg.K], raw(ids)),
            ("topk_weights", "FP32", [T, cfg.K], raw(w))]


def v2_binary_body(model: str, tensors) -> tuple[bytes, int]:
    header = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
                                    for n, d, s, b in tensors],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    return header + b"".join(b for *_, b in tensors), len(header)


def grpc_body(model: str, tensors) -> bytes:
    from service.api.proto import grpc_predict_v2_pb2 as pb

    r = pb.ModelInferRequest(model_name=model)
    for n, d, s, b in tensors:
        r.inputs.add(name=n, datatype=d, shape=s)
        r.raw_input_contents.append(b)
    return r.SerializeToString()


# ---- system shared memory (a client on the same host) -------------------------------------------


class ShmJob:
    """A client's shared-memory objects for one cell: the inputs written once, both regions registered;
    `body` is the request naming them, `answer` a view of the output region."""

    def __init__(self, proto: str, target, path: str, tensors, out_bytes: int):
        import mmap
        import uuid

        self.proto, self.target = proto, target
        tag = f"bench-shm-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # (not "/moe-...": the server's own names)
        self.names = (f"{tag}-in", f"{tag}-out")
        size_in = sum(len(b) for *_, b in tensors)
        self.files, self.maps = [], []
        for name, size in zip(self.names, (size_in, out_bytes), strict=True):
            fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here (ENOSPC), not as a SIGBUS later
            self.maps.append(mmap.mmap(fd, size))
            os.close(fd)
            self.files.append(f"/dev/shm/{name}")
        at, inputs = 0, []
        for name, dtype, shape, raw in tensors:
            self.maps[0][at:at + len(raw)] = raw
            inputs.append((name, dtype, shape, at, len(raw)))
            at += len(raw)
        self.answer = memoryview(self.maps[1])
        model = path.split("/")[3]  # /v2/models/{model}/infer
        try:
            for name, size in zip(self.names, (size_in, out_bytes), strict=True):
                self._call("register", name, {"key": f"/{name}", "offset": 0, "byte_size": size})
        except BaseException:  # no files left behind in /dev/shm
            self.close()
            raise
        region = lambda name, offset, size: {"shared_memory_region": name, "shared_memory_offset": offset,  # noqa: E731
                                             "shared_memory_byte_size": size}
        if proto == "v2_shm":
            self.body = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": region(
                self.names[0], o, b)} for n, d, s, o, b in inputs],
                "outputs": [{"name": "output", "parameters": region(self.names[1], 0, out_bytes)}]}).encode()
        else:
            from service.api.proto import grpc_predict_v2_pb2 as pb

            r = pb.ModelInferRequest(model_name=model)
            for n, d, s, o, b in inputs:
                item = r.inputs.add(name=n, datatype=d, shape=s)
                _grpc_region(item.parameters, self.names[0], o, b)
            _grpc_region(r.outputs.add(name="output").parameters, self.names[1], 0, out_bytes)
            self.body = r.SerializeToString()

    def _call(self, what: str, name: str, doc: dict | None = None) -> None:
        """register (doc: key, offset, byte_size) or unregister region `name`, over the cell's protocol."""
        if self.proto == "v2_shm":
            req = urllib.request.Request(f"{self.target}/v2/systemsharedmemory/region/{name}/{what}", method="POST",
                                         data=json.dumps(doc or {}).encode() if doc else b"")
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
            return
        from service.api.proto import grpc_predict_v2_pb2 as pb

        channel = grpc_channel(self.target)
        try:
            method = f"/inference.GRPCInferenceService/SystemSharedMemory{what.capitalize()}"
            message = (pb.SystemSharedMemoryRegisterRequest(name=name, **doc) if doc
                       else pb.SystemSharedMemoryUnregisterRequest(name=name))
            channel.unary_unary(method)(message.SerializeToString(), timeout=30)
        finally:
            channel.close()

    def close(self) -> None:
        for name in self.names:
            try:
                self._call("unregister", name)
            except Exception:  # noqa: BLE001  the server may be gone; the files go anyway
                pass
        self.answer.release()
        for m in self.maps:
            m.close()
        for f in self.files:
            os.unlink(f)


def _grpc_region(params, name: str, offset: int, size: int) -> None:
    params["shared_memory_region"].string_param = name
    params["shared_memory_offset"].int64_param = offset
    params["shared_memory_byte_size"].int64_param = size


# ---- client processes ---------------------------------------------------------------------------


def grpc_channel(target):
    """The bench client's channel: `target` is "host:port", or (host:port, extra channel options) when
    a benchmark sets what a user's client could (bench/frontend_load.py's `@client=VARIANT`)."""
    import grpc

    address, extra = (target, ()) if isinstance(target, str) else target
    return grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30),
                                                   ("grpc.max_send_message_length", 1 << 30), *extra])


def _client(conn) -> None:
    """A client process: jobs (proto, target, path, body, header_len, out_bytes, finite, start_at,
    stop_at) in, latencies out; one connection per job, opened and warmed up before start_at.
    `finite` = (numpy dtype of the bits, mask, exponent all ones) checks the first answer's values."""
    import http.client

    while True:
        job = conn.recv()
        if job is None:
            return
        proto, target, path, body, header_len, out_bytes, finite, start_at, stop_at = job
        shm = ShmJob(proto, target, path, body, out_bytes) if proto in SHM_PROTOCOLS else None
        if shm is not None:
            body, header_len = shm.body, len(shm.body)
        if proto in ("grpc", "grpc_shm"):
            channel = grpc_channel(target)
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out

            def once(call=call, body=body, out_bytes=out_bytes, shm=shm) -> bytes:  # bound: B023
                got = call(body, timeout=120)
                return shm.answer if shm is not None else memoryview(got)[-out_bytes:]
        else:
            host, port = target.removeprefix("http://").split(":")
            c = http.client.HTTPConnection(host, int(port), timeout=120)
            headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_len)}

            def once(c=c, path=path, body=body, headers=headers, shm=shm) -> bytes:  # bound: B023
                c.request("POST", path, body=body, headers=headers)
                r = c.getresponse()
                data = r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
                if shm is not None:
                    return shm.answer
                return memoryview(data)[int(r.getheader("Inference-Header-Content-Length")):]
        try:
            conn.send(("ok", timed_calls(once, out_bytes, finite, start_at, stop_at), time.time()))
        except Exception as e:  # noqa: BLE001  reported by the parent
            conn.send(("error", f"{type(e).__name__}: {e}", time.time()))
        finally:
            if proto in ("grpc", "grpc_shm"):
                channel.close()
            else:
                c.close()
            if shm is not None:
                shm.close()


def timed_calls(once, out_bytes: int, finite, start_at: float, stop_at: float) -> list[float]:
    """One warm-up call (connection, first allocations; its answer's size and values checked), then
    `once()` in a closed loop from start_at to stop_at: the latencies (s). `once` returns the
    answer's tensor bytes; `finite` = (numpy dtype of the bits, mask, exponent all ones)."""
    import numpy as np

    first = once()
    if len(first) != out_bytes:
        raise RuntimeError(f"answer has {len(first)} bytes, expected {out_bytes}")
    dtype, mask, inf = finite
    if int((np.frombuffer(first, dtype=dtype) & mask).max()) >= inf:
        raise RuntimeError("non-finite values in the answer")
    lats = []
    time.sleep(max(0.0, start_at - time.time()))
    while time.time() < stop_at:
        t0 = time.perf_counter()
        got = once()
        lats.append(time.perf_counter() - t0)
        if len(got) != out_bytes:
            raise RuntimeError(f"answer has {len(got)} bytes, expected {out_bytes}")
    return lats


# ---- a raw-socket HTTP client --------------------------------------------------------------------


def _raw_once(sock: socket.socket, request: bytes, view: memoryview, stamps: list) -> bytes:
    """One request on a raw socket: the answer's tensor bytes; (send start, sent, first answer byte,
    answer read) appended to `stamps`."""
    t0 = time.perf_counter()
    sock.sendall(request)
    t1 = time.perf_counter()
    n = sock.recv_into(view)
    t2 = time.perf_counter()
    buf = view.obj
    end = buf.find(b"\r\n\r\n", 0, n)
    while end < 0:
        n += sock.recv_into(view[n:])
        end = buf.find(b"\r\n\r\n", 0, n)
    headers = bytes(buf[:end]).decode("latin-1").lower().split("\r\n")
    if not headers[0].startswith("http/1.1 200"):
        raise RuntimeError(f"{headers[0]}: {bytes(buf[end:n])[:300]!r}")
    fields = dict(h.split(": ", 1) for h in headers[1:])
    total = end + 4 + int(fields["content-length"])
    json_len = int(fields.get("inference-header-content-length", total - end - 4))  # (none: JSON alone)
    if total > len(buf):
        raise RuntimeError(f"an answer of {total} bytes, more than expected")
    while n < total:
        n += sock.recv_into(view[n:total])
    stamps.append((t0, t1, t2, time.perf_counter()))
    return bytes(view[end + 4 + json_len:total])


def raw_client(conn) -> None:
    """`_client`'s protocol (jobs in; latencies and each request's stamps out): HTTP over a
    raw socket (the whole request sent with one sendall, the answer read with recv_into into one
    buffer), gRPC through grpc's own client (bytes in, bytes out; stamps: call start and end)."""
    while True:
        job = conn.recv()
        if job is None:
            return
        proto, target, path, body, header_len, out_bytes, finite, start_at, stop_at = job
        stamps: list[tuple] = []
        closing: list = []
        try:
            shm = ShmJob(proto, target, path, body, out_bytes) if proto in SHM_PROTOCOLS else None
            if shm is not None:
                closing.append(shm)
                body, header_len = shm.body, len(shm.body)
            if proto in ("grpc", "grpc_shm"):
                channel = grpc_channel(target)
                closing.append(channel)
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

                def once(call=call, body=body, stamps=stamps, out_bytes=out_bytes, shm=shm) -> bytes:  # bound: B023
                    t0 = time.perf_counter()
                    got = call(body, timeout=120)
                    t3 = time.perf_counter()
                    stamps.append((t0, t0, t3, t3))
                    return shm.answer if shm is not None else memoryview(got)[-out_bytes:]
            else:
                host, port = target.removeprefix("http://").split(":")
                sock = socket.create_connection((host, int(port)))
                closing.append(sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
                        f"Inference-Header-Content-Length: {header_len}\r\nContent-Length: {len(body)}\r\n\r\n")
                request, view = head.encode() + body, memoryview(bytearray(out_bytes + (1 << 16)))

                def once(sock=sock, request=request, view=view, stamps=stamps, shm=shm) -> bytes:  # bound: B023
                    got = _raw_once(sock, request, view, stamps)
                    return shm.answer if shm is not None else got
            lats = timed_calls(once, out_bytes, finite, start_at, stop_at)
            conn.send(("ok", lats, time.time(), stamps[1:]))  # stamps[0]: the warm-up call
        except Exception as e:  # noqa: BLE001  reported by the parent
            conn.send(("error", f"{type(e).__name__}: {e}", time.time(), []))
        finally:
            for c in reversed(closing):  # the connection first, then the regions
                c.close()


class Clients:
    def __init__(self, n: int, target=None):
        """`n` client processes running `target` (default `_client`)."""
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=target or _client, args=(b,), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)

    def run(self, c: int, job: tuple, seconds: float, probe=None) -> tuple[list[float], float, list]:
        """Latencies, the cell's wall time, and the per-request timestamps of clients that keep them;
        `probe()`, when given, is called once in the middle of the timed loop (its value in self.probed)."""
        start_at = time.time() + 1.0 + 0.05 * c  # room for every client's connection and warm-up
        stop_at = start_at + seconds
        for conn in self.conns[:c]:
            conn.send((*job, start_at, stop_at))
        self.probed = None
        if probe is not None:
            time.sleep(max(0.0, start_at + seconds / 2 - time.time()))
            self.probed = probe()
        lats, end, stamps = [], start_at, []
        for conn in self.conns[:c]:
            status, value, t, *more = conn.recv()
            if status != "ok":
                raise RuntimeError(f"client failed: {value}")
            lats += value
            stamps += more[0] if more else []
            end = max(end, t)
        return lats, end - start_at, stamps

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for p in self.procs:
            p.join(10)


def tcp_inodes(port: int, remote: int | None = None) -> set[str]:
    """The socket inodes of the established TCP connections whose local port is `port` (and remote port
    `remote`, when given), read from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, peer = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
                    if local == port and cols[3] == "01" and remote in (None, peer):  # 01: ESTABLISHED
                        inodes.add(cols[9])
        except OSError:
            continue
    return inodes


def socket_holders(inodes: set[str]) -> dict[str, int]:
    """pid -> how many of the sockets `inodes` its descriptors hold (the processes /proc lets us read)."""
    counts: dict[str, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    counts[pid] = counts.get(pid, 0) + 1
        except OSError:
            continue
    return counts


def connection_spread(port: int) -> str:
    """How the established connections to local TCP `port` are spread over processes, read from /proc:
    the counts per process, largest first ("2+1+1": 3 processes hold 4 connections), "" where /proc
    says nothing. With SO_REUSEPORT (several front ends) the kernel hashes each connection to one
    process; 4 connections land on 4 different ones only ~9 % of the time."""
    counts = socket_holders(tcp_inodes(port))
    return "+".join(str(n) for n in sorted(counts.values(), reverse=True))


# ---- the server -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def start_server(flags: list[str], log_path: str):
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--log-level", "WARNING", *flags]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moe-serve exited with {proc.returncode}; see {log_path}")
        if _get(url + "/v2/health/ready", 2)[0] == 200:
            return proc, url, f"127.0.0.1:{grpc_port}"
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError(f"moe-serve was not ready within {START_TIMEOUT_S} s; see {log_path}")


def wait_ready(url: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while _get(url + "/v2/health/ready", 2)[0] != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready within {wait_s} s")
        time.sleep(0.3)


def layer_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of moe_layer_seconds over every backend label, from /metrics; (0, 0) from a
    server without them (bench/frontend_floor.py's echo: the load's table is what it is run for)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    status, text = _get(url + "/metrics")
    try:
        families = list(text_string_to_metric_families(text.decode())) if status == 200 else []
    except ValueError:
        families = []
    for fam in families:
        if fam.name == "moe_layer_seconds":
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
    return total, count


# ---- the layer alone ----------------------------------------------------------------------------


def direct_tokens_per_s(cfg, backend: str, seed: int, device: str, steps: list[int], iters: int) -> dict[int, dict]:
    """{n: {"s": median step seconds, "tok_s": n / s, "backend": name}} of the layer alone on R=1."""
    import torch

    from service.moe.layer import make_layer
    from service.moe.weights import synthetic_rank_weights

    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)  # the rank's device: GPU 0 at R=1
        torch.cuda.set_device(dev)
    layer = make_layer(cfg, synthetic_rank_weights(cfg, 0, seed, device=dev), rank=0, device=dev, backend=backend)
    out = {}
    seq = 0
    for n in steps:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(n, cfg.H, generator=gen).to(cfg.dtype)
        ids = torch.argsort(torch.rand(n, cfg.E, generator=gen), dim=1)[:, :cfg.K].int()
        w = torch.softmax(torch.randn(n, cfg.K, generator=gen), dim=1)
        rows = (x.to(dev), ids.to(dev), w.to(dev))
        if layer.inputs is not None:  # as the rank does: rows in the layer's own input buffers
            rows = tuple(buf[:n].copy_(t) for buf, t in zip(layer.inputs, rows, strict=True))
        times = []
        for i in range(iters + 5):
            seq += 1
            t0 = time.perf_counter()
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                layer.forward(*rows, seq)
                end.record()
                end.synchronize()
                dt = start.elapsed_time(end) / 1e3
            else:
                layer.forward(*rows, seq)
                dt = time.perf_counter() - t0
            layer.check_seq(seq)
            if i >= 5:
                times.append(dt)
        s = statistics.median(times)
        out[n] = {"s": s, "tok_s": n / s, "backend": layer.name}
    return out


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server's HTTP base URL (else one is started)")
    p.add_argument("--grpc", help="the running server's gRPC host:port")
    p.add_argument("--model", default="moe")
    p.add_argument("--protocols", default="v2_binary,grpc",
                   help="v2_binary, grpc, v2_shm, grpc_shm (Triton's system shared memory: a client on this host)")
    p.add_argument("--sizes", default="512,2048", help="tokens per request T, comma-separated")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent client processes, comma-separated")
    p.add_argument("--wire-dtype", default="bf16", choices=sorted(WIRE),
                   help="hidden_states and the answer on the wire")
    p.add_argument("--seconds", type=float, default=5.0, help="timed seconds per cell")
    p.add_argument("--direct-steps", type=int, default=50, help="timed steps of the layer alone per step shape")
    p.add_argument("--no-direct", action="store_true", help="skip the layer alone (e.g. another process owns the GPU)")
    p.add_argument("--client", default="stock", choices=("stock", "raw"),
                   help="HTTP through http.client (what a user's script does) or a raw socket (one sendall, "
                        "recv_into one buffer: what the server alone costs); gRPC is grpc's own client either way")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each cell this many times (new connections each time: a fresh SO_REUSEPORT spread)")
    p.add_argument("--spread", action="store_true",
                   help="report how each cell's connections spread over the server's processes (read from /proc)")
    p.add_argument("--json", help="write the figures here")
    args, serve_flags = p.parse_known_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    conc = [int(c) for c in args.concurrency.split(",")]
    protocols = args.protocols.split(",")

    from service.cli import parse_settings

    if set(protocols) & set(SHM_PROTOCOLS) and not args.url and "--shared-memory" not in serve_flags:
        serve_flags += ["--shared-memory", "system"]
    settings = parse_settings(serve_flags)
    device, why = settings.resolve_device()
    cfg = settings.layer_config(device)
    print(f"# {cfg.describe()} on {device} ({why}); backend {settings.backend}; {os.cpu_count()} CPU cores; "
          f"wire {args.wire_dtype}; {args.client} HTTP client; {args.seconds:g} s per cell; concurrency {conc}",
          flush=True)
    clients = Clients(max(conc), raw_client if args.client == "raw" else None)  # before any CUDA use here
    proc = None
    results = []
    try:
        if args.url:
            url, grpc_target = args.url, args.grpc or "127.0.0.1:8001"
            wait_ready(url, START_TIMEOUT_S)
        else:
            log_path = os.path.join(tempfile.gettempdir(), f"moe-serve-load-{os.getpid()}.log")
            proc, url, grpc_target = start_server(serve_flags, log_path)
            print(f"# started moe-serve (--http-impl {settings.http_impl}, log {log_path})", flush=True)
        before = layer_seconds(url)
        t_load = time.time()
        wire_size, finite = WIRE_BITS[args.wire_dtype]
        for T in sizes:
            tensors = _tensors(cfg, T, seed=T, wire=args.wire_dtype)
            bodies = {"v2_binary": v2_binary_body(args.model, tensors), "grpc": (grpc_body(args.model, tensors), 0),
                      **{proto: (tensors, 0) for proto in SHM_PROTOCOLS}}  # (each client makes its regions)
            for proto in protocols:
                body, header_len = bodies[proto]
                target = grpc_target if proto in ("grpc", "grpc_shm") else url
                job = (proto, target, f"/v2/models/{args.model}/infer", body, header_len, T * cfg.H * wire_size,
                       finite)
                port = int(target.rsplit(":", 1)[1])
                probe = (lambda port=port: connection_spread(port)) if args.spread else None
                for c in conc:
                    for _ in range(args.repeat):
                        lats, wall, _ = clients.run(c, job, args.seconds, probe)
                        q = statistics.quantiles(lats, n=100, method="inclusive") if len(lats) > 1 else [lats[0]] * 99
                        row = {"protocol": proto, "T": T, "concurrency": c, "requests": len(lats),
                               "tok_s": len(lats) * T / wall, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
                               "mean_ms": statistics.fmean(lats) * 1e3,
                               "step_tokens": min(cfg.tokens_per_step, T * c), "spread": clients.probed}
                        results.append(row)
                        print(f"  {proto} T={T} c={c}: {row['requests']} requests, {row['tok_s']:.0f} tok/s, "
                              f"p50 {row['p50_ms']:.1f} ms" + (f", connections {row['spread']}" if args.spread else ""),
                              flush=True)
        after = layer_seconds(url)
        load_s = time.time() - t_load
    finally:
        clients.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    direct = {}
    if not args.no_direct and cfg.R == 1:
        direct = direct_tokens_per_s(cfg, settings.backend, settings.seed, device,
                                     sorted({r["step_tokens"] for r in results}), args.direct_steps)
    busy_s, steps = after[0] - before[0], after[1] - before[1]

    print("\n| protocol | T | concurrency | requests | tokens/s | p50 ms | p99 ms | direct tokens/s (step) | ratio |"
          + (" connections per process |" if args.spread else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.spread else ""))
    for r in results:
        d = direct.get(r["step_tokens"])
        r["direct_tok_s"] = d["tok_s"] if d else None
        r["ratio"] = r["tok_s"] / d["tok_s"] if d else None
        dtxt = f"{d['tok_s']:,.0f} ({r['step_tokens']}, {d['s'] * 1e6:.0f} us {d['backend']})" if d else "n/a"
        rtxt = f"{r['ratio']:.0%}" if d else "n/a"
        print(f"| {r['protocol']} | {r['T']} | {r['concurrency']} | {r['requests']} | {r['tok_s']:,.0f} "
              f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {dtxt} | {rtxt} |"
              + (f" {r['spread'] or '?'} |" if args.spread else ""))
    print(f"\nserver moe_layer_seconds over the load: {steps:.0f} steps, {busy_s:.2f} s of layer time in "
          f"{load_s:.1f} s ({busy_s / max(load_s, 1e-9):.0%} busy, including the cells' warm-up gaps)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg.describe(), "device": device, "wire": args.wire_dtype, "results": results,
                       "direct": {str(k): v for k, v in direct.items()},
                       "layer_busy_s": busy_s, "steps": steps, "load_s": load_s}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
