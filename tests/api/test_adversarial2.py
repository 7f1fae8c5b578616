"""A second adversarial pass over the served path, as a user hits it: deadlines, and what the first
pass (test_hardening.py) left out. Each test failed on the code before its fix."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.api.common import check, http_answers, inputs
from tests.serverproc import ServerProcess

BODY_DELAY_S = 1.5  # how long a test's client holds back the rest of its body


def _serving(tmp_path_factory, http_impl: str):
    with ServerProcess.serving(tmp_path_factory.mktemp(f"adversarial2-{http_impl}") / "server.log",
                               "--http-impl", http_impl) as proc:
        yield proc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _serving(tmp_path_factory, "httptools")


@pytest.fixture(scope="module")
def h11_server(tmp_path_factory):
    """A second server on h11, started only for the tests that run on both HTTP parsers (their first
    byte is stamped differently: service.api.connections.ConnectionBounds)."""
    yield from _serving(tmp_path_factory, "h11")


@pytest.fixture(params=["httptools", "h11"])
def http_server(request):
    return request.getfixturevalue("server" if request.param == "httptools" else "h11_server")


def v2_json_body(T: int, seed: int, **doc) -> tuple[bytes, tuple]:
    x, ids, w = inputs(T, seed=seed)
    tensors = (("hidden_states", x, "FP32"), ("topk_ids", ids, "INT64"), ("topk_weights", w, "FP32"))
    body = {"inputs": [{"name": n, "datatype": dt, "shape": list(t.shape), "data": t.reshape(-1).tolist()}
                       for n, t, dt in tensors], **doc}
    return json.dumps(body).encode(), (x, ids, w)


def post_slowly(server, path: str, body: bytes, headers: dict[str, str], hold_s: float) -> tuple[int, bytes]:
    """POST `body` on a socket of its own: the headers and its first bytes at once, the rest after
    `hold_s` seconds; the answer (status, body)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.settimeout(60)
        sock.sendall(head.encode() + body[:100])
        time.sleep(hold_s)
        sock.sendall(body[100:])
        return http_answers(sock, 1)[0]


def test_a_deadline_counts_from_the_first_byte_not_from_the_body_s_end(http_server):
    """Before: a request's deadline started once its body was in and decoded, so a v2 request with
    `"timeout": 500000` (0.5 s) whose body took 1.5 s to arrive was computed and answered 200 a second
    past its deadline (and an X-Request-Timeout of 0.5 s, whose body gets 1 s to arrive, the same at
    0.8 s), although the body's own bound and the books count from the first byte. Now the body's time
    spends the deadline: 504 once the body is in. A deadline the body leaves room for still answers."""
    server = http_server
    body, _ = v2_json_body(3, seed=1, parameters={"timeout": 500_000})
    status, text = post_slowly(server, "/v2/models/moe/infer", body, {}, BODY_DELAY_S)
    assert status == 504, text
    assert "deadline of 0.5 s passed before it was queued" in json.loads(text)["error"], text
    body, tensors = v2_json_body(3, seed=2, parameters={"timeout": 60_000_000})
    status, text = post_slowly(server, "/v2/models/moe/infer", body, {}, BODY_DELAY_S)
    assert status == 200, text
    check([json.loads(text)["outputs"][0]["data"][i * 256:(i + 1) * 256] for i in range(3)], *tensors)


def test_grpc_model_metadata_is_http_s(server):
    """Before: gRPC ModelMetadata left `versions` out (HTTP's /v2/models/moe says ["1"]), so
    tritonclient.grpc's get_model_metadata("moe").versions was empty. Every field of the two answers
    now agrees."""
    import grpc
    import httpx

    from service.api.proto import grpc_predict_v2_pb2 as pb
    from service.api.proto import grpc_predict_v2_pb2_grpc as pb_grpc

    http = httpx.get(server.url + "/v2/models/moe", timeout=30).json()
    with grpc.insecure_channel(server.grpc_url) as channel:
        answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelMetadata(pb.ModelMetadataRequest(name="moe"),
                                                                         timeout=30)
    def tensors(ts) -> list:
        return [(t.name, t.datatype, list(t.shape)) for t in ts]

    assert (answer.name, list(answer.versions), answer.platform) == (http["name"], http["versions"], http["platform"])
    assert tensors(answer.inputs) == [(t["name"], t["datatype"], t["shape"]) for t in http["inputs"]]
    assert tensors(answer.outputs) == [(t["name"], t["datatype"], t["shape"]) for t in http["outputs"]]
    assert set(http) == {"name", "versions", "platform", "inputs", "outputs"}, http
