"""What HTTP and gRPC share: large requests leave the event loop, one list of protocols, the
model repository index."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from fastapi.testclient import TestClient
from safetensors.torch import save
from tritonclient.utils import InferenceServerException

from service.api import codecs, frontend, grpc_codec
from service.api.batcher import Batcher
from service.api.grpc import GrpcServer, InferenceServicer
from service.api.http import create_app
from service.api.proto import grpc_predict_v2_pb2 as pb
from service.config import Settings
from service.errors import GroupUnavailable
from service.metrics import PROTOCOLS, Metrics
from tests.api.common import CFG, inputs
from tests.serverproc import free_port


def make_frontend() -> frontend.Frontend:
    metrics = Metrics()
    batcher = Batcher(budget=CFG.tokens_per_step, delay_s=0.0, queue_tokens=1 << 16, slots=1, metrics=metrics)
    return frontend.Frontend(Settings(queue_tokens=1 << 16), CFG, metrics, batcher)


class Context:
    """The parts of grpc.aio.ServicerContext that ModelInfer uses."""

    def time_remaining(self):
        return None

    async def abort(self, code, details):
        raise AssertionError(f"aborted with {code}: {details}")


def test_grpc_decodes_large_typed_contents_off_the_event_loop(monkeypatch):
    """Raw contents are viewed, not converted: decoded on the loop at any size (hidden_states' values
    are checked later, in the slot). Typed contents past OFFLOAD_ELEMENTS are converted in a worker
    thread. The answer lands in the response's own buffer either way."""
    fe = make_frontend()
    decoded_on: list[tuple[int, bool, threading.Thread]] = []
    decode = grpc_codec.decode_grpc

    def recording(request, spec, regions=None):
        decoded_on.append((request.message.inputs[0].shape[0], bool(request.raw), threading.current_thread()))
        return decode(request, spec, regions)

    async def echo(req, transport_timeout_s=None, out=None):
        return out.copy_(req.x)

    monkeypatch.setattr(grpc_codec, "decode_grpc", recording)
    monkeypatch.setattr(fe, "infer", echo)
    big = frontend.OFFLOAD_ELEMENTS // CFG.H + 1  # hidden_states alone is over the threshold
    for T in (3, big):
        for raw in (True, False):
            x, ids, w = inputs(T, seed=T)
            request = pb.ModelInferRequest(model_name=fe.model_name)
            for name, dt, t in zip(codecs.INPUT_NAMES, ("FP32", "INT64", "FP32"), (x, ids, w), strict=True):
                item = request.inputs.add(name=name, datatype=dt, shape=list(t.shape))
                if raw:
                    request.raw_input_contents.append(codecs.to_bytes(t))
                else:
                    getattr(item.contents, "int64_contents" if dt == "INT64" else "fp32_contents").extend(
                        t.reshape(-1).tolist())
            received = grpc_codec.parse_grpc_request(request.SerializeToString())  # as the server's deserializer
            response = asyncio.run(InferenceServicer(fe).ModelInfer(received, Context())).to_message()
            out = torch.frombuffer(bytearray(response.raw_output_contents[0]), dtype=torch.float32)
            assert torch.equal(out.reshape(T, CFG.H), x)
    on_loop = {(T, raw): thread is threading.main_thread() for T, raw, thread in decoded_on}
    assert on_loop == {(3, True): True, (3, False): True, (big, True): True, (big, False): False}, on_loop


def test_large_json_bodies_and_answers_leave_the_event_loop(monkeypatch):
    """A JSON body is parsed, and a JSON answer written, in a worker thread when it is large
    (T=512 at H=256: 2.7 MB, 131k numbers; orjson holds the GIL ~15 ms for it, and in a thread the
    event loop gets the GIL back every switch interval); T=8 stays on the loop, and so does a
    safetensors body of T=512 (bytes / 4 elements)."""
    fe = make_frontend()
    where: list[tuple[str, int, bool]] = []

    def recording(name):
        fn = getattr(codecs, name)

        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            result = fn(*args, **kwargs)
            rows = result.x.shape[0] if name.startswith("decode") else args[0].shape[0]
            where.append((name, rows, on_loop))
            return result
        return call

    for name in ("decode_forward_json", "encode_forward_json", "decode_v2_http", "encode_v2_http",
                 "decode_safetensors", "encode_safetensors"):
        monkeypatch.setattr(codecs, name, recording(name))

    async def echo(req, transport_timeout_s=None, out=None):
        return req.x.float()

    monkeypatch.setattr(fe, "infer", echo)
    with TestClient(create_app(fe)) as http:
        for T in (8, 512):
            x, ids, w = inputs(T, seed=T)
            r = http.post("/moe/forward", json={"hidden_states": x.tolist(), "topk_ids": ids.tolist(),
                                                "topk_weights": w.tolist()})
            assert r.status_code == 200 and torch.equal(torch.tensor(r.json()["output"]), x), r.text[:200]
            body = {"inputs": [{"name": n, "datatype": d, "shape": list(t.shape), "data": t.reshape(-1).tolist()}
                               for n, d, t in zip(codecs.INPUT_NAMES, ("FP32", "INT64", "FP32"), (x, ids, w),
                                                  strict=True)]}
            r = http.post("/v2/models/moe/infer", content=json.dumps(body))
            assert r.status_code == 200, r.text[:200]
            assert torch.equal(torch.tensor(r.json()["outputs"][0]["data"]).reshape(T, CFG.H), x)
            r = http.post("/moe/forward", content=save({"hidden_states": x, "topk_ids": ids, "topk_weights": w}),
                          headers={"content-type": "application/x-safetensors"})
            assert r.status_code == 200, r.text[:200]
    on_loop = {(name, T): loop for name, T, loop in where}
    json_names = ("decode_forward_json", "encode_forward_json", "decode_v2_http", "encode_v2_http")
    assert on_loop == {**{(n, 8): True for n in json_names}, **{(n, 512): False for n in json_names},
                       ("decode_safetensors", 8): True, ("encode_safetensors", 8): True,
                       ("decode_safetensors", 512): True, ("encode_safetensors", 512): True}, on_loop


