"""Service overhead: tokens/s and p50/p99 latency through each protocol vs the rank group called directly.

    python bench/service.py [--sizes 64,512,2048] [--concurrency 2] [--seconds 3] [moe-serve flags...]

For each batch size T, the same number of concurrent callers send back-to-back requests for
`--seconds`: straight into a `WorkerGroup` in this process (`group.forward`, the baseline), and
through a real `moe-serve` process over HTTP safetensors, HTTP JSON, v2 binary
(tritonclient.http) and gRPC (tritonclient.grpc). Each row prints its throughput as a ratio to
the direct figure of the same T measured in this run.
Client-side encoding and decoding are inside the timed region (a real client pays them); on a
small host the clients share the CPU cores with the ranks, which the ratio then includes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Run as a script, this file's folder leads sys.path and its name would shadow the `service` package:
# drop that folder, and put the repository's root first for `bench.loadstats` (the rank processes
# spawned below inherit this sys.path when they import this file again).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import httpx  # noqa: E402
import numpy as np
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from bench import loadstats  # noqa: E402
from service.config import Settings  # noqa: E402
from service.worker.group import WorkerGroup  # noqa: E402

PROTOCOLS = ("direct", "http_safetensors", "http_json", "v2_binary", "grpc")
START_TIMEOUT_S = 300.0


def make_batch(cfg, T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.H, generator=gen).to(cfg.dtype)                        # [T, H]
    ids = torch.stack([torch.randperm(cfg.E, generator=gen)[:cfg.K] for _ in range(T)]).int()  # [T, K]
    w = torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1)                # [T, K]
    return x, ids, w


# ---- clients (one per thread) -------------------------------------------------------------------


def client(proto: str, url: str, grpc_url: str, x, ids, w):
    """A zero-argument callable doing one full request (with its own connection) and decoding the answer."""
    T = x.shape[0]
    if proto == "http_safetensors":
        body = safetensors.torch.save({"hidden_states": x, "topk_ids": ids, "topk_weights": w})

        c = httpx.Client(base_url=url, timeout=120)

        def call():
            r = c.post("/moe/forward", content=body, headers={"Content-Type": "application/x-safetensors"})
            r.raise_for_status()
            assert safetensors.torch.load(r.content)["output"].shape[0] == T
    elif proto == "http_json":
        body = json.dumps({"hidden_states": x.float().tolist(), "topk_ids": ids.tolist(),
                           "topk_weights": w.tolist()}).encode()

        c = httpx.Client(base_url=url, timeout=120)

        def call():
            r = c.post("/moe/forward", content=body, headers={"Content-Type": "application/json"})
            r.raise_for_status()
            assert len(np.asarray(r.json()["output"], dtype=np.float32)) == T
    elif proto == "v2_binary":
        import tritonclient.http as th

        c = th.InferenceServerClient(url.removeprefix("http://"), network_timeout=120)

        def call():
            inputs = []
            for name, t, dt in (("hidden_states", x.float(), "FP32"), ("topk_ids", ids, "INT32"),
                                ("topk_weights", w, "FP32")):
                i = th.InferInput(name, list(t.shape), dt)
                i.set_data_from_numpy(t.numpy(), binary_data=True)
                inputs.append(i)
            assert c.infer("moe", inputs).as_numpy("output").shape[0] == T
    elif proto == "grpc":
        import tritonclient.grpc as tg

        c = tg.InferenceServerClient(grpc_url)

        def call():
            inputs = []
            for name, t, dt in (("hidden_states", x.float(), "FP32"), ("topk_ids", ids, "INT32"),
                                ("topk_weights", w, "FP32")):
                i = tg.InferInput(name, list(t.shape), dt)
                i.set_data_from_numpy(t.numpy())
                inputs.append(i)
            assert c.infer("moe", inputs).as_numpy("output").shape[0] == T
    else:
        raise ValueError(proto)
    call()  # warm up: connection, first allocations
    return call


# ---- the server process -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], log_path: str):
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--log-level", "WARNING", *flags]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moe-serve exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return proc, url, f"127.0.0.1:{grpc_port}"
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"moe-serve was not ready within {START_TIMEOUT_S} s; see {log_path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,512,2048", help="batch sizes T, comma-separated")
    p.add_argument("--concurrency", type=int, default=2, help="concurrent callers per measurement")
    p.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="turns per cell, interleaved with the other cells")
    args, serve_flags = p.parse_known_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    from service.cli import parse_settings

    settings: Settings = parse_settings(serve_flags)
    device, why = settings.resolve_device()
    cfg = settings.layer_config(device)
    print(f"# {cfg.describe()} on {device} ({why}); {os.cpu_count()} CPU cores; torch {torch.__version__}; "
          f"concurrency {args.concurrency}; {args.seconds:g} s per cell")
    batches = {T: make_batch(cfg, T, seed=T) for T in sizes}

    # Both the in-process group and the server's group stay up (an idle rank sleeps on its pipe);
    # cells are measured round-robin in short turns, so that load from anything else on the
    # host spreads over every cell instead of skewing one.
    group = WorkerGroup(cfg, device=device, seed=settings.seed, slots=settings.slots,
                        step_timeout_s=settings.step_timeout_s, start_timeout_s=settings.start_timeout_s)
    group.start()
    log_path = os.path.join(tempfile.gettempdir(), f"moe-bench-service-{os.getpid()}.log")
    proc = None
    lats: dict[tuple[str, int], list[float]] = {}
    walls: dict[tuple[str, int], float] = {}
    try:
        proc, url, grpc_url = start_server(serve_flags, log_path)
        callers = {}
        for T in sizes:
            x, ids, w = batches[T]
            group.forward(x, ids, w)
            callers["direct", T] = [lambda x=x, ids=ids, w=w: group.forward(x, ids, w)] * args.concurrency
            for proto in PROTOCOLS[1:]:
                callers[proto, T] = [client(proto, url, grpc_url, x, ids, w) for _ in range(args.concurrency)]
        for _ in range(args.rounds):
            for key, cell_callers in callers.items():
                cell, wall = loadstats.measure(cell_callers, args.seconds / args.rounds,
                                               max(1, args.min_requests // args.rounds))
                lats.setdefault(key, []).extend(cell)
                walls[key] = walls.get(key, 0.0) + wall
    finally:
        group.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    results = {key: loadstats.summary(lats[key], walls[key], key[1]) for key in lats}

    print(f"{'protocol':<18}{'T':>6}{'requests':>10}{'tokens/s':>12}{'p50 ms':>10}{'p99 ms':>10}{'vs direct':>11}")
    for T in sizes:
        base = results["direct", T]["tok_s"]
        for proto in PROTOCOLS:
            r = results[proto, T]
            print(f"{proto:<18}{T:>6}{r['requests']:>10}{r['tok_s']:>12.0f}{r['p50_ms']:>10.1f}"
                  f"{r['p99_ms']:>10.1f}{r['tok_s'] / base:>10.0%}")


if __name__ == "__main__":
    main()
