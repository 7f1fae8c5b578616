"""Triton's system shared-memory extension (service.api.regions), as tritonclient and perf_analyzer
use it against a real CPU server started with `--shared-memory system`: answers equal the wire's
bit for bit and the reference, inputs and outputs in regions or on the wire in any mix, every bad
register / status / unregister / infer call refused with its own error while the rest keeps
serving, concurrent shm and wire requests never mixing, a region registered through one front end
served by the other (`--frontends 2`), and the extension off by default.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path

import grpc
import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from service.api import codecs, grpc_codec, regions
from service.api.error_map import classify
from service.api.grpc import InferenceServicer
from service.api.http import create_app
from service.api.proto import grpc_predict_v2_pb2 as pb
from service.config import Settings
from service.errors import DeadlineExceeded, InvalidInput, WorkerError
from tests.api.common import CFG, check, inputs
from tests.api.test_batcher import BUDGET, FakeGroup, batch, started
from tests.api.test_batcher import CFG as BATCHER_CFG
from tests.api.test_ecosystem import PERF_ANALYZER_TIMEOUT_S, input_data, perf_analyzer_env
from tests.api.test_frontend import make_frontend
from tests.api.test_frontends import holders
from tests.helpers import TOL, external_tool, rel_err
from tests.serverproc import ServerProcess, listening

MODEL = "moe"
PROTOCOLS = ("http", "grpc")
TRITON_DTYPES = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.int32: "INT32"}
NAN = float("nan")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess.serving(tmp_path_factory.mktemp("shm") / "server.log", "--shared-memory", "system") as proc:
        yield proc


def _key() -> str:
    return f"/moe11s-test-{uuid.uuid4().hex[:16]}"  # (not "/moe-": the server's own names)


class Object:
    """A client's POSIX shared-memory object (tritonclient.utils.shared_memory)."""

    def __init__(self, size: int):
        self.key = _key()
        self.size = size
        self.handle = shm.create_shared_memory_region(self.key[1:], self.key, size)

    def write(self, t: torch.Tensor, offset: int = 0) -> None:
        shm.set_shared_memory_region(self.handle, [_numpy(t)], offset=offset)

    def read(self, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
        np_dtype = np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
        arr = shm.get_contents_as_numpy(self.handle, np_dtype, list(shape), offset=offset).copy()
        return torch.from_numpy(arr).view(dtype)

    def close(self) -> None:
        shm.destroy_shared_memory_region(self.handle)


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


@pytest.fixture
def objects():
    """Make objects (closed at the end) and unregister whatever the test registered."""
    made: list[Object] = []

    def make(size: int) -> Object:
        made.append(Object(size))
        return made[-1]

    yield make
    for obj in made:
        obj.close()


def client(server, protocol: str):
    """A tritonclient client with a connection of its own (grpc channels of one process otherwise
    share their TCP connection: a global subchannel pool)."""
    if protocol == "http":
        return httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    return grpcclient.InferenceServerClient(server.grpc_url, channel_args=[("grpc.use_local_subchannel_pool", 1)])


def error_of(call) -> tuple[str, str]:
    """(status, message) of a tritonclient call that must fail: the HTTP code or the gRPC code name."""
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()).removeprefix("StatusCode."), info.value.message()


@pytest.fixture(autouse=True)
def unregister_all(request):
    yield
    if "server" in request.fixturenames:
        client(request.getfixturevalue("server"), "http").unregister_system_shared_memory()


def infer(c, protocol: str, x, ids, w, *, inputs_in=None, output_in=None, request_id=""):
    """One request with tritonclient. inputs_in: name -> (region, offset, byte_size) for inputs in
    shared memory (the rest travel on the wire); output_in: (region, byte_size, offset) for the
    answer in shared memory. The answer when it came on the wire, else None."""
    mod = httpclient if protocol == "http" else grpcclient
    tensors = {"hidden_states": x, "topk_ids": ids.to(torch.int32), "topk_weights": w}
    items = []
    for name, t in tensors.items():
        item = mod.InferInput(name, list(t.shape), TRITON_DTYPES[t.dtype])
        if inputs_in and name in inputs_in:
            region, offset, size = inputs_in[name]
            item.set_shared_memory(region, size, offset=offset)
        elif protocol == "http":
            item.set_data_from_numpy(_numpy(t) if t.dtype != torch.bfloat16 else _bf16(t), binary_data=True)
        else:
            item.set_data_from_numpy(_numpy(t) if t.dtype != torch.bfloat16 else _bf16(t))
        items.append(item)
    out = mod.InferRequestedOutput("output", binary_data=True) if protocol == "http" else mod.InferRequestedOutput(
        "output")
    if output_in is not None:
        region, size, offset = output_in
        out.set_shared_memory(region, size, offset=offset)
    result = c.infer(MODEL, items, outputs=[out], request_id=request_id)
    if output_in is not None:
        return None, result
    answer = np.array(result.as_numpy("output"), dtype=np.float32)  # (BF16: ml_dtypes.bfloat16)
    return torch.from_numpy(answer).to(x.dtype), result


def _bf16(t: torch.Tensor) -> np.ndarray:
    """What tritonclient takes for BF16: an ml_dtypes.bfloat16 array."""
    return t.float().numpy().astype(ml_dtypes.bfloat16)


