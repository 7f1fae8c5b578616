"""One client's latency on each front end of a running server: which process answers matters at c=1.

    python bench/frontend_spread.py --url http://127.0.0.1:8000 [--connections 16] [--requests 40]
        [--tokens 512] [--wire-dtype bf16] [layer flags as the server's, e.g. --preset seed]

With `--frontends N` the kernel hashes each TCP connection to one front-end process (SO_REUSEPORT):
front end 0 (the owner) runs its steps on the rank group itself, a front end i >= 1 through the owner
(service.replica). This opens --connections connections one after another, finds the process that
holds each one's server end (/proc: its comm, "moe-frontend<i>" for i >= 1, else the owner's), sends
--requests v2 binary requests on it one at a time (the raw-socket client of bench/serve_load.py; the
first is a warm-up) and prints, per process, the connections it got and the p50 and p90 over their
requests, in ms. Run it on the server's host.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.extend(str(Path(__file__).resolve().parents[i]) for i in (0, 1))

from serve_load import _raw_once, _tensors, socket_holders, tcp_inodes, v2_binary_body  # noqa: E402

from service.cli import parse_settings  # noqa: E402


def server_process(server_port: int, client_port: int) -> str:
    """The comm of the process holding the server end of the connection from `client_port`."""
    for pid in socket_holders(tcp_inodes(server_port, client_port)):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    return "?"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--wire-dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--model", default="moe")
    args, layer_flags = p.parse_known_args()
    settings = parse_settings(layer_flags)
    cfg = settings.layer_config(settings.resolve_device()[0])  # the server's shape on this host (GPU: seed)
    tensors = _tensors(cfg, args.tokens, 1, args.wire_dtype)
    body, header_len = v2_binary_body(args.model, tensors)
    host, port = args.url.removeprefix("http://").split(":")
    path = f"/v2/models/{args.model}/infer"
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {header_len}\r\nContent-Length: {len(body)}\r\n\r\n")
    request = head.encode() + body
    view = memoryview(bytearray(len(tensors[0][3]) + (1 << 16)))
    by_process: dict[str, list[float]] = {}
    conns: dict[str, int] = {}
    for _ in range(args.connections):
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stamps: list[tuple] = []
            _raw_once(sock, request, view, stamps)  # warm-up: the connection's first request
            who = server_process(int(port), sock.getsockname()[1])
            for _ in range(args.requests - 1):
                _raw_once(sock, request, view, stamps)
            by_process.setdefault(who, []).extend((s[3] - s[0]) * 1e3 for s in stamps[1:])
            conns[who] = conns.get(who, 0) + 1
        time.sleep(0.05)
    print(f"# T={args.tokens} {args.wire_dtype}, {args.connections} connections x {args.requests} requests, c=1")
    print("| process | connections | requests | p50 ms | p90 ms |")
    print("|---|---|---|---|---|")
    for who in sorted(by_process):
        lat = sorted(by_process[who])
        print(f"| {who} | {conns[who]} | {len(lat)} | {statistics.median(lat):.2f} | "
              f"{lat[int(0.9 * (len(lat) - 1))]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