def test_one_list_of_protocols():
    assert frontend.PROTOCOLS is PROTOCOLS  # the front end takes the list from service.metrics
    fe = make_frontend()
    exported = {s.labels["protocol"] for m in fe.metrics.requests.collect() for s in m.samples}
    assert exported == set(PROTOCOLS)


def test_accepting_serves_before_ready_and_a_refusal_ends_it(monkeypatch):
    """The owner of several front ends serves its share while the others attach the group
    (Frontend.accept, service.server), reporting not ready until they all serve; set_ready(False)
    (a failed group, a drain) refuses again, also after an accept."""
    fe = make_frontend()

    async def echo(x, ids, w, timeout, out_dtype=None, out=None):
        return x

    monkeypatch.setattr(fe.batcher, "submit", echo)
    x, ids, w = inputs(3, seed=3)
    req = codecs.Decoded(x=x, ids=ids, w=w, out_dtype=x.dtype)

    def answered() -> bool:
        try:
            asyncio.run(fe.infer(req))
            return True
        except GroupUnavailable:
            return False

    assert not answered()  # starting
    fe.accept()
    assert answered() and not fe.ready and fe.metrics.ready._value.get() == 0
    fe.set_ready(True)
    assert answered() and fe.ready
    fe.set_ready(False, "the rank group failed")
    assert not answered()
    fe.accept()
    fe.set_ready(False, "the server is shutting down")  # a drain after an accept
    with pytest.raises(GroupUnavailable, match="shutting down"):
        asyncio.run(fe.infer(req))


def test_the_repository_index_follows_readiness():
    """Triton's index: the model UNAVAILABLE with the reason while the group is not ready (none at
    all with {"ready": true}), READY once it is."""
    fe = make_frontend()
    fe.set_ready(False, "the rank group is restarting")
    with TestClient(create_app(fe)) as client:
        assert client.post("/v2/repository/index").json() == [
            {"name": fe.model_name, "version": "1", "state": "UNAVAILABLE", "reason": "the rank group is restarting"}]
        assert client.post("/v2/repository/index", json={"ready": True}).json() == []
        fe.set_ready(True)
        assert client.post("/v2/repository/index", json={"ready": True}).json() == [
            {"name": fe.model_name, "version": "1", "state": "READY"}]
        bad = client.post("/v2/repository/index", content=b"[1]")
        assert bad.status_code == 400, bad.text


def error_of(call) -> tuple[str, str]:
    """A tritonclient call's failure: its status and message."""
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), info.value.message()


@contextlib.contextmanager
def grpc_serving(fe: frontend.Frontend):
    """`fe`'s gRPC server on a loopback port, its event loop in a thread; yields the address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()

    async def start() -> GrpcServer:
        server = GrpcServer(fe, "127.0.0.1", port)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_the_grpc_stream_call_is_refused_by_name():
    """tritonclient's start_stream / async_stream_infer: UNIMPLEMENTED naming ModelStreamInfer and
    what to use instead, at once (before: grpc's "Method not found!")."""
    fe = make_frontend()
    with grpc_serving(fe) as url:
        client = grpcclient.InferenceServerClient(url)
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=10)
        try:
            item = grpcclient.InferInput("hidden_states", [1, 4], "FP32")
            item.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
            try:
                client.async_stream_infer(fe.model_name, [item])
            except InferenceServerException:
                pass  # the refusal can end the stream before the request is sent: the callback has it
            result, error = answers.get(timeout=10)
        finally:
            client.stop_stream()
    assert result is None and error is not None
    assert error.status() == "StatusCode.UNIMPLEMENTED" and "ModelStreamInfer is not served" in error.message(), error


