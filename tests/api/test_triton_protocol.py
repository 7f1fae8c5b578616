"""What a user of a Triton-compatible server expects, against one real CPU server, with stock
tritonclient calls: every model's statistics, the CUDA shared-memory calls of a server without
CUDA shared memory, model_version in every answer, gzip and deflate request bodies (and a zip
bomb refused within the body limit), and a metrics port that serves /metrics alone."""

from __future__ import annotations

import gzip
import zlib

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from service.api import grpc_codec, http
from service.api.error_map import PayloadTooLarge
from service.api.http import INFLATE_FLOOR
from service.api.proto import grpc_predict_v2_pb2 as pb
from tests.api.common import CFG, check, inputs
from tests.api.test_e2e import triton_inputs
from tests.serverproc import ServerProcess, free_port, rss_bytes

MODEL = "moe"
BODY_LIMIT = 4 << 20  # the server's --max-request-bytes: a bomb's output must stop near it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    metrics_port = free_port()  # picked as the server starts, not at import minutes before
    with ServerProcess.serving(tmp_path_factory.mktemp("triton") / "server.log", "--shared-memory", "system",
                               "--metrics-port", str(metrics_port),
                               "--max-request-bytes", str(BODY_LIMIT),
                               "--grpc-max-message-bytes", str(BODY_LIMIT)) as proc:
        proc.metrics_port = metrics_port
        yield proc


def http_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_hostport)


def grpc_client(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def error_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), info.value.message()


# ---- statistics of every model --------------------------------------------------------------


def test_statistics_of_every_model(server):
    """get_inference_statistics() with no model name (HTTP: GET /v2/models/stats) answers every
    model's statistics, ours, as the named call does (before: 404 "unknown model 'stats'")."""
    x, ids, w = inputs(5, seed=21)
    http_client(server).infer(MODEL, triton_inputs(httpclient, x, ids, w))
    every = http_client(server).get_inference_statistics()
    named = http_client(server).get_inference_statistics(MODEL)
    assert [m["name"] for m in every["model_stats"]] == [MODEL]
    assert every["model_stats"][0]["inference_count"] == named["model_stats"][0]["inference_count"] >= 5
    grpc_every = grpc_client(server).get_inference_statistics(as_json=True)
    assert [m["name"] for m in grpc_every["model_stats"]] == [MODEL]


# ---- CUDA shared memory: a server without it ------------------------------------------------


def test_cuda_shared_memory_status_is_empty_and_unregister_succeeds(server):
    """Triton's answers without CUDA shared memory: status lists no region, unregister (all, or a
    name) succeeds, status of a name is a 404 / NOT_FOUND, register is refused saying why (HTTP 400,
    gRPC UNIMPLEMENTED); the server metadata does not claim the extension. Before: 404 on HTTP and
    UNIMPLEMENTED on gRPC for every call (perf_analyzer: "Unable to unregister all shared memory
    regions")."""
    h, g = http_client(server), grpc_client(server)
    assert "cuda_shared_memory" not in h.get_server_metadata()["extensions"]
    assert "cuda_shared_memory" not in g.get_server_metadata().extensions
    assert h.get_cuda_shared_memory_status() == []
    assert not g.get_cuda_shared_memory_status().regions
    h.unregister_cuda_shared_memory()
    h.unregister_cuda_shared_memory("r")
    g.unregister_cuda_shared_memory()
    g.unregister_cuda_shared_memory("r")
    assert error_of(lambda: h.get_cuda_shared_memory_status("r"))[0] == "404"
    assert error_of(lambda: g.get_cuda_shared_memory_status("r"))[0] == "StatusCode.NOT_FOUND"
    for call, code in ((lambda: h.register_cuda_shared_memory("r", b"\1" * 64, 0, 1024), "400"),
                       (lambda: g.register_cuda_shared_memory("r", b"\1" * 64, 0, 1024), "StatusCode.UNIMPLEMENTED")):
        status, text = error_of(call)
        assert status == code and "CUDA shared memory is not supported" in text and "system" in text, text
    assert h.get_cuda_shared_memory_status() == []  # nothing was registered


