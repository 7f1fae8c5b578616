"""The floor of bench/frontend_load.py: the same exchange as a served request, with no front end.

    python bench/frontend_floor.py --http-port P --grpc-port Q [--grpc-server aio|sync] [--transport V]

HTTP: a bare asyncio BufferedProtocol reads each request with recv_into into one buffer and
answers a JSON header and a prepared answer of the request's T rows (T from the body's size at the
seed shape). gRPC: a bare generic handler, bytes in, the prepared answer out: on grpc.aio (as the
service) or, with `--grpc-server sync`, on a synchronous grpc.server (a thread pool). No
framework, no decoding, no step: what a served request takes above this is the front end's own.
`--transport V` adds TRANSPORT[V]'s channel arguments to the gRPC server's (bench/frontend_load.py
gives the same variants to its client with `@client=V`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from concurrent import futures

import torch

from service.cli import parse_settings

MiB = 1 << 20
# gRPC transport settings to try on one large message, each by its name in grpc's
# include/grpc/impl/channel_arg_names.h (a misspelled argument is silently ignored).
TRANSPORT: dict[str, tuple[tuple[str, int], ...]] = {
    "stock": (),
    # HTTP/2 DATA frames this side accepts (default 16 KiB: 256 frames per 4 MiB); max 16 MiB - 1
    "frame16m": (("grpc.http2.max_frame_size", 16 * MiB - 1),),
    # the per-stream receive window this side offers ahead of reads (default 64 KiB, then BDP-tuned)
    "lookahead": (("grpc.http2.lookahead_bytes", 64 * MiB),),
    # bytes queued per stream before a write is flushed (default 64 KiB)
    "writebuf": (("grpc.http2.write_buffer_size", 64 * MiB),),
    # the TCP read slice (default 8 KiB, grown between min 256 B and max)
    "readchunk": (("grpc.experimental.tcp_read_chunk_size", 4 * MiB),
                  ("grpc.experimental.tcp_min_read_chunk_size", 1 * MiB),
                  ("grpc.experimental.tcp_max_read_chunk_size", 32 * MiB)),
    # no bandwidth-delay-product pings (on by default: they size the window)
    "nobdp": (("grpc.http2.bdp_probe", 0),),
}
TRANSPORT["all"] = tuple(opt for name in ("frame16m", "lookahead", "writebuf", "readchunk")
                         for opt in TRANSPORT[name])


class EchoFloor(asyncio.BufferedProtocol):
    """The transport's floor for the same exchange: a request read with recv_into into one buffer
    and answered with a JSON header and a prepared answer of the answer's size; no framework, no
    decoding, no step. What the served path takes above this is the front end's own. A request
    without a body (the readiness probe) gets an empty JSON object."""

    answer = memoryview(b"")  # the largest answer; a request of T tokens gets its first T rows
    row_in = row_out = 1     # bytes per token of a request (x bf16, ids, w) and of an answer

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = memoryview(bytearray(64 << 20))
        self.n = 0
        self.need: int | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf[self.n:] if self.need is None else self.buf[self.n:self.need]

    def buffer_updated(self, nbytes: int) -> None:
        self.n += nbytes
        if self.need is None:
            end = bytes(self.buf[:self.n]).find(b"\r\n\r\n")
            if end < 0:
                return
            fields = dict(line.split(": ", 1) for line in
                          bytes(self.buf[:end]).decode("latin-1").lower().split("\r\n")[1:])
            self.need = end + 4 + int(fields.get("content-length", 0))
        if self.n < self.need:
            return
        answer = self.answer[:(self.need // self.row_in) * self.row_out]
        header = json.dumps({"model_name": "moe", "outputs": [{"name": "output", "parameters": {
            "binary_data_size": len(answer)}}]}).encode() if answer else b"{}"
        self.transport.write(f"HTTP/1.1 200 OK\r\ncontent-length: {len(header) + len(answer)}\r\n"
                             f"inference-header-content-length: {len(header)}\r\n\r\n".encode() + header)
        self.transport.write(answer)
        self.n, self.need = 0, None


def serve(args) -> int:
    """EchoFloor on the HTTP port; on the gRPC port a generic handler (grpc.aio, or grpc.server in
    a thread pool), bytes in, the prepared answer out."""
    import grpc

    cfg = parse_settings(["--device", "cpu", "--preset", "seed", "--world-size", "1"]).layer_config("cpu")
    EchoFloor.row_in, EchoFloor.row_out = 2 * cfg.H + 8 * cfg.K, 2 * cfg.H
    answer = torch.ones(cfg.tokens_per_step * 4 * cfg.H, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    EchoFloor.answer = memoryview(answer)
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30),
               *TRANSPORT[args.transport]]

    def answer_for(request: bytes) -> bytes:
        return answer[:(len(request) // EchoFloor.row_in) * EchoFloor.row_out]

    async def infer(request: bytes, context) -> bytes:
        return answer_for(request)

    def generic(behavior):
        handler = grpc.unary_unary_rpc_method_handler(behavior)
        return (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelInfer": handler}),)

    sync_server = None
    if args.grpc_server == "sync":  # its own threads; the HTTP floor keeps the loop
        sync_server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options)
        sync_server.add_generic_rpc_handlers(generic(lambda request, context: answer_for(request)))
        sync_server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
        sync_server.start()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(EchoFloor, "127.0.0.1", args.http_port)
        if sync_server is None:
            g = grpc.aio.server(options=options)
            g.add_generic_rpc_handlers(generic(infer))
            g.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
            await g.start()
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(main())
    if sync_server is not None:
        sync_server.stop(0)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--grpc-server", choices=("aio", "sync"), default="aio")
    p.add_argument("--transport", choices=sorted(TRANSPORT), default="stock",
                   help="channel arguments added to the gRPC server's")
    return serve(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
