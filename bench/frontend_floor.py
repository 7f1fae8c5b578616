"""The floor of bench/frontend_load.py: the same exchange as a served request, with no front end.

    python bench/frontend_floor.py --http-port P --grpc-port Q

HTTP: a bare asyncio BufferedProtocol reads each request with recv_into into one buffer and
answers a JSON header and a prepared answer of the request's T rows (T from the body's size at the
seed shape). gRPC: a bare grpc.aio generic handler, bytes in, the prepared answer out. No
framework, no decoding, no step: what a served request takes above this is the front end's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys

import torch

from service.cli import parse_settings


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
    """EchoFloor on the HTTP port; on the gRPC port a grpc.aio generic handler, bytes in, the
    prepared answer out."""
    import grpc

    cfg = parse_settings(["--device", "cpu", "--preset", "seed", "--world-size", "1"]).layer_config("cpu")
    EchoFloor.row_in, EchoFloor.row_out = 2 * cfg.H + 8 * cfg.K, 2 * cfg.H
    answer = torch.ones(cfg.tokens_per_step * 4 * cfg.H, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    EchoFloor.answer = memoryview(answer)

    async def infer(request: bytes, context) -> bytes:
        return answer[:(len(request) // EchoFloor.row_in) * EchoFloor.row_out]

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(EchoFloor, "127.0.0.1", args.http_port)
        g = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 30),
                                     ("grpc.max_send_message_length", 1 << 30)])
        handler = grpc.unary_unary_rpc_method_handler(infer)
        g.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService",
                                                                         {"ModelInfer": handler}),))
        g.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
        await g.start()
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(main())
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    return serve(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
