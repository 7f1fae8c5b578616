"""Per-request costs of the served path's host-side stages, each timed alone (no server, no network).

    python bench/frontend_costs.py [--sizes 512,2048] [--wire-dtype bf16] [--reps 30] [--preset seed]

For T tokens with hidden_states in the wire dtype: decoding a v2 binary body and a gRPC message
(validation included), validation alone, the copy into a shared-memory slot (converting to the
layer dtype), on a GPU the rank's copy-in from the slot (pinned as the rank pins it, and pageable
for comparison) and its copy-out (cast on the device, then into the slot), the copy from the slot
into the answer (in the wire dtype), and encoding the answer (v2 binary parts; gRPC: the message
plus serializing it). Median microseconds of --reps runs, one thread. The socket I/O, the event
loop, thread hand-offs and the layer itself are not here: bench/serve_load.py measures the whole,
py-spy (bench/gpu_serve.sh) shows the event loop's share.

The step's own copies (compute_input and compute_output in the statistics: service.api.batcher's
`_copy_in` / `_copy_out` / `_write_out`, as `_execute` calls them, with one copy thread), over the
wire (the request's tensor) and over system shared memory (rows in a /dev/shm object, read with
preadv, the answer written with pwritev), next to their floors: the bytes' memcpy, preadv and
pwritev alone, and one pass of the check (the sum of the slot's rows); and one region lookup as a
shm request's decode makes it (`Regions.rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

import torch

from service.api import batcher, codecs, grpc_codec, regions
from service.api.proto import grpc_predict_v2_pb2 as pb
from service.config import preset
from service.worker.shm import create_slots, remove_slots

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def median_us(fn, reps: int, sync=None) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


@contextlib.contextmanager
def shm_rows(t: torch.Tensor) -> Iterator[regions.RegionRows]:
    """`t`'s bytes in a new /dev/shm object, as a registered region's rows (what a shm request's x is)."""
    path = f"{regions.SHM_ROOT}/bench-costs-{os.getpid()}-{t.shape[0]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.unlink(path)
        os.pwrite(fd, regions._memory(t.contiguous()), 0)
        st = os.fstat(fd)
        size = t.numel() * t.element_size()
        obj = regions._Object(regions.Region("bench", path, 0, size, st.st_dev, st.st_ino, 1), os.dup(fd))
        yield regions.RegionRows(obj, 0, t.dtype, t.shape)
    finally:
        os.close(fd)


def region_lookup(x: torch.Tensor, reps: int) -> float:
    """Median us of one region lookup as a shm request's decode makes it (`Regions.rows`: the table's
    flock and version pread, the cached descriptor), for a region registered in a table of its own."""
    key = f"/bench-costs-lookup-{os.getpid()}"
    path = regions.SHM_ROOT + key
    size = x.numel() * x.element_size()
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    table = regions.RegionTable.create()
    try:
        os.truncate(path, size)
        own = regions.Regions(table)
        own.register("bench", key, 0, size)
        return median_us(lambda: own.rows("bench", 0, size, x.dtype, list(x.shape), "hidden_states"), reps)
    finally:
        table.close()
        os.unlink(path)


def step_copies(slot, x: torch.Tensor, T: int, reps: int) -> dict[str, float]:
    """Median us of the step's copies of T rows (x in the wire dtype) and of their floors."""
    answer = torch.empty(T, x.shape[1], dtype=x.dtype)
    same = x.to(slot.x.dtype)  # the bytes as the slot holds them: the floors' copy
    mem = regions._memory(slot.x[:T])
    t_us = {"shm decode: one region lookup (Regions.rows)": region_lookup(x, reps)}
    with shm_rows(x) as src, shm_rows(answer) as dst:
        fd = src.obj.fd
        t_us["floor: memcpy of the rows' slot bytes"] = median_us(lambda: slot.x[:T].copy_(same), reps)
        t_us["floor: preadv of them from /dev/shm into the slot"] = median_us(lambda: os.preadv(fd, [mem], 0), reps)
        t_us["floor: pwritev of them from the slot to /dev/shm"] = median_us(lambda: os.pwritev(fd, [mem], 0), reps)
        t_us["floor: one pass of the check (sum of the slot's rows)"] = median_us(lambda: float(slot.x[:T].sum()), reps)
        t_us["step copy in + check, wire (_copy_in)"] = median_us(
            lambda: batcher._copy_in(slot.x[:T], x, 0, 0, T), reps)
        t_us["step copy in + check, shm (_copy_in: preadv)"] = median_us(
            lambda: batcher._copy_in(slot.x[:T], src, 0, 0, T), reps)
        t_us["step copy out, wire (_copy_out into the answer)"] = median_us(
            lambda: batcher._copy_out(answer, slot.out[:T], 0, T), reps)
        t_us["step copy out, shm (_write_out: pwritev)"] = median_us(
            lambda: batcher._write_out(dst, slot.out[:T], 0, T), reps)
    return t_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="512,2048")
    p.add_argument("--wire-dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--preset", default="seed")
    args = p.parse_args()
    torch.set_num_threads(1)  # as every front end (service.fleet.set_frontend_threads)
    cfg = preset(args.preset, R=1, C=max(int(s) for s in args.sizes.split(",")))
    spec = codecs.ModelSpec.of(cfg, max_tokens=1 << 20)
    wire = DTYPES[args.wire_dtype]
    cuda = torch.cuda.is_available()
    slot = create_slots(cfg, 1)[0]
    try:
        if cuda:
            from service.worker.rank import pin_slot

            dev = torch.device("cuda", 0)
            pin_slot(slot)
            x_dev = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, device=dev)
            out32 = torch.randn(cfg.C, cfg.H, device=dev)           # the layer's fp32 answer
            out_dev = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, device=dev)
            pageable = torch.empty(cfg.C, cfg.H, dtype=cfg.dtype)
            sync = torch.cuda.synchronize
        print(f"# {cfg.describe()}, wire {args.wire_dtype}, "
              f"{'CUDA ' + torch.cuda.get_device_name() if cuda else 'CPU'}; "
              f"torch {torch.__version__}; median us of {args.reps}; load average {os.getloadavg()[0]:.1f}")
        print("| stage | " + " | ".join(f"T={T}" for T in map(int, args.sizes.split(","))) + " |")
        print("|---|" + "---|" * len(args.sizes.split(",")))
        rows: dict[str, list[str]] = {}
        for T in map(int, args.sizes.split(",")):
            gen = torch.Generator().manual_seed(T)
            x = torch.randn(T, cfg.H, generator=gen).to(wire)
            ids = torch.argsort(torch.rand(T, cfg.E, generator=gen), dim=1)[:, :cfg.K].int()
            w = torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1)
            blobs = [codecs.to_bytes(t) for t in (x, ids, w)]
            names = [codecs.V2_NAMES[t.dtype] for t in (x, ids, w)]
            import json

            inputs = [{"name": n, "datatype": d, "shape": list(t.shape), "parameters": {"binary_data_size": len(b)}}
                      for n, d, t, b in zip(codecs.INPUT_NAMES, names, (x, ids, w), blobs, strict=True)]
            header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
            body = header + b"".join(blobs)
            msg = pb.ModelInferRequest(model_name="moe")
            for n, d, t, b in zip(codecs.INPUT_NAMES, names, (x, ids, w), blobs, strict=True):
                msg.inputs.add(name=n, datatype=d, shape=list(t.shape))
                msg.raw_input_contents.append(b)
            wire_msg = msg.SerializeToString()
            req = codecs.decode_v2_http(body, str(len(header)), spec)
            answer = torch.empty(T, cfg.H, dtype=wire)
            t_us = {
                "decode v2 binary (+ validate)": median_us(
                    lambda: codecs.decode_v2_http(body, str(len(header)), spec), args.reps),
                "decode gRPC (parse + validate)": median_us(
                    lambda: grpc_codec.decode_grpc(grpc_codec.parse_grpc_request(wire_msg), spec), args.reps),
                "  of which validate (all but x's values)": median_us(
                    lambda: codecs.validate(req.x, req.ids, req.w, spec), args.reps),
                "copy into the slot (to layer dtype)": median_us(
                    lambda: (slot.x[:T].copy_(req.x), slot.ids[:T].copy_(req.ids), slot.w[:T].copy_(req.w)), args.reps),
                "  of which ids and weights ([T, K] each)": median_us(
                    lambda: (slot.ids[:T].copy_(req.ids), slot.w[:T].copy_(req.w)), args.reps),
                "check x's rows in the slot (rows_error)": median_us(
                    lambda: codecs.rows_error(slot.x[:T], req.x), args.reps),
            }
            if cuda:
                t_us["rank copy-in, pinned slot (H2D)"] = median_us(
                    lambda: x_dev[:T].copy_(slot.x[:T], non_blocking=True), args.reps, sync)
                t_us["  the same from pageable memory"] = median_us(
                    lambda: x_dev[:T].copy_(pageable[:T], non_blocking=True), args.reps, sync)
                t_us["rank copy-out (cast, D2H to the slot)"] = median_us(
                    lambda: slot.out[:T].copy_(out_dev[:T].copy_(out32[:T]), non_blocking=True), args.reps, sync)
            t_us["copy out of the slot (to wire dtype)"] = median_us(lambda: answer.copy_(slot.out[:T]), args.reps)
            slot.out[:T].copy_(x)  # an answer's values
            t_us.update(step_copies(slot, x, T, args.reps))
            t_us["encode v2 binary (parts)"] = median_us(lambda: codecs.encode_v2_http(answer, req, "moe"), args.reps)
            t_us["gRPC response made before the step (its rows filled by the copy out)"] = median_us(
                lambda: grpc_codec.serialize_grpc_response(grpc_codec.grpc_response(req, "moe")), args.reps)
            for k, v in t_us.items():
                rows.setdefault(k, []).append(f"{v:,.0f}")
        for k, vals in rows.items():
            print(f"| {k} | " + " | ".join(vals) + " |")
    finally:
        remove_slots([slot])


if __name__ == "__main__":
    main()
