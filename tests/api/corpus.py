"""An adversarial corpus: bad inputs over every protocol (/moe/forward JSON and safetensors, v2 JSON
and binary, gRPC), each with the answer it must get. Used by tests/api/test_hardening.py and by
bench/hardening.py (which records the figures).

A case is (name, protocol, send) where send(server) -> (status, message): an HTTP status, or for
gRPC the StatusCode's name; `message` is what names the problem.
"""

from __future__ import annotations

import json
import socket
import struct

import grpc
import httpx
import numpy as np
import torch

from service.api.proto import grpc_predict_v2_pb2 as pb
from tests.api.common import CFG

H, K, E = CFG.H, CFG.K, CFG.E
T = 3
INFER = "/inference.GRPCInferenceService/ModelInfer"
HTTP_OK_4XX = range(400, 500)
GRPC_NAMED = {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def good_arrays(seed: int = 0, n: int = T):
    g = _rng(seed)
    x = g.standard_normal((n, H), dtype=np.float32)
    ids = np.stack([g.permutation(E)[:K] for _ in range(n)]).astype(np.int32)
    w = g.random((n, K), dtype=np.float32)
    return x, ids, w


# ---- /moe/forward --------------------------------------------------------------------------


def _fwd_json(**over) -> bytes:
    x, ids, w = good_arrays()
    doc = {"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}
    doc.update(over)
    return json.dumps(doc).encode()


def _safetensors(tensors: dict[str, np.ndarray | torch.Tensor]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save({k: torch.as_tensor(v).clone() for k, v in tensors.items()})


def _st_header(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def forward_json_bodies() -> dict[str, bytes]:
    x, ids, w = good_arrays()
    huge = np.full((T, H), 3e38, dtype=np.float32) * np.sign(_rng(1).standard_normal((T, H))).astype(np.float32)
    return {
        "empty": b"", "brace": b"{", "array": b"[]", "null": b"null", "number": b"1e999",
        "bad-utf8": b"\xff\xfe{}", "nan-literal": _fwd_json().replace(b"0.", b"NaN", 1),
        "x-scalar": _fwd_json(hidden_states=1.0), "x-string": _fwd_json(hidden_states="x"),
        "x-dict": _fwd_json(hidden_states={"a": 1}), "x-3d": _fwd_json(hidden_states=[x.tolist()]),
        "x-ragged": _fwd_json(hidden_states=[[1.0] * H, [1.0]]),
        "x-null-leaf": _fwd_json(hidden_states=[[None] * H] * T),
        "x-huge-int": _fwd_json(hidden_states=[[10**400] * H] * T), "x-inf": _fwd_json().replace(b"0.", b"1e999", 1),
        "ids-2**63": _fwd_json(topk_ids=[[2**63] * K] * T), "ids-float": _fwd_json(topk_ids=(ids + 0.5).tolist()),
        "ids-E": _fwd_json(topk_ids=np.full((T, K), E).tolist()),
        "ids--1": _fwd_json(topk_ids=np.full((T, K), -1).tolist()),
        "w-nan": _fwd_json().replace(b'"topk_weights": [[', b'"topk_weights": [[NaN, ', 1),
        "w-short": _fwd_json(topk_weights=w[:1].tolist()),
        "T0": _fwd_json(hidden_states=[], topk_ids=[], topk_weights=[]),
        "extra-key": _fwd_json(other=1), "deep": b"[" * 200_000 + b"]" * 200_000,
        "answer-overflows": _fwd_json(hidden_states=huge.tolist()),  # finite input, inf/NaN answer
    }


def forward_safetensors_bodies() -> dict[str, bytes]:
    x, ids, w = good_arrays()
    good = {"hidden_states": x, "topk_ids": ids, "topk_weights": w}
    blob = _safetensors(good)
    return {
        "garbage": b"\x00" * 64, "truncated": blob[: len(blob) // 2],
        "header-len-huge": struct.pack("<Q", 2**63) + b"{}",
        "header-not-json": struct.pack("<Q", 4) + b"abcd", "offsets-past-end": _st_header(
            {"hidden_states": {"dtype": "F32", "shape": [T, H], "data_offsets": [0, 2**40]}}),
        "shape-2**63": _st_header({"hidden_states": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}),
        "x-int8": _safetensors({**good, "hidden_states": x.astype(np.int8)}),
        "ids-float": _safetensors({**good, "topk_ids": ids.astype(np.float32)}),
        "missing": _safetensors({"hidden_states": x, "topk_ids": ids}),
        "extra": _safetensors({**good, "other": w.copy()}),
        "x-nan": _safetensors({**good, "hidden_states": np.full((T, H), np.nan, dtype=np.float32)}),
        "ids-E": _safetensors({**good, "topk_ids": np.full((T, K), E, dtype=np.int32)}),
        "x-1d": _safetensors({**good, "hidden_states": x[0]}),
        "T0": _safetensors({"hidden_states": x[:0], "topk_ids": ids[:0], "topk_weights": w[:0]}),
    }


# ---- v2 over HTTP --------------------------------------------------------------------------


def _v2_inputs(shape_x=(T, H), data=True):
    x, ids, w = good_arrays()
    items = []
    for name, arr, dt, shape in (("hidden_states", x, "FP32", list(shape_x)), ("topk_ids", ids, "INT32", [T, K]),
                                 ("topk_weights", w, "FP32", [T, K])):
        item = {"name": name, "datatype": dt, "shape": shape}
        if data:
            item["data"] = arr.reshape(-1).tolist()
        items.append(item)
    return items


def v2_json_bodies() -> dict[str, bytes]:
    def body(inputs=None, **top):
        return json.dumps({"inputs": _v2_inputs() if inputs is None else inputs, **top}).encode()

    def with_x(**item):
        inputs = _v2_inputs()
        inputs[0].update(item)
        return body(inputs)

    huge = (np.full((T, H), 3e38, dtype=np.float32) * np.where(_rng(2).random((T, H)) < 0.5, -1, 1)).astype(np.float32)
    return {
        "empty": b"", "not-object": b"[]", "no-inputs": b"{}", "inputs-dict": body(inputs={}),
        "input-string": body(inputs=["x"]), "shape-0x2**63": with_x(shape=[0, 2**63], data=[]),
        "shape-2**63x2**63": with_x(shape=[2**63, 2**63]), "shape-2**31": with_x(shape=[1, 2**31], data=[]),
        "shape-negative": with_x(shape=[-1, H]), "shape-3d": with_x(shape=[1, T, H]),
        "shape-float": with_x(shape=[3.0, H]), "shape-string": with_x(shape="3,256"),
        "shape-bool": with_x(shape=[True, H]), "datatype-bad": with_x(datatype="FP64"),
        "datatype-bytes": with_x(datatype="BYTES"), "data-short": with_x(data=[1.0]),
        "data-strings": with_x(data=["1"] * (T * H)), "data-nested-bad": with_x(data=[[1.0], 2.0]),
        "name-unknown": with_x(name="nope"), "duplicate": body(_v2_inputs() + _v2_inputs()[:1]),
        "missing": body(_v2_inputs()[:2]), "no-data": body(_v2_inputs(data=False)),
        "parameters-list": with_x(parameters=[1]), "binary-size-negative": with_x(parameters={"binary_data_size": -1}),
        "timeout-string": body(parameters={"timeout": "soon"}), "timeout-huge": body(parameters={"timeout": 10**400}),
        "timeout-negative": body(parameters={"timeout": -5}),
        "binary-output-string": body(parameters={"binary_data_output": "yes"}),
        "outputs-unknown": body(outputs=[{"name": "nope"}]), "outputs-dict": body(outputs={}),
        "id-number": body(id=5), "deep": b'{"inputs": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
        "answer-overflows": with_x(data=huge.reshape(-1).tolist()),
    }


def v2_binary_bodies() -> list[tuple[str, bytes, str]]:
    """(name, body, Inference-Header-Content-Length)."""
    x, ids, w = good_arrays()
    blobs = [x.tobytes(), ids.tobytes(), w.tobytes()]
    inputs = _v2_inputs(data=False)
    for item, blob in zip(inputs, blobs, strict=True):
        item["parameters"] = {"binary_data_size": len(blob)}
    header = json.dumps({"inputs": inputs}).encode()
    good = header + b"".join(blobs)
    n = str(len(header))

    def variant(mutate):
        items = json.loads(header)["inputs"]
        mutate(items)
        h = json.dumps({"inputs": items}).encode()
        return h + b"".join(blobs), str(len(h))

    cases = [("header-length-text", good, "abc"), ("header-length-0", good, "0"),
             ("header-length-negative", good, "-5"), ("header-length-past-end", good, str(len(good) + 1)),
             ("header-length-2**64", good, str(2**64)), ("truncated", good[:-7], n), ("trailing", good + b"\0" * 9, n),
             ("header-garbage", b"\xff" * len(header) + good[len(header):], n)]
    for name, mutate in (
        ("size-past-end", lambda it: it[0]["parameters"].update(binary_data_size=2**62)),
        ("size-string", lambda it: it[0]["parameters"].update(binary_data_size="12")),
        ("shape-0x2**63", lambda it: it[0].update(shape=[0, 2**63])),
        ("shape-lies", lambda it: it[0].update(shape=[1, H])),
        ("dtype-lies", lambda it: it[1].update(datatype="INT64")),
    ):
        body, length = variant(mutate)
        cases.append((name, body, length))
    return cases


# ---- gRPC ----------------------------------------------------------------------------------


def _grpc_request(x=None, ids=None, w=None, raw=True, model="moe") -> pb.ModelInferRequest:
    gx, gids, gw = good_arrays()
    arrays = (gx if x is None else x, gids if ids is None else ids, gw if w is None else w)
    req = pb.ModelInferRequest(model_name=model)
    for name, arr, dt in zip(("hidden_states", "topk_ids", "topk_weights"), arrays, ("FP32", "INT32", "FP32"),
                             strict=True):
        req.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
        if raw:
            req.raw_input_contents.append(arr.tobytes())
        elif dt == "FP32":
            req.inputs[-1].contents.fp32_contents.extend(arr.reshape(-1).tolist())
        else:
            req.inputs[-1].contents.int_contents.extend(arr.reshape(-1).tolist())
    return req


def grpc_messages() -> dict[str, bytes]:
    x, ids, w = good_arrays()
    good = _grpc_request().SerializeToString()
    cases: dict[str, pb.ModelInferRequest | bytes] = {
        "garbage": b"\xff\xff\xff\xff\x0f", "truncated": good[:-5], "wrong-wire-type": b"\x0a\x05\x08\x01",
        "model-unknown": _grpc_request(model="nope"),
        "version": pb.ModelInferRequest(model_name="moe", model_version="3"),
        "empty": pb.ModelInferRequest(model_name="moe"), "ids-E": _grpc_request(ids=np.full((T, K), E, dtype=np.int32)),
        "x-nan": _grpc_request(x=np.full((T, H), np.nan, dtype=np.float32)), "typed-x-nan": _grpc_request(
            x=np.full((T, H), np.nan, dtype=np.float32), raw=False),
    }
    req = _grpc_request()
    req.inputs[0].shape[:] = [0, 2**63 - 1]
    cases["shape-0x2**63"] = req
    req = _grpc_request()
    req.inputs[0].shape[:] = [-1, H]
    cases["shape-negative"] = req
    req = _grpc_request()
    req.raw_input_contents[0] = x.tobytes() * 40  # declares [3, H], carries 40x the bytes
    cases["raw-longer-than-declared"] = req
    req = _grpc_request()
    del req.raw_input_contents[2]
    cases["raw-count"] = req
    req = _grpc_request(raw=False)
    req.inputs[0].contents.fp32_contents.extend(np.zeros(40 * T * H, dtype=np.float32).tolist())
    cases["typed-longer-than-declared"] = req
    req = _grpc_request(raw=False)
    req.inputs[0].contents.int64_contents.extend([1] * 8)
    cases["typed-wrong-field"] = req
    req = _grpc_request()
    req.inputs[0].datatype = "BF16"
    req.raw_input_contents[0] = b""
    req.inputs[0].contents.fp32_contents.extend([1.0])
    cases["bf16-typed"] = req
    req = _grpc_request()
    req.outputs.add(name="nope")
    cases["output-unknown"] = req
    req = _grpc_request()
    req.parameters["timeout"].string_param = "soon"
    cases["timeout-string"] = req
    return {k: v if isinstance(v, bytes) else v.SerializeToString() for k, v in cases.items()}


# ---- the whole corpus ----------------------------------------------------------------------


def cases() -> list[tuple[str, str, object]]:
    """(name, protocol, send) for every bad input."""
    out = []
    for name, body in forward_json_bodies().items():
        out.append((name, "http_json", lambda s, b=body: _post(
            s, "/moe/forward", b, {"Content-Type": "application/json"})))
    for name, body in forward_safetensors_bodies().items():
        out.append((name, "http_safetensors", lambda s, b=body: _post(
            s, "/moe/forward", b, {"Content-Type": "application/x-safetensors"})))
    for name, headers in (("no-content-type", {}), ("text-plain", {"Content-Type": "text/plain"}),
                          ("gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"})):
        out.append((name, "http_json", lambda s, h=headers: _post(s, "/moe/forward", _fwd_json(), h)))
    out.append(("length-lies-huge", "http_json", lambda s: _raw_post(s, "/moe/forward", 2**62, _fwd_json())))
    for name, body in v2_json_bodies().items():
        out.append((name, "v2_json", lambda s, b=body: _post(
            s, "/v2/models/moe/infer", b, {"Content-Type": "application/json"})))
    out.append(("model-unknown", "v2_json", lambda s: _post(s, "/v2/models/nope/infer", b"{}", {})))
    out.append(("version-unknown", "v2_json", lambda s: _post(s, "/v2/models/moe/versions/7/infer", b"{}", {})))
    for name, body, length in v2_binary_bodies():
        out.append((name, "v2_binary", lambda s, b=body, n=length: _post(
            s, "/v2/models/moe/infer", b,
            {"Inference-Header-Content-Length": n, "Content-Type": "application/octet-stream"})))
    for name, data in grpc_messages().items():
        out.append((name, "grpc", lambda s, d=data: grpc_send(s.grpc_url, d)))
    return out


def _raw_post(server, path: str, declared: int, body: bytes) -> tuple[int, str]:
    """A POST whose Content-Length lies (no client library sends one); the status line and body."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest.decode(errors="replace")


def _post(server, path: str, body: bytes, headers: dict) -> tuple[int, str]:
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=30)
    try:
        text = r.json().get("error", "")
    except ValueError:
        text = r.text
    return r.status_code, text


def grpc_send(target: str, data: bytes, timeout: float = 30) -> tuple[str, str]:
    """Send raw bytes as a ModelInfer request; (code name, details)."""
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        try:
            call(data, timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
    return "OK", ""


def acceptable(protocol: str, status, text: str) -> bool:
    """A named 4xx (gRPC: a named client-side code) with a message."""
    if protocol == "grpc":
        return status in GRPC_NAMED and bool(text)
    return status in HTTP_OK_4XX and bool(text)