def test_the_grpc_repository_index_follows_readiness_as_http_does():
    """tritonclient.grpc's index: the model UNAVAILABLE with the reason while the group is not
    ready (none at all with ready=true), READY once it is; the same entries as HTTP's index.
    Before: UNIMPLEMENTED "Method not found!"."""
    fe = make_frontend()
    fe.set_ready(False, "the rank group is restarting")
    with grpc_serving(fe) as url, TestClient(create_app(fe)) as http, grpc.insecure_channel(url) as channel:
        client = grpcclient.InferenceServerClient(url)
        stub = grpcclient.service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def ready_only() -> list[tuple[str, str, str, str]]:
            index = stub.RepositoryIndex(grpcclient.service_pb2.RepositoryIndexRequest(ready=True), timeout=10)
            return [(m.name, m.version, m.state, m.reason) for m in index.models]

        unavailable = {"name": fe.model_name, "version": "1", "state": "UNAVAILABLE",
                       "reason": "the rank group is restarting"}
        assert client.get_model_repository_index(as_json=True) == {"models": [unavailable]}
        assert client.get_model_repository_index(as_json=True) == {"models": http.post("/v2/repository/index").json()}
        assert ready_only() == []
        fe.set_ready(True)
        assert client.get_model_repository_index(as_json=True) == {
            "models": [{"name": fe.model_name, "version": "1", "state": "READY"}]}
        assert ready_only() == [(fe.model_name, "1", "READY", "")]
        assert client.get_model_repository_index(as_json=True) == {"models": http.post("/v2/repository/index").json()}
        status, text = error_of(lambda: client.load_model(fe.model_name))
        assert status == "StatusCode.FAILED_PRECONDITION" and "cannot load or unload" in text, text


def test_inference_routes_skip_fastapis_stack_and_every_other_request_keeps_it(monkeypatch):
    """create_app's ASGI app (http.InferenceFirst): POST /moe/forward and POST /v2/models/{model}[/versions/
    {version}]/infer reach their handlers without FastAPI's stack; GET on them (405), a trailing slash,
    a root_path, the health and metadata routes all still go through it, with the answers they had."""
    from fastapi import FastAPI

    fe = make_frontend()
    through: list[str] = []
    real = FastAPI.__call__

    async def counted(self, scope, receive, send):
        if scope["type"] == "http":
            through.append(f"{scope['method']} {scope['path']}")
        await real(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", counted)

    async def echo(req, transport_timeout_s=None, out=None):
        return req.x.float()

    monkeypatch.setattr(fe, "infer", echo)
    x, ids, w = inputs(8, seed=3)
    body = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": list(t.shape), "data": t.reshape(-1).tolist()}
                                  for n, d, t in zip(codecs.INPUT_NAMES, ("FP32", "INT64", "FP32"), (x, ids, w),
                                                     strict=True)]})
    with TestClient(create_app(fe)) as http:
        for path in ("/v2/models/moe/infer", "/v2/models/moe/versions/1/infer"):
            r = http.post(path, content=body)
            assert r.status_code == 200, r.text[:200]
            assert torch.equal(torch.tensor(r.json()["outputs"][0]["data"]).reshape(8, CFG.H), x)
        r = http.post("/v2/models/other/infer", content=body)
        assert r.status_code == 404 and "other" in r.json()["error"], r.text
        r = http.post("/v2/models/moe/versions/7/infer", content=body)
        assert r.status_code == 404, r.text
        r = http.post("/moe/forward", json={"hidden_states": x.tolist(), "topk_ids": ids.tolist(),
                                            "topk_weights": w.tolist()})
        assert r.status_code == 200 and torch.equal(torch.tensor(r.json()["output"]), x), r.text[:200]
        r = http.post("/moe/forward", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert through == [], through  # every one of these answered without FastAPI's stack
        assert http.get("/v2/models/moe/infer").status_code == 405
        assert http.get("/moe/forward").status_code == 405
        assert http.get("/v2/health/live").json() == {"live": True}
        r = http.post("/v2/models/moe/infer/", content=body, follow_redirects=False)
        assert r.status_code in (307, 404), r.status_code  # FastAPI's own answer to a trailing slash
    assert through == ["GET /v2/models/moe/infer", "GET /moe/forward", "GET /v2/health/live",
                       "POST /v2/models/moe/infer/"], through
    with TestClient(create_app(fe), root_path="/api") as http:  # a root_path: FastAPI's routing, as before
        through.clear()
        r = http.post("/api/v2/models/moe/infer", content=body)
        assert r.status_code == 200, r.text[:200]
        assert len(through) == 1, through
