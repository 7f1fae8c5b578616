"""Inputs and the fp32 reference for the API tests (the CPU preset, synthetic weights, seed 0), and
a bare uvicorn server of a small ASGI app on one of our connection protocols."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time

import torch
import uvicorn

from service.config import preset
from service.moe.reference import full_weights, moe_reference
from tests.helpers import rel_err, routing, tolerance

CFG = preset("cpu")  # what the test servers serve (E=16 H=256 I=512 K=4 R=4 C=128 fp32)
SEED = 0


@functools.cache
def weights():
    return full_weights(CFG, SEED)


def inputs(T: int, seed: int, dtype=torch.float32, kind: str = "balanced"):
    """x [T, H] in dtype, ids [T, K] int64, w [T, K] fp32; fresh random values per seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, CFG.H, generator=gen).to(dtype)
    ids, w = routing(T, CFG.E, CFG.K, kind, gen)
    return x, ids, w


def reference(x, ids, w) -> torch.Tensor:
    """The layer in fp32 on the inputs as the server sees them (x cast to the serving dtype)."""
    return moe_reference(x.to(CFG.dtype), ids, w, *weights())


def check(out, x, ids, w) -> None:
    if getattr(out, "flags", None) is not None and not out.flags.writeable:
        out = out.copy()  # a NumPy view of a client's read-only bytes: torch warns on wrapping it
    out = torch.as_tensor(out)
    assert tuple(out.shape) == (x.shape[0], CFG.H), out.shape
    err = rel_err(out.float(), reference(x, ids, w))
    tol = tolerance(CFG.dtype, out.dtype)  # a 16-bit answer is the fp32 layer rounded once more
    assert err <= tol, f"relative error {err:.2e} over {tol:.1e} ({out.dtype})"


def check_like_solo(out, solo, layer_dtype: torch.dtype = CFG.dtype, what=None) -> None:
    """A request's answer in a shared step against its answer alone. Not bit for bit: the CPU GEMMs
    block rows differently for another step's row count, which moves the fp32 rounding (~1e-7; the
    kernels MKL or oneDNN pick differ by CPU); rows of another request would differ by ~1."""
    out, solo = torch.as_tensor(out), torch.as_tensor(solo)
    assert out.shape == solo.shape and out.dtype == solo.dtype, (what, out.shape, solo.shape, out.dtype, solo.dtype)
    err = rel_err(out.float(), solo.float())
    assert err <= tolerance(layer_dtype, out.dtype), (what, err)


@contextlib.contextmanager
def uvicorn_serving(app, protocol):
    """uvicorn serving the ASGI `app` on loopback in a thread, on `protocol` (a protocol class made by
    service.api.connections.bounded_protocol, its keyword arguments bound); yields the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, lifespan="off",
                                           log_config=None, access_log=False))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def http_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """`count` HTTP/1.1 responses (each with a Content-Length) read off `sock`: (status, body)."""
    buf, out = b"", []
    while len(out) < count:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end].decode().lower().split("\r\n")
            length = int(next(h for h in head if h.startswith("content-length:")).split(":")[1])
            if len(buf) >= end + 4 + length:
                out.append((int(head[0].split()[1]), buf[end + 4:end + 4 + length]))
                buf = buf[end + 4 + length:]
                continue
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} answers")
        buf += chunk
    return out