def register_inputs(c, obj: Object, x, ids, w, name: str, at: int = 0) -> dict:
    """Write x, ids, w one after the other into obj from byte `at`, register that span as region
    `name`; the inputs_in for `infer`."""
    parts = (("hidden_states", x), ("topk_ids", ids.to(torch.int32)), ("topk_weights", w))
    spec, offset = {}, 0
    for tensor_name, t in parts:
        obj.write(t, at + offset)
        size = t.numel() * t.element_size()
        spec[tensor_name] = (name, offset, size)
        offset += size
    c.register_system_shared_memory(name, obj.key, offset, offset=at)
    return spec


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def infer_in_regions(c, protocol: str, objects, x, ids, w, name: str):
    """infer with every input in one new object's region and the answer in another's (poisoned with
    NaN first): infer's (answer, result), the input object and the output object."""
    obj_in, obj_out = objects(nbytes(x) + nbytes(ids.to(torch.int32)) + nbytes(w)), objects(nbytes(x) + 64)
    spec = register_inputs(c, obj_in, x, ids, w, f"in-{name}")
    c.register_system_shared_memory(f"out-{name}", obj_out.key, obj_out.size)
    obj_out.write(torch.full((obj_out.size // 4,), NAN))
    return (*infer(c, protocol, x, ids, w, inputs_in=spec, output_in=(f"out-{name}", obj_out.size, 0)), obj_in, obj_out)


# ---- answers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_answers_equal_the_wire_and_the_reference(server, objects, dtype):
    """T=1, odd T and T past one step (R*C = 512), fp32 (rows read straight into the slot) and bf16
    (converted there), over HTTP and gRPC: the answer in the output region, poisoned with NaN
    before each run, equals the wire's bit for bit and the fp32 reference within tolerance."""
    for T in (1, 37, 700):
        x, ids, w = inputs(T, seed=T + 11, dtype=dtype, kind="empty_expert" if T == 37 else "balanced")
        wire, _ = infer(client(server, "http"), "http", x, ids, w)
        check(wire, x, ids, w)
        for protocol in PROTOCOLS:
            c = client(server, protocol)
            none, result, _, obj_out = infer_in_regions(c, protocol, objects, x, ids, w, f"{protocol}-{T}")
            assert none is None
            answer = obj_out.read(dtype, x.shape)
            assert torch.equal(answer, wire), (protocol, T, dtype)
            tail = obj_out.read(torch.float32, (16,), offset=nbytes(x))
            assert tail.isnan().all(), "bytes past the answer were written"
            output = result.get_output("output")  # metadata alone, as Triton answers
            if protocol == "http":
                assert output == {"name": "output", "datatype": TRITON_DTYPES[dtype], "shape": [T, CFG.H]}, output
            else:
                meta = (output.name, output.datatype, list(output.shape))
                assert meta == ("output", TRITON_DTYPES[dtype], [T, CFG.H]), meta
                assert not output.parameters and not output.HasField("contents")
                assert list(result.get_response().raw_output_contents) == [b""]  # no data on the wire


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_mixed_shared_memory_and_wire(server, objects, protocol):
    """Input in a region, answer on the wire; input on the wire, answer in a region; only the
    routing in a region; tensors at non-zero offsets of a region that starts inside its object."""
    c = client(server, protocol)
    x, ids, w = inputs(29, seed=5, kind="skewed")
    wire, _ = infer(c, protocol, x, ids, w)
    check(wire, x, ids, w)
    size = nbytes(x) + nbytes(ids.to(torch.int32)) + nbytes(w)
    obj = objects(4096 + size + nbytes(x))
    spec = register_inputs(c, obj, x, ids, w, "in", at=4096)
    c.register_system_shared_memory("out", obj.key, nbytes(x), offset=4096 + size)

    answer, _ = infer(c, protocol, x, ids, w, inputs_in=spec)
    assert torch.equal(answer, wire)
    obj.write(torch.full(x.shape, NAN), 4096 + size)
    infer(c, protocol, x, ids, w, output_in=("out", nbytes(x), 0))
    assert torch.equal(obj.read(torch.float32, x.shape, 4096 + size), wire)
    routing = {k: v for k, v in spec.items() if k != "hidden_states"}
    answer, _ = infer(c, protocol, x, ids, w, inputs_in=routing)
    assert torch.equal(answer, wire)
    only_x = {"hidden_states": spec["hidden_states"]}
    obj.write(torch.full(x.shape, NAN), 4096 + size)
    infer(c, protocol, x, ids, w, inputs_in=only_x, output_in=("out", nbytes(x), 0))
    assert torch.equal(obj.read(torch.float32, x.shape, 4096 + size), wire)


def test_status_and_metadata(server, objects):
    """Server metadata lists the extension; status as Triton's (HTTP: a list; gRPC: a map by name),
    for every region or one; unregister of one, then of all."""
    h, g = client(server, "http"), client(server, "grpc")
    assert "system_shared_memory" in h.get_server_metadata()["extensions"]
    assert "system_shared_memory" in g.get_server_metadata().extensions
    a, b = objects(1000), objects(2000)
    h.register_system_shared_memory("a", a.key, 600, offset=100)
    g.register_system_shared_memory("b", b.key, 2000)
    want = {"a": {"name": "a", "key": a.key, "offset": 100, "byte_size": 600},
            "b": {"name": "b", "key": b.key, "offset": 0, "byte_size": 2000}}
    assert sorted(h.get_system_shared_memory_status(), key=lambda r: r["name"]) == [want["a"], want["b"]]
    assert h.get_system_shared_memory_status("b") == [want["b"]]
    status = g.get_system_shared_memory_status().regions
    assert {k: {f: getattr(v, f) for f in ("name", "key", "offset", "byte_size")} for k, v in status.items()} == want
    assert list(g.get_system_shared_memory_status("a").regions) == ["a"]
    g.unregister_system_shared_memory("a")
    assert [r["name"] for r in h.get_system_shared_memory_status()] == ["b"]
    h.unregister_system_shared_memory()
    assert h.get_system_shared_memory_status() == [] and not g.get_system_shared_memory_status().regions


# ---- bad calls ----------------------------------------------------------------------------------


def bad_registers(obj: Object, other: Object) -> list:
    """(name, key, offset, byte_size) -> (HTTP status, gRPC code, words of the error)."""
    inside = "/" + os.path.basename(obj.key) + "/x"
    return [
        (("r1", inside, 0, 8), ("400", "INVALID_ARGUMENT", "not a POSIX shared-memory name")),
        (("r1", "/..", 0, 8), ("400", "INVALID_ARGUMENT", "not a POSIX shared-memory name")),
        (("r1", "/", 0, 8), ("400", "INVALID_ARGUMENT", "not a POSIX shared-memory name")),
        (("r1", "/moe-slot-0123", 0, 8), ("400", "INVALID_ARGUMENT", "this server's own")),
        (("r1", _key(), 0, 8), ("400", "INVALID_ARGUMENT", "no shared-memory object")),
        (("r1", obj.key, 0, obj.size + 1), ("400", "INVALID_ARGUMENT", "runs past the end")),
        (("r1", obj.key, obj.size, 1), ("400", "INVALID_ARGUMENT", "runs past the end")),
        (("r1", obj.key, 0, 0), ("400", "INVALID_ARGUMENT", "'byte_size' must be an integer >= 1")),
        (("dup", other.key, 0, 8), ("409", "ALREADY_EXISTS", "registered already")),
    ]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_register_status_unregister(server, objects, protocol, tmp_path):
    """Each bad call gets its own error (Triton's codes: NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT);
    the registered regions are unchanged after it, and a good request is still answered."""
    c = client(server, protocol)
    obj, other = objects(4096), objects(4096)
    c.register_system_shared_memory("dup", obj.key, 4096)
    link = f"/dev/shm/{_key()[1:]}"
    os.symlink(f"/dev/shm/{os.path.basename(obj.key)}", link)
    try:
        cases = bad_registers(obj, other)
        cases.append((("r1", "/" + os.path.basename(link), 0, 8), ("400", "INVALID_ARGUMENT", "cannot open")))
        for args, (status, code, words) in cases:
            got, text = error_of(lambda args=args: c.register_system_shared_memory(args[0], args[1], args[3],
                                                                                     offset=args[2]))
            assert got == (status if protocol == "http" else code) and words in text, (args, got, text)
    finally:
        os.unlink(link)
    got, text = error_of(lambda: c.get_system_shared_memory_status("nope"))
    assert got == ("404" if protocol == "http" else "NOT_FOUND") and "'nope'" in text, (got, text)
    for _ in range(2):  # unregistering a name that is not registered succeeds, as Triton's does
        c.unregister_system_shared_memory("nope")
    names = [r["name"] for r in client(server, "http").get_system_shared_memory_status()]
    assert names == ["dup"], names
    x, ids, w = inputs(3, seed=1)
    answer, _ = infer(c, protocol, x, ids, w)
    check(answer, x, ids, w)


def test_register_caps_the_regions(server, objects):
    h = client(server, "http")
    obj = objects(regions.MAX_REGIONS * 8)
    for i in range(regions.MAX_REGIONS):
        h.register_system_shared_memory(f"r{i}", obj.key, 8, offset=8 * i)
    status, text = error_of(lambda: h.register_system_shared_memory("one-more", obj.key, 8))
    assert status == "400" and f"{regions.MAX_REGIONS} shared-memory regions" in text, text
    status, _ = error_of(lambda: client(server, "grpc").register_system_shared_memory("one-more", obj.key, 8))
    assert status == "RESOURCE_EXHAUSTED"
    h.unregister_system_shared_memory("r0")
    h.register_system_shared_memory("one-more", obj.key, 8)  # room again


def bad_infers(x, ids, w, obj: Object) -> list:
    """(inputs_in, output_in) of requests that must fail -> (HTTP status, gRPC code, words)."""
    sx, sid, sw = nbytes(x), nbytes(ids.to(torch.int32)), nbytes(w)
    good = {"hidden_states": ("in", 0, sx), "topk_ids": ("in", sx, sid), "topk_weights": ("in", sx + sid, sw)}
    return [
        ({**good, "hidden_states": ("nope", 0, sx)}, None, ("404", "NOT_FOUND", "region named 'nope'")),
        ({**good, "hidden_states": ("in", 0, sx - 4)}, None, ("400", "INVALID_ARGUMENT", f"needs {sx}")),
        ({**good, "topk_weights": ("in", sx + sid + 4, sw)}, None, ("400", "INVALID_ARGUMENT", "runs past the end")),
        (good, ("out", sx - 1, 0), ("400", "INVALID_ARGUMENT", f"needs {sx} bytes")),
        (good, ("out", sx, 8), ("400", "INVALID_ARGUMENT", "runs past the end")),
        (good, ("nope", sx, 0), ("404", "NOT_FOUND", "'nope'")),
    ]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_infer_calls(server, objects, protocol):
    """A tensor in an unknown region, a byte size other than its shape's, data past the region,
    an output region too small (refused before the step: the region is not written): each is an
    error of its own, and the next request is answered."""
    c = client(server, protocol)
    x, ids, w = inputs(9, seed=21)
    obj_in = objects(nbytes(x) * 2)
    size = nbytes(x) + nbytes(ids.to(torch.int32)) + nbytes(w)
    register_inputs(c, obj_in, x, ids, w, "in")
    out = objects(nbytes(x))
    c.register_system_shared_memory("out", out.key, nbytes(x))
    assert size < obj_in.size
    for inputs_in, output_in, (status, code, words) in bad_infers(x, ids, w, obj_in):
        out.write(torch.full(x.shape, NAN))
        got, text = error_of(lambda i=inputs_in, o=output_in: infer(c, protocol, x, ids, w, inputs_in=i, output_in=o))
        assert got == (status if protocol == "http" else code) and words in text, (inputs_in, output_in, got, text)
        assert out.read(torch.float32, x.shape).isnan().all()
    answer, _ = infer(c, protocol, x, ids, w)
    check(answer, x, ids, w)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_output_over_its_input_is_answered_where_safe_and_refused_where_not(server, objects, protocol):
    """T past one step (R*C = 512): each step reads its rows just before it runs and writes its answer
    after, so an answer written in place, or starting before its input, covers only rows already
    read, and is right; one starting a row after its input would overwrite the next step's rows
    (before: a 200 with those rows wrong) and is refused before the step, the object untouched."""
    c = client(server, protocol)
    T, shift = 700, 100
    x, ids, w = inputs(T, seed=31)
    wire, _ = infer(c, protocol, x, ids, w)
    row = nbytes(x) // T
    obj = objects(nbytes(x) + shift * row)
    c.register_system_shared_memory("io", obj.key, obj.size)
    for x_at, out_at in ((0, 0), (shift * row, 0)):  # in place; the answer 100 rows before the input
        obj.write(torch.full((obj.size // 4,), NAN))
        obj.write(x, x_at)
        infer(c, protocol, x, ids, w, inputs_in={"hidden_states": ("io", x_at, nbytes(x))},
              output_in=("io", nbytes(x), out_at))
        assert torch.equal(obj.read(torch.float32, x.shape, out_at), wire), (x_at, out_at)
    obj.write(x, 0)
    got, text = error_of(lambda: infer(c, protocol, x, ids, w, inputs_in={"hidden_states": ("io", 0, nbytes(x))},
                                       output_in=("io", nbytes(x), row)))
    assert got == ("400" if protocol == "http" else "INVALID_ARGUMENT") and "overlaps input 'hidden_states'" in text, \
        (got, text)
    assert torch.equal(obj.read(torch.float32, x.shape, 0), x)


def test_bad_v2_json_combinations(server, objects):
    """What the JSON header can get wrong that tritonclient never sends: a region with data or a
    binary blob, a region without its byte size, an offset alone, an output with both a region and
    binary_data, a negative offset."""
    x, ids, w = inputs(2, seed=3)
    h = client(server, "http")
    obj = objects(nbytes(x))
    obj.write(x)
    h.register_system_shared_memory("in", obj.key, nbytes(x))
    region = {"shared_memory_region": "in", "shared_memory_byte_size": nbytes(x)}

    def body(x_item: dict, output: dict | None = None) -> dict:
        doc = {"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [2, CFG.H], **x_item},
                          {"name": "topk_ids", "datatype": "INT64", "shape": [2, CFG.K], "data": ids.tolist()},
                          {"name": "topk_weights", "datatype": "FP32", "shape": [2, CFG.K], "data": w.tolist()}]}
        if output is not None:
            doc["outputs"] = [{"name": "output", "parameters": output}]
        return doc

    cases = [
        (body({"parameters": region, "data": x.tolist()}), "neither 'data' nor binary_data_size"),
        (body({"parameters": {"shared_memory_region": "in"}}), "must be given together"),
        (body({"parameters": {"shared_memory_offset": 0}, "data": x.tolist()}), "without shared_memory_region"),
        (body({"parameters": {**region, "shared_memory_offset": -4}}), "non-negative integer"),
        (body({"parameters": region}, {"shared_memory_region": "in", "shared_memory_byte_size": nbytes(x),
                                       "binary_data": True}), "both 'shared_memory_region' and 'binary_data'"),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for doc, words in cases:
            r = http.post(f"/v2/models/{MODEL}/infer", json=doc)
            assert r.status_code == 400 and words in r.json()["error"], (doc["inputs"][0], r.text)
        r = http.post(f"/v2/models/{MODEL}/infer", json=body({"parameters": region}))
        assert r.status_code == 200, r.text
        check(torch.tensor(r.json()["outputs"][0]["data"]).reshape(2, CFG.H), x, ids, w)


# ---- requests that fail alone, concurrency ------------------------------------------------------


def test_concurrent_shm_and_wire_requests_never_mix(server, objects):
    """Requests in regions and on the wire at once, over both protocols, some of them bad (a NaN row
    in a region, an input or output object truncated after it was registered), merged into the same
    steps: the bad ones fail alone with their own 400, every other answer equals its solo run."""
    cases = []
    for i, T in enumerate((1, 7, 130, 300, 2, 513, 64, 9, 200, 33, 77, 5)):
        x, ids, w = inputs(T, seed=900 + i, kind=("balanced", "skewed", "empty_expert")[i % 3])
        bad = {3: "nan", 7: "truncated", 10: "output truncated"}.get(i)
        if bad == "nan":
            x[T // 2, 3] = NAN
        cases.append((PROTOCOLS[i % 2], "shm" if i % 3 else "wire", bad, x, ids, w))
    setup = []
    h = client(server, "http")
    for i, (_, path, bad, x, ids, w) in enumerate(cases):
        if path == "wire" and bad is None:
            setup.append(None)
            continue
        obj_in = objects(nbytes(x) + nbytes(ids.to(torch.int32)) + nbytes(w))
        obj_out = objects(nbytes(x))
        spec = register_inputs(h, obj_in, x, ids, w, f"in{i}")
        h.register_system_shared_memory(f"out{i}", obj_out.key, nbytes(x))
        obj_out.write(torch.full(x.shape, NAN))
        if bad == "truncated":  # hidden_states alone in the region, read by the step thread: past the end now
            spec = {"hidden_states": spec["hidden_states"]}
            os.truncate(f"/dev/shm/{os.path.basename(obj_in.key)}", nbytes(x) // 2)
        if bad == "output truncated":  # found when the answer is written, after the step
            os.truncate(f"/dev/shm/{os.path.basename(obj_out.key)}", nbytes(x) // 2)
        setup.append((spec, obj_out, f"out{i}"))

    def run(i):
        protocol, path, bad, x, ids, w = cases[i]
        c = client(server, protocol)
        try:
            if setup[i] is None:
                return "ok", infer(c, protocol, x, ids, w)[0], ""
            spec, obj_out, out_name = setup[i]
            infer(c, protocol, x, ids, w, inputs_in=spec, output_in=(out_name, nbytes(x), 0))
            return "ok", obj_out.read(torch.float32, x.shape), ""
        except InferenceServerException as e:
            return str(e.status()).removeprefix("StatusCode."), None, e.message()

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(run, range(len(cases))))
    for (protocol, path, bad, x, ids, w), (status, out, text) in zip(cases, answers, strict=True):
        if bad:
            assert status in ("400", "INVALID_ARGUMENT"), (bad, status, text)
            assert ("NaN" if bad == "nan" else "truncated") in text, text
            continue
        assert status == "ok", (protocol, path, x.shape, status, text)
        check(out, x, ids, w)
        solo, _ = infer(client(server, "grpc"), "grpc", x, ids, w)  # alone: a step of its own
        assert (out - solo).abs().max() <= 1e-4 * solo.abs().max(), (protocol, path, x.shape)  # rows of another: ~1


# ---- several front ends -------------------------------------------------------------------------

CLIENTS = 24  # connections per protocol: P(all on one of 2 processes) = 2 * 2**-24
FRONTEND_LISTEN_S = 60.0


@pytest.fixture(scope="module")
def two_frontends(tmp_path_factory):
    with ServerProcess.serving(tmp_path_factory.mktemp("shm2") / "server.log", "--shared-memory", "system",
                               "--frontends", "2") as proc:
        # Ready is the owner's word; the other front end binds its ports once it knows the group's
        # state, which may be a moment later on a busy machine.
        (fe1,) = proc.frontend_pids()
        deadline = time.monotonic() + FRONTEND_LISTEN_S
        ports = {f":{proc.http_port}", f":{proc.grpc_port}"}
        while not all(any(a.endswith(p) for a in listening({fe1})) for p in ports):
            assert time.monotonic() < deadline, f"front end 1 (pid {fe1}) does not listen on {ports}"
            time.sleep(0.2)
        yield proc


def test_region_registered_on_one_front_end_serves_on_every_one(two_frontends, objects):
    """Register through one connection, then infer at once through 24 HTTP clients and 24 gRPC
    connections spread over both front-end processes: every one is served from the region;
    unregister through one connection, and at once every connection gets NOT_FOUND; then, with no
    traffic, every process closes its descriptors of the unregistered objects."""
    server = two_frontends
    x, ids, w = inputs(11, seed=77)
    first = client(server, "grpc")
    wire, _ = infer(first, "grpc", x, ids, w)
    with contextlib.ExitStack() as stack:
        clients = [(p, client(server, p)) for p in PROTOCOLS for _ in range(CLIENTS)]
        for _, c in clients:
            stack.callback(c.close)
            assert c.is_server_ready()  # connected
        processes = {server.pid, *server.frontend_pids()}
        # Each gRPC client keeps its connection, so both processes must hold some. tritonclient's
        # HTTP client does not keep its connection after a call (none of 5 is established right
        # after is_server_ready): each of its requests is a new connection the kernel hands to
        # either process, so the HTTP port's count at this moment proves nothing (it failed
        # 2 runs in 8 when it was asserted).
        held = holders(server.grpc_port)
        assert set(held) == processes, f"gRPC port: connections per process {held}, processes {processes}"
        objs, paths = [], set()
        for i, (protocol, c) in enumerate(clients):
            obj_in, obj_out = objects(nbytes(x) + nbytes(ids.to(torch.int32)) + nbytes(w)), objects(nbytes(x))
            paths.update(f"/dev/shm/{os.path.basename(o.key)}" for o in (obj_in, obj_out))
            register = clients[(i + 1) % len(clients)][1]  # through another connection than the infer's
            spec = register_inputs(register, obj_in, x, ids, w, f"in{i}")
            register.register_system_shared_memory(f"out{i}", obj_out.key, nbytes(x))
            obj_out.write(torch.full(x.shape, NAN))
            infer(c, protocol, x, ids, w, inputs_in=spec, output_in=(f"out{i}", nbytes(x), 0))
            assert torch.equal(obj_out.read(torch.float32, x.shape), wire), (i, protocol)
            c.unregister_system_shared_memory(f"out{i}")  # (48 input regions stay: under MAX_REGIONS)
            objs.append(spec)
        first.unregister_system_shared_memory()
        for i, (protocol, c) in enumerate(clients):
            status, text = error_of(lambda c=c, p=protocol, s=objs[i]: infer(c, p, x, ids, w, inputs_in=s))
            assert status in ("404", "NOT_FOUND") and f"'in{i}'" in text, (i, status, text)
    # With no traffic left, every front end (also the one that never saw the unregister call)
    # closes its descriptors of the unregistered objects within about PRUNE_PERIOD_S.
    deadline = time.monotonic() + regions.PRUNE_PERIOD_S + PRUNE_MARGIN_S
    while held := descriptors(processes, paths):
        assert time.monotonic() < deadline, f"descriptors of unregistered objects still held: {held}"
        time.sleep(0.1)


PRUNE_MARGIN_S = 4.0  # past PRUNE_PERIOD_S: a busy CI machine


def descriptors(pids, paths: set[str]) -> dict[int, list[str]]:
    """pid -> which of `paths` (files in /dev/shm) it holds a descriptor of."""
    held: dict[int, list[str]] = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # (closed meanwhile)
                target = os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)")
                if target in paths:
                    held.setdefault(pid, []).append(target)
    return held


# ---- the registry shared by several processes ----------------------------------------------------

RACE_NAMES = 30   # names both processes register at once, per round
RACE_ROUNDS = 12  # (the shared-description bug lost updates in most rounds of 30 names)


def _registrar(fd: int, key: str, tag: str) -> None:
    """One front end's registrations, run by test_two_processes_share_the_registry in a process of
    its own that inherited the table's descriptor `fd` (as fleet's SCM_RIGHTS hands it: the same
    open file description). Per line "round" on stdin: register every shared name with `key`,
    and between them register and unregister names of its own; then one JSON line on stdout, the
    shared names whose register call succeeded."""
    own = regions.Regions(regions.RegionTable(fd))
    for line in sys.stdin:
        r = int(line)
        won = []
        for i in range(RACE_NAMES):
            mine = f"{tag}{r}-{i}"
            own.register(mine, key, 0, 64)
            try:
                own.register(f"s{r}-{i}", key, 0, 64)
                won.append(f"s{r}-{i}")
            except regions.RegionExists:
                pass
            own.unregister(mine)
        sys.stdout.write(json.dumps(won) + "\n")
        sys.stdout.flush()


def test_two_processes_share_the_registry(objects):
    """Two processes registering and unregistering at once through one table (the descriptor
    handed over as fleet does): no name is accepted by both, no update is lost, no unregistered
    name comes back. Every answer agrees with the final table."""
    table = regions.RegionTable.create()
    view = regions.Regions(table)
    keys = {"a": objects(64).key, "b": objects(64).key}
    procs = {tag: subprocess.Popen(
        [sys.executable, "-c", "import sys; from tests.api.test_shared_memory import _registrar; "
                               f"_registrar({table.fd}, {key!r}, {tag!r})"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=[table.fd])
        for tag, key in keys.items()}

    def answer(tag: str) -> set[str]:
        line = procs[tag].stdout.readline()
        assert line, f"registrar {tag} failed: {procs[tag].communicate(timeout=30)[1][-2000:]}"
        return set(json.loads(line))

    try:
        for r in range(RACE_ROUNDS):
            for p in procs.values():
                p.stdin.write(f"{r}\n")
                p.stdin.flush()
            won = {tag: answer(tag) for tag in procs}
            final = {name: region.key for name, region in table.state().regions.items()}
            both = won["a"] & won["b"]
            assert not both, f"round {r}: accepted by both processes: {sorted(both)}"
            want = {name: keys[tag] for tag in won for name in won[tag]}
            assert final == want, (f"round {r}: the table {sorted(final)} is not what the answers said "
                                   f"{sorted(want)}")
            assert len(final) == RACE_NAMES
            view.unregister("")
    finally:
        for p in procs.values():
            with contextlib.suppress(BrokenPipeError, ValueError):  # (a registrar that failed)
                p.stdin.close()
            p.wait(timeout=30)
        table.close()
    assert all(p.returncode == 0 for p in procs.values()), {t: p.returncode for t, p in procs.items()}


def test_idle_descriptors_are_pruned_against_their_own_state():
    """A thread that prunes with a state it read before an unregister (by another front end), after
    another thread read the newer one, must not mark the newer version as pruned: the descriptor of
    the unregistered region is dropped when the newer state is pruned."""
    table = regions.RegionTable.create()
    key = _key()
    path = f"{regions.SHM_ROOT}/{key[1:]}"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # (no descriptor of the test's own)
    os.truncate(path, 64)
    front, other = regions.Regions(table), regions.Regions(regions.RegionTable(os.dup(table.fd)))
    try:
        other.register("r", key, 0, 64)
        front.rows("r", 0, 64, torch.float32, [1, 16], "input 'hidden_states'")  # front opens it
        old = table.state()  # one thread's lookup reads the table...
        other.unregister("r")
        new = table.state()  # ...another's reads it after the unregister
        front._prune(old)  # the first prunes (late)
        front._prune(new)  # the second prunes
        gc.collect()
        assert not descriptors([os.getpid()], {path}), "the unregistered region's object is still open"
    finally:
        os.unlink(path)
        table.close()
        other.table.close()


def test_a_registration_pruned_before_it_is_cached_is_dropped_at_the_next_prune():
    """Another front end unregisters a name right after this one registered it, and a thread here
    prunes at that newer version before register() caches its descriptor: the next prune must still
    drop that descriptor (before, every later prune saw the same version and skipped it)."""
    table = regions.RegionTable.create()
    key = _key()
    path = f"{regions.SHM_ROOT}/{key[1:]}"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    os.truncate(path, 64)
    front, other = regions.Regions(table), regions.Regions(regions.RegionTable(os.dup(table.fd)))
    real = table.update

    def update(change):
        result = real(change)
        table.update = real  # once: between register()'s update and its insert
        other.unregister("r")
        front.refresh()
        return result

    table.update = update
    try:
        front.register("r", key, 0, 64)
        assert "r" not in table.state().regions
        front.refresh()
        gc.collect()
        assert not descriptors([os.getpid()], {path}), "a descriptor of the unregistered region stays open"
    finally:
        os.unlink(path)
        table.close()
        other.table.close()


# ---- nothing written after the error ------------------------------------------------------------


@pytest.mark.parametrize("case", ["timeout", "timeout in the second step", "cancelled", "NaN in the second step"])
def test_no_write_into_the_output_region_after_the_error(objects, case):
    """A request whose answer goes into its output region and that fails (its deadline passes while
    a step runs, its caller is cancelled: a disconnect, or a bad row in a later piece) never has its
    region written once the error is out: the client may reuse it at once. (Rows of an earlier
    step may have been written: unspecified, as with Triton.)"""
    T = 3 if case in ("timeout", "cancelled") else BUDGET + 5  # one step, or two
    x, ids, w = batch(T, seed=61)
    if case.startswith("NaN"):
        x[BUDGET + 2, 1] = NAN
    table = regions.RegionTable.create()
    obj = objects(nbytes(x))
    gen = torch.Generator().manual_seed(62)

    async def main():
        own = regions.Regions(table)
        own.register("out", obj.key, 0, nbytes(x))
        obj.write(torch.full(x.shape, NAN))
        out = own.rows("out", 0, nbytes(x), torch.float32, list(x.shape), "output 'output'", output=True)
        b = await started(FakeGroup(BATCHER_CFG, slots=1, step_s=STEP_S), slots=1)
        submit = b.submit(x, ids, w, timeout_s=LATE_TIMEOUT_S[T > BUDGET] if "timeout" in case else 5.0, out=out)
        if case == "cancelled":
            task = asyncio.ensure_future(submit)
            await asyncio.sleep(STEP_S / 4)  # in its step
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(DeadlineExceeded if "timeout" in case else InvalidInput):
                await submit
        reuse = torch.randn(x.shape, generator=gen)  # the client's next request, at once
        obj.write(reuse)
        await b.close(timeout_s=10 * STEP_S)  # every step has finished
        return reuse

    reuse = asyncio.run(main())
    assert torch.equal(obj.read(torch.float32, x.shape), reuse), "the output region was written after the error"
    table.close()


def test_rows_read_from_a_region_in_split_ranges(objects, split_every_piece):
    """copy_threads=3 with every piece split: a request's rows read from its input region range by
    range (preads at each range's offset) answer as the same rows sent as a tensor, bit for bit, and
    its answer written into its output region too; a NaN in the last range of a later piece is
    named by its row."""
    T = BUDGET + 7  # two steps
    x, ids, w = batch(T, seed=71)
    bad_x = x.clone()
    bad_x[BUDGET + 6, 0] = NAN  # the second piece's last range
    table = regions.RegionTable.create()
    objs = {name: objects(nbytes(x)) for name in ("in", "out", "bad")}
    objs["in"].write(x)
    objs["bad"].write(bad_x)

    async def main():
        own = regions.Regions(table)
        for name, obj in objs.items():
            own.register(name, obj.key, 0, nbytes(x))

        def rows(name, output=False):
            return own.rows(name, 0, nbytes(x), torch.float32, list(x.shape), f"{name} rows", output=output)

        b = await started(FakeGroup(BATCHER_CFG), copy_threads=3)
        wire = await b.submit(x, ids, w, timeout_s=5.0)
        await b.submit(rows("in"), ids, w, timeout_s=5.0, out=rows("out", output=True))
        with pytest.raises(InvalidInput, match=f"row {BUDGET + 6}\\)"):
            await b.submit(rows("bad"), ids, w, timeout_s=5.0)
        await b.close()
        return wire

    wire = asyncio.run(main())
    assert torch.equal(objs["out"].read(torch.float32, x.shape), wire)
    table.close()


def test_the_answer_is_written_into_its_region_in_split_ranges(objects, split_every_piece, monkeypatch):
    """copy_threads=3 with every piece split: a request of two steps (BUDGET + 7 rows) has each piece
    of its answer written into its output region in 3 row ranges, as the answer to the wire is copied
    out (before: one whole write per piece, on the step thread alone), and the region holds the
    wire's answer bit for bit."""
    import service.api.batcher as batcher_mod

    T = BUDGET + 7
    x, ids, w = batch(T, seed=74)
    table = regions.RegionTable.create()
    obj = objects(nbytes(x))
    real, ranges = batcher_mod._write_out, []

    def write_out(dst, src, lo, hi):
        ranges.append((dst.at, lo, hi))
        return real(dst, src, lo, hi)

    monkeypatch.setattr(batcher_mod, "_write_out", write_out)

    async def main():
        own = regions.Regions(table)
        own.register("out", obj.key, 0, nbytes(x))
        out = own.rows("out", 0, nbytes(x), torch.float32, list(x.shape), "output 'output'", output=True)
        b = await started(FakeGroup(BATCHER_CFG), copy_threads=3)
        wire = await b.submit(x, ids, w, timeout_s=5.0)
        await b.submit(x, ids, w, timeout_s=5.0, out=out)
        await b.close()
        return wire

    wire = asyncio.run(main())
    table.close()
    row = x.shape[1] * x.element_size()
    assert sorted(ranges) == [(0, 0, 2), (0, 2, 5), (0, 5, 8), (BUDGET * row, 0, 2), (BUDGET * row, 2, 4),
                              (BUDGET * row, 4, 7)], ranges
    assert torch.equal(obj.read(torch.float32, x.shape), wire)


def test_no_range_writes_the_output_region_after_its_request_is_cancelled(objects, split_every_piece, monkeypatch):
    """copy_threads=3: the request is cancelled (its client left) while its answer's ranges are being
    written into its output region (the step thread's range done, the helpers' still to write, each
    waiting until the cancel is being handled): the cancel waits for every range, so the client, who
    reuses its region once it has its error, finds its own bytes there (the bug this guards against:
    the request's lock released before the helpers' ranges had written)."""
    import service.api.batcher as batcher_mod

    x, ids, w = batch(BUDGET, seed=75)
    table = regions.RegionTable.create()
    obj = objects(nbytes(x))
    real_write, real_forget = batcher_mod._write_out, batcher_mod.Batcher._forget
    forgetting = concurrent.futures.Future()
    events: list[str] = []
    here: dict = {}

    def write_out(dst, src, lo, hi):
        if lo == 0:  # the step thread's range: cancel the request now
            here["loop"].call_soon_threadsafe(here["task"].cancel)
            return real_write(dst, src, lo, hi)
        forgetting.result(timeout=5)  # the loop is in _forget, waiting for the request's lock
        time.sleep(0.05)
        err = real_write(dst, src, lo, hi)
        events.append(f"range {lo} written")
        return err

    def forget(self, job):
        if not forgetting.done():
            forgetting.set_result(None)
        real_forget(self, job)
        events.append("forgotten")

    monkeypatch.setattr(batcher_mod, "_write_out", write_out)
    monkeypatch.setattr(batcher_mod.Batcher, "_forget", forget)

    async def main():
        own = regions.Regions(table)
        own.register("out", obj.key, 0, nbytes(x))
        out = own.rows("out", 0, nbytes(x), torch.float32, list(x.shape), "output 'output'", output=True)
        b = await started(FakeGroup(BATCHER_CFG), copy_threads=3)
        here["loop"] = asyncio.get_running_loop()
        here["task"] = asyncio.ensure_future(b.submit(x, ids, w, timeout_s=5.0, out=out))
        with pytest.raises(asyncio.CancelledError):
            await here["task"]
        reuse = torch.randn(x.shape, generator=torch.Generator().manual_seed(76))
        obj.write(reuse)  # the client's next request, at once
        await b.close(timeout_s=5.0)
        return reuse

    reuse = asyncio.run(main())
    table.close()
    assert sorted(events[:2]) == ["range 2 written", "range 5 written"] and events[2:] == ["forgotten"], events
    assert torch.equal(obj.read(torch.float32, x.shape), reuse), "a range wrote the region after the cancel"


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize("copy_threads", [1, 3])
def test_a_truncated_region_gets_the_same_400_whatever_the_copy_threads(objects, split_every_piece, copy_threads,
                                                                        side):
    """An input or output object truncated after it was registered, past row 6 of 8 (inside the last
    of 3 ranges): the request gets the truncation error that one whole copy reports, naming the
    object's size and the bytes its region needs, with one copy thread and with 3. Input: its row 1
    (in the first range) holds a NaN, and the error is never that NaN, found by a range before the
    truncation (the whole read stops there and checks nothing). Output: ranges before the cut may
    have written (a failed request's output bytes are unspecified). The next request of the same
    batcher is answered."""
    x, ids, w = batch(BUDGET, seed=72)
    if side == "input":
        x[1, 0] = NAN
    table = regions.RegionTable.create()
    obj = objects(nbytes(x))
    obj.write(x)
    group = FakeGroup(BATCHER_CFG)

    async def main():
        own = regions.Regions(table)
        own.register("r", obj.key, 0, nbytes(x))
        os.truncate(f"/dev/shm/{os.path.basename(obj.key)}", nbytes(x) * 6 // BUDGET)
        rows = own.rows("r", 0, nbytes(x), torch.float32, list(x.shape), "hidden_states", output=side == "output")
        b = await started(group, copy_threads=copy_threads)
        with pytest.raises(InvalidInput) as err:
            await (b.submit(rows, ids, w, timeout_s=5.0) if side == "input" else
                   b.submit(x, ids, w, timeout_s=5.0, out=rows))
        good = batch(5, seed=73)
        out = await b.submit(*good, timeout_s=5.0)
        await b.close()
        return str(err.value), good, out

    msg, good, out = asyncio.run(main())
    table.close()
    needed = f"is now {nbytes(x) * 6 // BUDGET} bytes; the region needs {nbytes(x)} (bytes 0..{nbytes(x) - 1})"
    assert needed in msg, msg
    assert "NaN" not in msg, msg
    assert rel_err(out, group.ref(*good)) < TOL[torch.float32]


@pytest.mark.parametrize("T", [1, 7])
def test_rows_converted_chunk_by_chunk_equal_one_conversion(objects, monkeypatch, T):
    """Rows whose region's dtype is not the slot's are converted a chunk of rows at a time (3 rows of
    fp32 here: chunks of 3, 3 and 1 for T=7), never through a copy of the whole: read into bf16 rows
    they are the whole tensor's conversion bit for bit, bf16 rows written into an fp32 region (and a
    non-contiguous fp32 view) read back as their own values, and an object cut inside the last chunk
    gets the truncation error naming its size."""
    monkeypatch.setattr(regions, "CONVERT_BYTES", 3 * 8 * 4)
    gen = torch.Generator().manual_seed(79)
    x = torch.randn(T, 8, generator=gen) * 100
    table = regions.RegionTable.create()
    objs = {name: objects(nbytes(x)) for name in ("in", "out", "strided")}
    objs["in"].write(x)
    own = regions.Regions(table)
    for name, obj in objs.items():
        own.register(name, obj.key, 0, nbytes(x))

    def rows(name):
        return own.rows(name, 0, nbytes(x), torch.float32, list(x.shape), f"{name} rows", output=name != "in")

    got = torch.empty(T, 8, dtype=torch.bfloat16)
    rows("in").read_into(got)
    assert torch.equal(got, x.to(torch.bfloat16))
    rows("out").write_from(got)
    assert torch.equal(objs["out"].read(torch.float32, x.shape), got.float())
    strided = torch.randn(T, 16, generator=gen)[:, ::2]
    rows("strided").write_from(strided)
    assert torch.equal(objs["strided"].read(torch.float32, x.shape), strided)
    if T > 6:
        os.truncate(f"/dev/shm/{os.path.basename(objs['in'].key)}", nbytes(x) - 4)
        cut = f"is now {nbytes(x) - 4} bytes; the region needs {nbytes(x)}"
        with pytest.raises(InvalidInput, match=re.escape(cut)):
            rows("in").read_into(got)
    table.close()


def test_a_truncated_object_is_named_with_its_size_and_the_bytes_needed(objects):
    """A region whose object was cut to 100 bytes after it was registered: reading its rows and
    writing an answer into it both say how large the object is now and how many bytes the region
    needs (before: "ends at byte 5120", the offset of the read, as if that were its size)."""
    x, _, _ = batch(5, seed=72)
    at = 5120
    obj = objects(at + nbytes(x))
    table = regions.RegionTable.create()
    own = regions.Regions(table)
    own.register("cut", obj.key, at, nbytes(x))
    rows = own.rows("cut", 0, nbytes(x), torch.float32, list(x.shape), "hidden_states")
    os.truncate(f"/dev/shm/{os.path.basename(obj.key)}", 100)
    needed = f"is now 100 bytes; the region needs {at + nbytes(x)} (bytes {at}..{at + nbytes(x) - 1})"
    with pytest.raises(InvalidInput, match=re.escape(needed)):
        rows.read()
    with pytest.raises(InvalidInput, match=re.escape(needed)):
        rows.write_from(x)
    table.close()


def test_a_failed_step_leaves_no_descriptor_behind(objects):
    """A step that fails (a rank error) fails its requests with its exception; that exception's
    traceback must not hold the step's pieces (and so the requests' region objects) in a cycle that
    only the cyclic collector frees: the object of an unregistered region is closed at once."""
    x, ids, w = batch(4, seed=63)
    table = regions.RegionTable.create()
    obj = objects(nbytes(x))

    async def main():
        own = regions.Regions(table)
        own.register("out", obj.key, 0, nbytes(x))
        out = own.rows("out", 0, nbytes(x), torch.float32, list(x.shape), "output 'output'", output=True)
        held = weakref.ref(out.obj)
        b = await started(FakeGroup(BATCHER_CFG, fail_at_step=0), on_failure=lambda group, exc: None)
        with pytest.raises(WorkerError):
            await b.submit(x, ids, w, timeout_s=5.0, out=out)
        del out
        own.unregister("out")
        await b.close(timeout_s=5.0)
        return held

    enabled = gc.isenabled()
    gc.disable()
    try:
        held = asyncio.run(main())
        assert held() is None, "the failed request's region object is still alive (held by a cycle)"
    finally:
        if enabled:
            gc.enable()
        table.close()


STEP_S = 0.4  # the fake group's step
LATE_TIMEOUT_S = {False: 0.1, True: 1.5 * STEP_S}  # one step: during it; two: during the second


# ---- a routing tensor's shape is checked before it is read -------------------------------------


def test_routing_in_a_region_is_read_only_once_its_shape_fits(objects, monkeypatch):
    """A small request naming a large region as topk_ids (or topk_weights) with a shape other than
    [T, K] for its hidden_states, or more tokens than max_tokens, is refused before any byte of the
    region is read."""
    spec = codecs.ModelSpec.of(CFG, max_tokens=1000)
    big_rows = 1 << 16
    size = max(big_rows * spec.K, (spec.max_tokens + 1) * spec.H) * 4
    obj = objects(size)
    own = regions.Regions(regions.RegionTable.create())
    own.register("big", obj.key, 0, size)
    reads: list = []
    real = regions._Object.read_into
    monkeypatch.setattr(regions._Object, "read_into", lambda self, buf, at: (reads.append(len(buf)),
                                                                              real(self, buf, at)))
    x, _, w = inputs(1, seed=9)

    def body(hidden_shape, name, shape) -> bytes:
        hidden = {"name": "hidden_states", "datatype": "FP32", "shape": hidden_shape}
        if hidden_shape[0] == 1:
            hidden["data"] = x.reshape(-1).tolist()
        else:
            hidden["parameters"] = {"shared_memory_region": "big",
                                    "shared_memory_byte_size": hidden_shape[0] * spec.H * 4}
        routing = {"topk_ids": ("INT32", [[0] * spec.K]), "topk_weights": ("FP32", w.tolist())}
        items = [hidden]
        for n, (dtype, data) in routing.items():
            if n == name:
                items.append({"name": n, "datatype": dtype, "shape": shape, "parameters": {
                    "shared_memory_region": "big", "shared_memory_byte_size": shape[0] * shape[1] * 4}})
            else:
                items.append({"name": n, "datatype": dtype, "shape": [1, spec.K], "data": data})
        return json.dumps({"inputs": items}).encode()

    cases = [
        (([1, spec.H], "topk_ids", [big_rows, spec.K]), "topk_ids has"),
        (([1, spec.H], "topk_weights", [big_rows, spec.K]), "topk_weights has"),
        (([1, spec.H], "topk_ids", [1, big_rows * spec.K]), "topk_ids must have shape"),
        (([spec.max_tokens + 1, spec.H], "topk_ids", [spec.max_tokens + 1, spec.K]), "more than the limit"),
    ]
    for args, words in cases:
        raw = body(*args)
        assert len(raw) < 8192  # a few KB of request naming a region of megabytes
        with pytest.raises(InvalidInput, match=words):
            codecs.decode_v2_http(raw, None, spec, own)
        assert reads == [], (args, reads)
    own.table.close()


# ---- off by default -----------------------------------------------------------------------------


def test_off_by_default():
    """Without --shared-memory system every call of the extension is refused with a 400 (gRPC
    FAILED_PRECONDITION) naming the flag, and the server metadata does not list it."""
    assert Settings().shared_memory == "off"
    fe = make_frontend()
    assert "system_shared_memory" not in fe.server_metadata()["extensions"]
    with TestClient(create_app(fe)) as http:
        for method, path, body in (("GET", "/v2/systemsharedmemory/status", None),
                                   ("GET", "/v2/systemsharedmemory/region/a/status", None),
                                   ("POST", "/v2/systemsharedmemory/region/a/register",
                                    {"key": "/a", "offset": 0, "byte_size": 8}),
                                   ("POST", "/v2/systemsharedmemory/unregister", None),
                                   ("POST", "/v2/systemsharedmemory/region/a/unregister", None)):
            r = http.request(method, path, json=body)
            assert r.status_code == 400 and "--shared-memory system" in r.json()["error"], (path, r.text)
    x, ids, w = inputs(2, seed=1)
    request = pb.ModelInferRequest(model_name=MODEL)
    for name, dt, t in zip(codecs.INPUT_NAMES, ("FP32", "INT64", "FP32"), (x, ids, w), strict=True):
        item = request.inputs.add(name=name, datatype=dt, shape=list(t.shape))
        if name == "hidden_states":
            item.parameters["shared_memory_region"].string_param = "a"
            item.parameters["shared_memory_byte_size"].int64_param = nbytes(x)
        else:
            request.raw_input_contents.append(codecs.to_bytes(t))
    with pytest.raises(regions.SharedMemoryOff) as info:
        grpc_codec.decode_grpc(grpc_codec.parse_grpc_request(request.SerializeToString()), fe.spec, fe.regions)
    assert classify(info.value) == (400, grpc.StatusCode.FAILED_PRECONDITION)

    class Context:
        code = None

        def set_code(self, code):
            self.code = code

        def set_details(self, text):
            self.details = text

    servicer = InferenceServicer(fe)
    for call, message in ((servicer.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest()),
                          (servicer.SystemSharedMemoryRegister, pb.SystemSharedMemoryRegisterRequest(
                              name="a", key="/a", byte_size=8)),
                          (servicer.SystemSharedMemoryUnregister, pb.SystemSharedMemoryUnregisterRequest())):
        context = Context()
        assert asyncio.run(call(message, context)) is None
        assert context.code == grpc.StatusCode.FAILED_PRECONDITION and "--shared-memory system" in context.details


def test_the_servers_own_files_are_refused(tmp_path):
    """A hard link to one of the server's own files (a slot, the registry) under a client's name is
    refused by inode, at register and at use (reserved after the region was registered)."""
    table = regions.RegionTable.create()
    own = regions.Regions(table)
    try:
        slot_fd = os.open(f"/dev/shm/{_key()[1:]}", os.O_CREAT | os.O_RDWR, 0o600)  # stands for a slot
        os.ftruncate(slot_fd, 4096)
        slot_path = os.readlink(f"/proc/self/fd/{slot_fd}")
        alias = _key()
        os.link(slot_path, f"/dev/shm/{alias[1:]}")
        own.register("early", alias, 0, 64)  # before the group that owns the file started
        x = own.rows("early", 0, 64, torch.float32, [1, 16], "input 'hidden_states'")
        assert x.read().shape == (1, 16)
        table.reserve([slot_fd])
        with pytest.raises(regions.InvalidInput, match="this server's own"):
            own.register("late", alias, 0, 64)
        for view in (own, regions.Regions(table)):  # (own held a descriptor of it already)
            with pytest.raises(regions.InvalidInput, match="this server's own"):
                view.rows("early", 0, 64, torch.float32, [1, 16], "input 'hidden_states'")
    finally:
        for path in (slot_path, f"/dev/shm/{alias[1:]}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.close(slot_fd)
        table.close()


def test_readme_example_runs(server):
    """The README's tritonclient example, as a user pastes it (its keys made unique, its address
    this server's): the answer it reads from its output region is the layer's."""
    lines = (Path(__file__).parents[2] / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("With tritonclient:")) + 2
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    code = "\n".join(block)
    tag = uuid.uuid4().hex[:8]
    code = code.replace("localhost:8000", server.url.removeprefix("http://"))
    code = code.replace('"/my_in"', f'"/my_in_{tag}"').replace('"/my_out"', f'"/my_out_{tag}"')
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    x, ids, w = (torch.from_numpy(scope[k]) for k in ("x", "ids", "w"))
    check(torch.from_numpy(np.array(scope["answer"])), x, ids, w)


# ---- perf_analyzer ------------------------------------------------------------------------------


@contextlib.contextmanager
def perf_analyzer_objects():
    """Held while perf_analyzer --shared-memory system runs, by every test run on this host.
    perf_analyzer names its objects after the tensors (/hidden_states_0_0 ... /output), the same
    in every run: two runs at once (two checkouts' tests on one machine) unlinked and resized each
    other's objects ("Unable to unlink shared memory with key: topk_weights_0_2"; "its object
    /output is now 1024 bytes")."""
    with open(Path(tempfile.gettempdir()) / "moe-serve-tests-perf_analyzer-shm.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_perf_analyzer_with_system_shared_memory(server, protocol, tmp_path):
    """perf_analyzer --shared-memory system runs unchanged: it registers its regions, every request
    reads its inputs and writes its output there, none fails, and it unregisters them at the end,
    its CUDA regions too (none: before, that call was a 404 and it ended with "Unable to unregister
    all shared memory regions")."""
    binary = external_tool("perf_analyzer")
    data = tmp_path / "input.json"
    input_data(data)
    url = server.http_hostport if protocol == "http" else server.grpc_url
    cmd = [binary, "-m", MODEL, "-u", url, "-i", protocol, "-b", "1", "--input-data", str(data),
           "--shared-memory", "system", "--output-shared-memory-size", str(CFG.H * 4),
           "--measurement-mode", "count_windows", "--measurement-request-count", "10",
           "--stability-percentage", "1000", "--max-trials", "3"]
    before = httpx.get(f"{server.url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"][0]
    with perf_analyzer_objects():
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=PERF_ANALYZER_TIMEOUT_S,
                             env=perf_analyzer_env())
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "unable to" not in out.lower(), out  # perf_analyzer says "Unable to ..." for what failed
    after = httpx.get(f"{server.url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"][0]
    stats = {k: after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"]
             for k in ("success", "fail")}
    assert stats["success"] >= 10 and stats["fail"] == 0, (stats, out)
    assert client(server, "http").get_system_shared_memory_status() == [], "perf_analyzer's regions are left"


def test_grpc_inputs_in_regions_are_no_decode_work():
    """An input in a region is viewed, not converted: a grpc_shm request of many rows is decoded on
    the event loop (as v2_shm's), not sent to a thread; typed contents still count their shape."""
    from service.api.frontend import OFFLOAD_ELEMENTS

    T, H, K = 512, 4096, 8

    def request(routing_in_region: bool) -> grpc_codec.GrpcInferRequest:
        r = pb.ModelInferRequest(model_name="moe")
        x = r.inputs.add(name="hidden_states", datatype="BF16", shape=[T, H])
        x.parameters["shared_memory_region"].string_param = "in"
        x.parameters["shared_memory_byte_size"].int64_param = T * H * 2
        ids = r.inputs.add(name="topk_ids", datatype="INT32", shape=[T, K])
        w = r.inputs.add(name="topk_weights", datatype="FP32", shape=[T, K])
        for at, item in enumerate((ids, w)):
            if routing_in_region:
                item.parameters["shared_memory_region"].string_param = "in"
                item.parameters["shared_memory_offset"].int64_param = T * H * 2 + at * T * K * 4
                item.parameters["shared_memory_byte_size"].int64_param = T * K * 4
            else:
                getattr(item.contents, "int_contents" if at == 0 else "fp32_contents").extend([0] * (T * K))
        return grpc_codec.parse_grpc_request(r.SerializeToString())

    assert T * H > OFFLOAD_ELEMENTS  # a wire request of these rows would leave the loop
    assert grpc_codec.grpc_decode_work(request(routing_in_region=True)) == 0
    assert grpc_codec.grpc_decode_work(request(routing_in_region=False)) == 2 * T * K