# ---- the model repository: an index of the one model, no load or unload --------------------


def test_the_repository_index_lists_the_model_and_load_unload_are_refused_saying_why(server):
    """tritonclient.http's get_model_repository_index() answers Triton's index of the one model,
    READY (also with {"ready": true}); load_model / unload_model are refused with 400 naming why
    (the model is loaded at start), an unknown name with 404; a bad index body is a 400. Before:
    404 "Not Found" for every call, which said nothing."""
    h = http_client(server)
    assert h.get_model_repository_index() == [{"name": MODEL, "version": "1", "state": "READY"}]
    with httpx.Client(base_url=f"http://{server.http_hostport}", timeout=10) as c:
        assert c.post("/v2/repository/index", json={"ready": True}).json() == h.get_model_repository_index()
        bad = c.post("/v2/repository/index", json={"ready": "yes"})
        assert bad.status_code == 400 and "ready" in bad.json()["error"], bad.text
    for call in (lambda: h.load_model(MODEL), lambda: h.unload_model(MODEL)):
        status, text = error_of(call)
        assert status == "400" and "cannot load or unload" in text and repr(MODEL) in text, text
    status, text = error_of(lambda: h.load_model("other"))
    assert status == "404" and "unknown model 'other'" in text, text
    assert h.is_model_ready(MODEL)  # refused, and nothing unloaded


def test_the_grpc_repository_index_and_load_unload_answer_as_http_does(server):
    """tritonclient.grpc's get_model_repository_index() lists the one model READY (also with
    ready=true); load_model / unload_model are refused with FAILED_PRECONDITION naming why (Triton
    answers UNAVAILABLE, which clients retry: this refusal is for good), an unknown name NOT_FOUND,
    a repository_name UNIMPLEMENTED (Triton's UNSUPPORTED). Before: UNIMPLEMENTED "Method not
    found!" for every call (user's trial)."""
    g = grpc_client(server)
    ready = [{"name": MODEL, "version": "1", "state": "READY"}]
    assert g.get_model_repository_index(as_json=True) == {"models": ready}
    assert g.get_model_repository_index(as_json=True) == {"models": http_client(server).get_model_repository_index()}
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = grpcclient.service_pb2_grpc.GRPCInferenceServiceStub(channel)
        index = stub.RepositoryIndex(grpcclient.service_pb2.RepositoryIndexRequest(ready=True), timeout=10)
        assert [(m.name, m.version, m.state, m.reason) for m in index.models] == [(MODEL, "1", "READY", "")]
        for call, request in ((stub.RepositoryIndex, grpcclient.service_pb2.RepositoryIndexRequest),
                              (stub.RepositoryModelLoad, grpcclient.service_pb2.RepositoryModelLoadRequest)):
            with pytest.raises(grpc.RpcError) as info:
                call(request(repository_name="models"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, info.value.details()
            assert "'repository_name' specification is not supported" in info.value.details()
    for call in (lambda: g.load_model(MODEL), lambda: g.unload_model(MODEL),
                 lambda: g.unload_model(MODEL, unload_dependents=True)):
        status, text = error_of(call)
        assert status == "StatusCode.FAILED_PRECONDITION" and "cannot load or unload" in text, text
        assert repr(MODEL) in text, text
    for call in (lambda: g.load_model("other"), lambda: g.unload_model("other")):
        status, text = error_of(call)
        assert status == "StatusCode.NOT_FOUND" and "unknown model 'other'" in text, text
    assert g.is_model_ready(MODEL)  # refused, and nothing unloaded


# ---- model_version ----------------------------------------------------------------------------


def test_infer_answers_name_the_model_version(server):
    """Every v2 answer carries model_version "1", as Triton fills it (before: absent)."""
    x, ids, w = inputs(3, seed=22)
    for binary in (False, True):
        result = http_client(server).infer(MODEL, triton_inputs(httpclient, x, ids, w, binary=binary),
                                           outputs=[httpclient.InferRequestedOutput("output", binary_data=binary)])
        assert result.get_response()["model_version"] == "1", binary
        check(torch.from_numpy(result.as_numpy("output").copy()), x, ids, w)
    result = grpc_client(server).infer(MODEL, triton_inputs(grpcclient, x, ids, w))
    assert result.get_response().model_version == "1"


# ---- compressed request bodies ----------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_are_answered(server, algorithm):
    """tritonclient's request compression: HTTP Content-Encoding gzip / deflate (before: 415) and
    gRPC's own message compression; the answers are the uncompressed requests' answers."""
    x, ids, w = inputs(37, seed=23)
    for binary in (False, True):
        result = http_client(server).infer(MODEL, triton_inputs(httpclient, x, ids, w, binary=binary),
                                           request_compression_algorithm=algorithm)
        check(torch.from_numpy(result.as_numpy("output").copy()), x, ids, w)
    result = grpc_client(server).infer(MODEL, triton_inputs(grpcclient, x, ids, w), compression_algorithm=algorithm)
    check(torch.from_numpy(result.as_numpy("output").copy()), x, ids, w)


def test_a_zip_bomb_is_413_within_the_limit(server):
    """A 1 MiB gzip body that decompresses to 1 GiB is a 413 once its output passes
    --max-request-bytes (4 MiB): the front end's peak memory grows by about the limit, not the GiB.
    A corrupt, truncated or trailing-data body is a 400, an unknown encoding a 415; the server
    answers correctly afterwards."""
    url = f"{server.url}/v2/models/{MODEL}/infer"
    stream = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    bomb = b"".join([stream.compress(zeros) for _ in range(1024)] + [stream.flush()])
    assert len(bomb) < BODY_LIMIT
    peak = rss_bytes(server.pid, "VmHWM")
    r = httpx.post(url, content=bomb, headers={"Content-Encoding": "gzip"}, timeout=60)
    assert r.status_code == 413 and "decompresses to over the limit" in r.json()["error"], r.text
    assert rss_bytes(server.pid, "VmHWM") - peak < 16 * BODY_LIMIT, "the bomb was decompressed past the limit"

    body = b'{"inputs": []}'
    for content, encoding, status, needle in (
            (b"not gzip at all", "gzip", 400, "not valid gzip"),
            (gzip.compress(body)[:-9], "gzip", 400, "truncated"),
            (gzip.compress(body) + b"more", "gzip", 400, "after the end"),
            (zlib.compress(body)[:5], "deflate", 400, "truncated"),
            (body, "br", 415, "Content-Encoding 'br'")):
        r = httpx.post(url, content=content, headers={"Content-Encoding": encoding}, timeout=30)
        assert r.status_code == status and needle in r.json()["error"], (encoding, r.status_code, r.text)
    x, ids, w = inputs(2, seed=24)
    check(torch.from_numpy(http_client(server).infer(MODEL, triton_inputs(httpclient, x, ids, w))
                           .as_numpy("output").copy()), x, ids, w)


def test_a_grpc_zip_bomb_is_refused_by_grpc_within_the_limit(server):
    """gRPC decompresses a gzip message itself and refuses one past --grpc-max-message-bytes
    (RESOURCE_EXHAUSTED) without holding its decompressed size: 256 MiB of zeros (256 KiB on the
    wire) grow the front end's peak memory by far less than that."""
    head = pb.ModelInferRequest(model_name=MODEL)
    head.inputs.add(name="hidden_states", datatype="FP32", shape=[1, CFG.H])
    n = 256 << 20
    message = head.SerializeToString() + grpc_codec.key_and_length(7, n) + bytes(n)  # raw_input_contents
    peak = rss_bytes(server.pid, "VmHWM")
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as info:
            call(message, compression=grpc.Compression.Gzip, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert rss_bytes(server.pid, "VmHWM") - peak < 16 * BODY_LIMIT


# ---- the metrics port -------------------------------------------------------------------------


def test_the_metrics_port_serves_only_metrics(server):
    """--metrics-port answers /metrics (the Prometheus text, or OpenMetrics on Accept) and a 404 on
    every other path (before: the metrics on any path, /v2/health/ready included). The start-up
    log names its address as it names HTTP's and gRPC's (it said "metrics on :PORT", no host)."""
    base = f"http://127.0.0.1:{server.metrics_port}"
    assert f"metrics on 127.0.0.1:{server.metrics_port} " in server.log(), server.log()[-3000:]
    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200 and "moe_requests_total" in r.text, r.text[:200]
    assert r.headers["content-type"].startswith("text/plain")
    om = httpx.get(f"{base}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}, timeout=10)
    assert om.status_code == 200 and om.text.rstrip().endswith("# EOF")
    head = httpx.head(f"{base}/metrics", timeout=10)
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"].startswith("text/plain")
    assert httpx.post(f"{base}/metrics", timeout=10).status_code == 405
    for path in ("/v2/health/ready", "/", "/metrics/", "/metricsx", "/v2/models/moe/stats"):
        r = httpx.get(base + path, timeout=10)
        assert r.status_code == 404 and "moe_" not in r.text, (path, r.status_code, r.text[:200])


# ---- messages ---------------------------------------------------------------------------------


def test_timeout_parameter_errors_speak_microseconds(server):
    """A negative v2 `timeout` parameter (microseconds) is refused in its own unit, over HTTP and
    gRPC (before: "a positive, finite number of seconds, got -5e-06")."""
    x, ids, w = inputs(2, seed=25)
    doc = {"inputs": [{"name": n, "datatype": dt, "shape": list(t.shape), "data": t.reshape(-1).tolist()}
                      for n, dt, t in (("hidden_states", "FP32", x), ("topk_ids", "INT32", ids),
                                       ("topk_weights", "FP32", w))],
           "parameters": {"timeout": -5}}
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=doc, timeout=30)
    assert r.status_code == 400 and "microseconds" in r.json()["error"] and "-5" in r.json()["error"], r.text
    assert "seconds, got -5e-06" not in r.json()["error"]
    status, text = error_of(lambda: grpc_client(server).infer(MODEL, triton_inputs(grpcclient, x, ids, w),
                                                              timeout=-5))
    assert status == "StatusCode.INVALID_ARGUMENT" and "microseconds" in text and "-5" in text, text


def test_a_small_body_may_grow_at_most_32_times_and_to_1_mib():
    """Many bombs just under --max-request-bytes (a few KiB each) would each hold megabytes no
    client sent: a body's decompressed size is also bounded by 32 times its compressed size, or
    1 MiB whatever its size. Legitimate bodies (random values) come nowhere near."""
    limit = 64 << 20
    bomb = gzip.compress(bytes(limit - 1))  # ~64 KB for 64 MiB: under the byte limit, far past the ratio
    chunks = [bomb[:1000], bomb[1000:]]
    with pytest.raises(PayloadTooLarge, match=r"decompresses to over \d+ bytes \(32 times its size\)"):
        http.inflate(chunks, "gzip", limit)
    small = bytes(INFLATE_FLOOR)  # 1 MiB of zeros from ~1 KB: the floor lets it through
    assert b"".join(http.inflate([gzip.compress(small)], "gzip", limit)) == small
    noise = np.random.default_rng(5).standard_normal(1 << 18).astype(np.float32).tobytes()
    body = zlib.compress(noise)
    assert b"".join(http.inflate([body[:7], body[7:]], "deflate", limit)) == noise
