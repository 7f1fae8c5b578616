"""Decoding, validation and encoding of every wire format, without a server."""

from __future__ import annotations

import json
import math

import grpc
import numpy as np
import pytest
import safetensors.torch
import torch

from service.api import codecs, grpc_codec, regions
from service.api.error_map import ModelNotFound, PayloadTooLarge, UnsupportedMediaType, classify
from service.api.proto import grpc_predict_v2_pb2 as pb
from service.errors import DeadlineExceeded, GroupUnavailable, InvalidInput, Overloaded, WorkerError

SPEC = codecs.ModelSpec(E=6, H=5, K=2, dtype=torch.float32, max_tokens=100)


def tensors(T=3, x_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, SPEC.H, generator=gen).to(x_dtype)
    ids = torch.randint(0, SPEC.E, (T, SPEC.K), generator=gen)
    w = torch.rand(T, SPEC.K, generator=gen)
    return x, ids, w


def test_validate_normalises_dtypes():
    x, ids, w = tensors(x_dtype=torch.bfloat16)
    xc, idc, wc = codecs.validate(x, ids, w.half(), SPEC)
    # x stays as sent (the batcher converts it as it copies it into the slot), no copy made
    assert xc.dtype == torch.bfloat16 and xc.data_ptr() == x.data_ptr()
    assert idc.dtype == torch.int32 and wc.dtype == torch.float32
    assert torch.equal(idc, ids.int()) and torch.equal(wc, w.half().float())


# NaN and infinity by their bits (quiet, signalling, negative, all ones), at every position of a
# tensor longer than any vector width: one of them anywhere is found.
NON_FINITE_BITS = {torch.bfloat16: (torch.int16, [0x7F80, -0x80, 0x7FC0, 0x7F81, -1]),
                   torch.float16: (torch.int16, [0x7C00, -0x400, 0x7E00, 0x7C01, -1]),
                   torch.float32: (torch.int32, [0x7F800000, -0x800000, 0x7FC00000, 0x7F800001, -1])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_finds_every_non_finite_pattern_anywhere(dtype):
    """all_finite and the slot's check (rows_error: its sum screen, then the exact pass naming the
    request's row) both find each pattern at each position."""
    x = torch.randn(3, 67, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert codecs.all_finite(x) and codecs.all_finite(x[:0])
    assert codecs.rows_error(x, x) is None
    int_dtype, patterns = NON_FINITE_BITS[dtype]
    for bits in patterns:
        for i in range(x.numel()):
            bad = x.clone()
            bad.view(int_dtype).view(-1)[i] = bits
            assert not codecs.all_finite(bad), (hex(bits), i)
            err = codecs.rows_error(bad, bad, first=10)
            assert err is not None and err[0] == 10 + i // 67, (hex(bits), i, err)
            assert f"NaN or infinity (row {10 + i // 67})" in str(err[1]), (hex(bits), i, err)
    big = torch.tensor([[torch.finfo(dtype).max, -torch.finfo(dtype).max]], dtype=dtype)
    assert codecs.all_finite(big)
    assert codecs.rows_error(big.repeat(1, 3)[:, :4].abs(), big) is None  # the sum overflows: decided exactly


def test_rows_error_names_a_narrowing_overflow():
    """Values that the slot's dtype cannot hold are infinities in the slot; the request's own rows
    decide that they were finite as sent, and the message says so (row of the request)."""
    sent = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    sent[2, 3] = -70000.0  # finite in fp32, beyond float16's 65504
    err = codecs.rows_error(sent.half(), sent, first=7)
    assert err is not None and err[0] == 9 and "outside the range of float16 (row 9)" in str(err[1])
    sent[3, 0] = float("nan")  # a later NaN: the first bad row is named, whatever its reason
    err = codecs.rows_error(sent.half(), sent, first=7)
    assert err is not None and err[0] == 9 and "outside the range of float16 (row 9)" in str(err[1])
    sent[1, 1] = float("inf")
    err = codecs.rows_error(sent.half(), sent, first=7)
    assert err is not None and err[0] == 8 and "NaN or infinity (row 8)" in str(err[1])
    sent[1, 1], sent[3, 0] = 0.0, 0.0
    sent[2, 3] = -65504.0
    assert codecs.rows_error(sent.half(), sent) is None and codecs.rows_error(sent.bfloat16(), sent) is None
    wide = torch.tensor([[3e38, -3e38]]).bfloat16()
    assert codecs.rows_error(wide.float(), wide) is None  # widening always fits


@pytest.mark.parametrize("change, needle", [
    (lambda x, i, w: (x[:, :4], i, w), "[T, 5]"),
    (lambda x, i, w: (x[:0], i[:0], w[:0]), "T = 0"),
    (lambda x, i, w: (x, i[:2], w), "2 rows but hidden_states has T = 3"),
    (lambda x, i, w: (x, i, w[:, :1]), "K = 2"),
    (lambda x, i, w: (x, i.float(), w), "topk_ids must be int32 or int64"),
    (lambda x, i, w: (x.double(), i, w), "hidden_states must be float32"),
    (lambda x, i, w: (x, i.clamp(max=0) - 1, w), "= -1 is not an expert id in [0, 6)"),
    (lambda x, i, w: (x, i.clamp(min=6), w), "is not an expert id"),
    (lambda x, i, w: (x, i, w.index_fill(0, torch.tensor([2]), float("-inf"))), "topk_weights contains NaN"),
])
def test_validate_names_the_problem(change, needle):
    with pytest.raises(InvalidInput) as err:
        codecs.validate(*change(*tensors()), SPEC)
    assert needle in str(err.value)


def test_validate_token_limit_and_leaves_the_values_to_the_slot():
    with pytest.raises(PayloadTooLarge, match="queue_tokens"):
        codecs.validate(*tensors(T=101), SPEC)
    x, ids, w = tensors()
    x[1, 2] = float("nan")  # checked where the rows land (Batcher: codecs.rows_error on the slot's rows)
    assert codecs.validate(x, ids, w, SPEC)[0].data_ptr() == x.data_ptr()


def test_forward_json_and_safetensors_round_trip():
    x, ids, w = tensors()
    body = json.dumps({"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}).encode()
    req = codecs.decode_forward_json(body, SPEC)
    assert torch.equal(req.x, x) and req.out_dtype == torch.float32
    assert json.loads(codecs.encode_forward_json(req.x))["output"] == x.tolist()

    blob = safetensors.torch.save({"hidden_states": x.bfloat16(), "topk_ids": ids.int(), "topk_weights": w})
    req = codecs.decode_safetensors(blob, SPEC)
    assert req.out_dtype == torch.bfloat16 and torch.equal(req.x, x.bfloat16())
    out = safetensors.torch.load(codecs.encode_safetensors(req.x.bfloat16()))["output"]
    assert out.dtype == torch.bfloat16


def test_v2_binary_round_trip():
    x, ids, w = tensors(T=4, x_dtype=torch.bfloat16)
    blobs = [codecs.to_bytes(x), codecs.to_bytes(ids.int()), codecs.to_bytes(w)]
    header = json.dumps({"id": "a", "parameters": {"timeout": 2_500_000, "binary_data_output": True}, "inputs": [
        {"name": n, "datatype": d, "shape": list(t.shape), "parameters": {"binary_data_size": len(b)}}
        for n, d, t, b in zip(codecs.INPUT_NAMES, ("BF16", "INT32", "FP32"), (x, ids, w), blobs, strict=True)
    ]}).encode()
    req = codecs.decode_v2_http(header + b"".join(blobs), str(len(header)), SPEC)
    assert torch.equal(req.x, x) and torch.equal(req.ids, ids.int()) and torch.equal(req.w, w)
    assert req.request_id == "a" and req.timeout_s == 2.5 and req.binary_output and req.out_dtype == torch.bfloat16

    parts, n = codecs.encode_v2_http(x, req, "moe")
    body = b"".join(parts)
    doc = json.loads(body[:n])
    assert doc["id"] == "a" and doc["outputs"][0]["datatype"] == "BF16"
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == len(body) - n
    back = torch.frombuffer(bytearray(body[n:]), dtype=torch.bfloat16).reshape(4, SPEC.H)
    assert torch.equal(back, x)


def test_v2_binary_body_in_chunks():
    """A body that arrived in chunks (cut inside the header and inside a tensor) decodes the same."""
    x, ids, w = tensors(T=4, x_dtype=torch.bfloat16)
    blobs = [codecs.to_bytes(x), codecs.to_bytes(ids.int()), codecs.to_bytes(w)]
    header = json.dumps({"inputs": [
        {"name": n, "datatype": d, "shape": list(t.shape), "parameters": {"binary_data_size": len(b)}}
        for n, d, t, b in zip(codecs.INPUT_NAMES, ("BF16", "INT32", "FP32"), (x, ids, w), blobs, strict=True)
    ]}).encode()
    body = header + b"".join(blobs)
    cuts = [0, 7, len(header) + 5, len(header) + 23, len(body)]
    chunks = [body[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert bytes(codecs.join_chunks(chunks)) == body and codecs.join_chunks([body]) is body
    req = codecs.decode_v2_http(chunks, str(len(header)), SPEC)
    assert torch.equal(req.x, x) and torch.equal(req.ids, ids.int()) and torch.equal(req.w, w)


def test_v2_json_output_choice():
    x, ids, w = tensors(T=2)
    doc = {"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [2, 5], "data": x.flatten().tolist()},
                      {"name": "topk_ids", "datatype": "INT64", "shape": [2, 2], "data": ids.tolist()},
                      {"name": "topk_weights", "datatype": "FP32", "shape": [2, 2], "data": w.tolist()}],
           "outputs": [{"name": "output", "parameters": {"binary_data": False}}],
           "parameters": {"binary_data_output": True}}
    req = codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    assert not req.binary_output  # the per-output flag wins
    parts, n = codecs.encode_v2_http(req.x, req, "moe")
    assert n is None and json.loads(b"".join(parts))["outputs"][0]["data"] == pytest.approx(x.flatten().tolist())
    doc["inputs"][1]["data"] = [0.5, 1, 2, 3]
    with pytest.raises(InvalidInput, match="topk_ids must hold integers"):
        codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_an_overflowed_json_answer_names_its_dtype(dtype):
    """An answer that overflowed cannot be strict JSON: the error names the answer's dtype and that
    the layer overflowed, in its compute dtype or the answer's (an fp16 layer's NaN in a float32
    answer was called float32's overflow)."""
    x, ids, w = tensors(T=2, x_dtype=dtype, seed=3)
    name = codecs.V2_NAMES[dtype]
    doc = {"inputs": [{"name": "hidden_states", "datatype": name, "shape": [2, 5],
                       "data": x.float().flatten().tolist()},
                      {"name": "topk_ids", "datatype": "INT64", "shape": [2, 2], "data": ids.tolist()},
                      {"name": "topk_weights", "datatype": "FP32", "shape": [2, 2], "data": w.tolist()}]}
    req = codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    for value in (float("inf"), float("nan")):  # a NaN too: orjson would write it as null
        out = x.clone()
        out[1, 3] = value  # what the layer's answer holds when it overflowed its dtype
        expected = f"the {codecs.DTYPE_NAMES[dtype]} answer holds NaN or infinity: the layer overflowed"
        with pytest.raises(InvalidInput, match=expected):
            codecs.encode_v2_http(out, req, "moe")
        with pytest.raises(InvalidInput, match=expected):
            codecs.encode_forward_json(out)


def test_the_timeout_parameter_is_checked_in_microseconds():
    """The v2 `timeout` parameter is microseconds; 0 is the server default; a bad one is refused
    in its own unit (before: "a positive, finite number of seconds, got -5e-06")."""
    base = {"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [1, 5], "data": [0.5] * 5},
                       {"name": "topk_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
                       {"name": "topk_weights", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 0.5]}]}
    for value, seconds in ((2_500_000, 2.5), (0, None), (1, 1e-6)):
        req = codecs.decode_v2_http(json.dumps({**base, "parameters": {"timeout": value}}).encode(), None, SPEC)
        assert req.timeout_s == seconds, value
    for value in (-5, -0.5, 1e400, "soon"):
        body = json.dumps({**base, "parameters": {"timeout": value}}).encode()
        with pytest.raises(InvalidInput, match="microseconds") as info:
            codecs.decode_v2_http(body, None, SPEC)
        assert "of seconds" not in str(info.value), info.value


def grpc_request(x, ids, w, raw=True):
    r = pb.ModelInferRequest(model_name="moe", id="g")
    for name, dt, t in zip(codecs.INPUT_NAMES, ("FP32", "INT64", "FP32"), (x, ids, w), strict=True):
        item = r.inputs.add(name=name, datatype=dt, shape=list(t.shape))
        if raw:
            r.raw_input_contents.append(codecs.to_bytes(t))
        elif dt == "FP32":
            item.contents.fp32_contents.extend(t.flatten().tolist())
        else:
            item.contents.int64_contents.extend(t.flatten().tolist())
    return r


@pytest.mark.parametrize("raw", [True, False])
def test_grpc_decode(raw):
    x, ids, w = tensors()
    r = grpc_request(x, ids, w, raw)
    r.parameters["timeout"].int64_param = 1000
    # as protobuf hands it over, and as the server's own deserializer does (views of the bytes)
    for received in (r, grpc_codec.parse_grpc_request(r.SerializeToString())):
        req = grpc_codec.decode_grpc(received, SPEC)
        assert torch.equal(req.x, x) and torch.equal(req.ids, ids.int()) and req.timeout_s == 1e-3
    answer = grpc_codec.grpc_response(req, "moe")
    answer.out.copy_(req.x)  # as the batcher's copy out of the slot does
    response = pb.ModelInferResponse.FromString(grpc_codec.serialize_grpc_response(answer))
    assert response.id == "g" and list(response.outputs[0].shape) == [3, 5]
    assert list(response.raw_output_contents) == [codecs.to_bytes(x)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T, request_id", [(1, ""), (7, "odd"), (200, "an id of 22 characters")])
def test_grpc_response_is_made_before_the_answer_and_filled_in_place(dtype, T, request_id):
    """The response's bytes exist before the step; the answer written into .out (at any byte offset
    the head leaves: ids of odd lengths) is what the client parses, bit for bit, in its dtype."""
    x, ids, w = tensors(T=T, x_dtype=dtype, seed=T)
    req = codecs.Decoded(x, ids.int(), w, out_dtype=dtype, request_id=request_id or None)
    answer = grpc_codec.grpc_response(req, "moe")
    assert answer.out.shape == (T, SPEC.H) and answer.out.dtype == dtype
    expected = torch.randn(T, SPEC.H, generator=torch.Generator().manual_seed(T + 1)).to(dtype)
    answer.out.copy_(expected)
    wire = grpc_codec.serialize_grpc_response(answer)
    assert type(wire) is bytes and wire is answer.data  # no copy, no join
    response = pb.ModelInferResponse.FromString(wire)
    assert response.model_name == "moe" and response.id == request_id
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("output", codecs.V2_NAMES[dtype], [T, SPEC.H])
    assert list(response.raw_output_contents) == [codecs.to_bytes(expected)]


def test_grpc_parser_views_raw_contents_and_keeps_the_rest():
    x, ids, w = tensors(T=200)  # blobs longer than 127 bytes: multi-byte lengths
    r = grpc_request(x, ids, w)
    r.parameters["timeout"].int64_param = 7
    r.outputs.add(name="output")
    parsed = grpc_codec.parse_grpc_request(r.SerializeToString())
    assert [bytes(b) for b in parsed.raw] == list(r.raw_input_contents)
    assert all(isinstance(b, memoryview) for b in parsed.raw) and not parsed.message.raw_input_contents
    expect = pb.ModelInferRequest()
    expect.CopyFrom(r)
    del expect.raw_input_contents[:]
    assert pb.ModelInferRequest.FromString(parsed.message.SerializeToString()) == expect  # (its own class)
    # what the walk cannot read goes to protobuf whole, which raises its own error
    with pytest.raises(Exception, match="(?i)pars|decod|truncat"):
        grpc_codec.parse_grpc_request(r.SerializeToString()[:-5])


def test_grpc_decode_errors():
    x, ids, w = tensors()
    r = grpc_request(x, ids, w)
    del r.raw_input_contents[2]
    with pytest.raises(InvalidInput, match="2 entries for 3 inputs"):
        grpc_codec.decode_grpc(r, SPEC)
    r = grpc_request(x, ids, w)
    r.raw_input_contents[0] = r.raw_input_contents[0][:-4]
    with pytest.raises(InvalidInput, match="needs 60"):
        grpc_codec.decode_grpc(r, SPEC)
    r = grpc_request(x, ids, w, raw=False)
    r.inputs[0].datatype = "FP16"
    with pytest.raises(InvalidInput, match="raw_input_contents"):
        grpc_codec.decode_grpc(r, SPEC)
    with pytest.raises(ModelNotFound):
        codecs.check_model("other", "", "moe")
    with pytest.raises(ModelNotFound, match="version"):
        codecs.check_model("moe", "3", "moe")


def test_json_bf16_values_are_rounded_once():
    """v2 JSON BF16 data is parsed as float64 and rounded once to the nearest bfloat16 (ties to even),
    as FP16's is: through float32's nearest first, values just past a halfway point rounded twice and
    down (1 + 2**-8 + 2**-30 became 1.0)."""
    gen = torch.Generator().manual_seed(7)
    base = (torch.randn(2, 5, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-20, 20, (2, 5),
                                                                                         generator=gen)).bfloat16()
    bits = base.view(torch.int16)
    nxt = (bits + 1).view(torch.bfloat16)
    ulp = nxt.double() - base.double()
    cases = [(base.double() + (0.5 + 2**-30) * ulp, nxt),  # just past halfway: up
             (base.double() + (0.5 - 2**-30) * ulp, base),  # just short of it: down
             (base.double() + 0.5 * ulp, torch.where(bits % 2 == 0, base, nxt))]  # halfway: to even
    _, ids, w = tensors(T=2)
    for values, expected in cases:
        doc = {"inputs": [{"name": "hidden_states", "datatype": "BF16", "shape": [2, 5],
                           "data": values.flatten().tolist()},
                          {"name": "topk_ids", "datatype": "INT64", "shape": [2, 2], "data": ids.tolist()},
                          {"name": "topk_weights", "datatype": "FP32", "shape": [2, 2], "data": w.tolist()}]}
        x = codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC).x
        assert x.dtype == torch.bfloat16 and torch.equal(x.view(torch.int16), expected.view(torch.int16)), \
            (values, x, expected)
    t = torch.from_numpy(codecs.round_to_odd_float32(np.array([1 + 2**-8 + 2**-30, -1e-45, 1e300])))
    assert t.bfloat16().tolist() == [1.0078125, -0.0, math.inf]


def test_timeouts():
    assert codecs.parse_timeout_s(None, "t") is None and codecs.parse_timeout_s("0.5", "t") == 0.5
    assert [codecs.parse_timeout_s(v, "t") for v in (" 2 ", "1.", ".5", "1e1", "3", 2)] == [2, 1, 0.5, 10, 3, 2]
    for bad in ("abc", "0", "-1", "inf", "nan", "1_0", "0x10", "1e", ""):  # ("1_0" was 10 s)
        with pytest.raises(InvalidInput):
            codecs.parse_timeout_s(bad, "t")


def test_one_table_of_codes():
    cases = {UnsupportedMediaType("x"): (415, grpc.StatusCode.INVALID_ARGUMENT),
             PayloadTooLarge("x"): (413, grpc.StatusCode.INVALID_ARGUMENT),
             ModelNotFound("x"): (404, grpc.StatusCode.NOT_FOUND),
             InvalidInput("x"): (400, grpc.StatusCode.INVALID_ARGUMENT),
             Overloaded("x"): (503, grpc.StatusCode.UNAVAILABLE),
             GroupUnavailable("x"): (503, grpc.StatusCode.UNAVAILABLE),
             WorkerError("x"): (503, grpc.StatusCode.UNAVAILABLE),
             DeadlineExceeded("x"): (504, grpc.StatusCode.DEADLINE_EXCEEDED),
             RuntimeError("x"): (500, grpc.StatusCode.INTERNAL)}
    for exc, expected in cases.items():
        assert classify(exc) == expected, exc


# ---- bad input is a named InvalidInput (400), never another exception (500) --------------------


def v2_doc(**extra):
    x, ids, w = tensors(T=1)
    return {"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [1, 5], "data": x.flatten().tolist()},
                       {"name": "topk_ids", "datatype": "INT64", "shape": [1, 2], "data": ids.flatten().tolist()},
                       {"name": "topk_weights", "datatype": "FP32", "shape": [1, 2], "data": w.flatten().tolist()}],
            **extra}


@pytest.mark.parametrize("params", [["binary_data"], "binary_data", 1])
def test_v2_output_parameters_must_be_an_object(params):
    body = json.dumps(v2_doc(outputs=[{"name": "output", "parameters": params}])).encode()
    with pytest.raises(InvalidInput, match="output 'output': 'parameters' must be an object"):
        codecs.decode_v2_http(body, None, SPEC)


def test_v2_timeout_past_the_float_range():
    body = json.dumps(v2_doc(parameters={"timeout": 10 ** 400})).encode()
    with pytest.raises(InvalidInput, match="parameter 'timeout' is out of range"):
        codecs.decode_v2_http(body, None, SPEC)


DEEP = 100_000  # far past the interpreter's recursion limit
NESTED = "[" * DEEP + "]" * DEEP


@pytest.mark.parametrize("body, decode", [
    (NESTED, codecs.decode_forward_json),
    ('{"hidden_states": ' + NESTED + ', "topk_ids": [[0, 1]], "topk_weights": [[0.5, 0.5]]}',
     codecs.decode_forward_json),
    (NESTED, lambda b, spec: codecs.decode_v2_http(b, None, spec)),
    ('{"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [1, 5], "data": ' + NESTED + '}]}',
     lambda b, spec: codecs.decode_v2_http(b, None, spec)),
], ids=["forward", "forward-hidden_states", "v2", "v2-data"])
def test_deeply_nested_json_is_a_named_400(body, decode):
    with pytest.raises(InvalidInput, match="nested too deeply"):
        decode(body.encode(), SPEC)


def forward_body(**change):
    x, ids, w = tensors()
    doc = {"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist(), **change}
    return json.dumps(doc).encode()


@pytest.mark.parametrize("name, value, holds", [
    ("hidden_states", [["1.5"] * 5] * 3, "strings"),
    ("hidden_states", [[True] * 5] * 3, "true/false"),
    ("hidden_states", [[0.5, True, 0.5, 0.5, 0.5]] + [[0.5] * 5] * 2, "true/false"),  # numpy would make 1.0
    ("hidden_states", [[0.5, None, 0.5, 0.5, 0.5]] + [[0.5] * 5] * 2, "null"),
    ("topk_weights", [["0.5", "0.5"]] * 3, "strings"),
    ("topk_weights", [[1, False]] * 3, "true/false"),
    ("topk_ids", [[0, True]] * 3, "true/false"),  # numpy would make 1
    ("topk_ids", [["0", "1"]] * 3, "strings"),
])
def test_json_numbers_must_be_numbers(name, value, holds):
    with pytest.raises(InvalidInput, match=f"{name} must be a rectangular array of numbers; it holds {holds}"):
        codecs.decode_forward_json(forward_body(**{name: value}), SPEC)
    doc = v2_doc()
    item = next(i for i in doc["inputs"] if i["name"] == name)
    item["shape"] = [3, len(value[0])]
    item["data"] = value
    with pytest.raises(InvalidInput, match=f"{name} must be a rectangular array of numbers; it holds {holds}"):
        codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)


def test_json_integers_are_numbers():
    """Integer literals are numbers, in float tensors too; integers past 64 bits are named."""
    req = codecs.decode_forward_json(forward_body(hidden_states=[[1, 2, 3, 4, 5]] * 3), SPEC)
    assert req.x.dtype == torch.float32 and req.x[0].tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(InvalidInput, match="topk_ids has values outside the int64 range"):
        codecs.decode_forward_json(forward_body(topk_ids=[[0, 2 ** 70]] * 3), SPEC)
    with pytest.raises(InvalidInput, match="hidden_states has values outside the range of float32"):
        codecs.decode_forward_json(forward_body(hidden_states=[[2 ** 200, 0, 0, 0, 0]] * 3), SPEC)


# ---- orjson parses and writes the JSON routes; what it refuses but json reads is answered as before ----


def _no_stdlib_json(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the stdlib's json was called on a valid body")
    monkeypatch.setattr(json, "loads", refuse)
    monkeypatch.setattr(json, "dumps", refuse)


def test_valid_json_bodies_and_answers_never_use_the_stdlib_json(monkeypatch):
    """The stdlib's json took 35-90 ms to parse a T=512 body and 70 ms to write its answer holding
    the GIL, stalling every other client of the front end (user's trial 3): a valid request, in
    every JSON format, and its answer go through orjson alone."""
    x, ids, w = tensors(T=7, seed=11)
    fwd = json.dumps({"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}).encode()
    v2 = json.dumps(v2_doc(id="r1")).encode()
    blobs = [codecs.to_bytes(x), codecs.to_bytes(ids.int()), codecs.to_bytes(w)]
    header = json.dumps({"inputs": [
        {"name": n, "datatype": d, "shape": list(t.shape), "parameters": {"binary_data_size": len(b)}}
        for n, d, t, b in zip(codecs.INPUT_NAMES, ("FP32", "INT32", "FP32"), (x, ids, w), blobs, strict=True)
    ]}).encode()
    _no_stdlib_json(monkeypatch)
    req = codecs.decode_forward_json(fwd, SPEC)
    assert torch.equal(req.x, x) and torch.equal(req.ids, ids.int()) and torch.equal(req.w, w)
    assert codecs.encode_forward_json(req.x).startswith(b'{"output":[[')
    req = codecs.decode_v2_http(v2, None, SPEC)
    assert req.request_id == "r1" and req.x.shape == (1, SPEC.H)
    assert b'"model_name":"moe"' in b"".join(codecs.encode_v2_http(req.x, req, "moe")[0])
    req = codecs.decode_v2_http(header + b"".join(blobs), str(len(header)), SPEC)
    assert torch.equal(req.x, x) and torch.equal(req.ids, ids.int())
    req.binary_output = True
    parts, n = codecs.encode_v2_http(req.x, req, "moe")
    assert n == len(parts[0]) and bytes(parts[1]) == codecs.to_bytes(x)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_literals_are_named_as_values(literal):
    """orjson refuses these literals with its own parse error ("unexpected character ... char 5");
    a request holding one is refused as before: the input that holds it, and for hidden_states
    the row (found where the rows land in the step's slot)."""
    sentinel = 12345.5  # a number json writes as b"12345.5", replaced by the literal
    x, ids, w = tensors(seed=12)  # T=3, as forward_body
    x[2, 3] = sentinel
    req = codecs.decode_forward_json(forward_body(hidden_states=x.tolist()).replace(b"12345.5", literal), SPEC)
    bad = codecs.rows_error(req.x, req.x)
    assert bad is not None and bad[0] == 2 and "hidden_states contains NaN or infinity (row 2)" in str(bad[1])
    w[0, 1] = sentinel
    with pytest.raises(InvalidInput, match="topk_weights contains NaN"):
        codecs.decode_forward_json(forward_body(topk_weights=w.tolist()).replace(b"12345.5", literal), SPEC)
    doc = v2_doc()
    doc["inputs"][2]["data"][1] = sentinel
    with pytest.raises(InvalidInput, match="topk_weights contains NaN"):
        codecs.decode_v2_http(json.dumps(doc).encode().replace(b"12345.5", literal), None, SPEC)


def test_integers_past_64_bits_are_named_as_before():
    """orjson reads an integer literal past 64 bits as a float (topk_ids would then "must hold
    integers") or refuses it past a double ("number is infinity"): both are named as before."""
    for big in (2 ** 64, -(2 ** 63) - 1, 10 ** 30):
        with pytest.raises(InvalidInput, match="topk_ids has values outside the int64 range"):
            codecs.decode_forward_json(forward_body(topk_ids=[[0, big]] * 3), SPEC)
        doc = v2_doc()
        doc["inputs"][1].update(datatype="INT32", data=[1, big])
        with pytest.raises(InvalidInput, match="topk_ids has values outside the int64 range"):
            codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    with pytest.raises(InvalidInput, match="hidden_states has integers too large for a float"):
        codecs.decode_forward_json(forward_body(hidden_states=[[10 ** 400, 0, 0, 0, 0]] * 3), SPEC)
    req = codecs.decode_forward_json(forward_body(hidden_states=[[2 ** 64, 0, 0, 0, 1]] * 3), SPEC)
    assert req.x[0].tolist() == [2.0 ** 64, 0, 0, 0, 1]  # a float input takes it, rounded once
    with pytest.raises(InvalidInput, match="topk_ids must hold integers"):  # a fraction stays that
        codecs.decode_forward_json(forward_body(topk_ids=[[0, 1.5]] * 3), SPEC)


def test_header_integers_past_64_bits_are_not_echoed_as_floats():
    """A v2 header's shape or shared-memory integer of 2^64 or more (a float to orjson) is refused as
    too large, named by its size; before, "must be integers, got [1.8446744073709552e+19, 5]" answered a
    client that had sent integers."""
    for big, needle in ((2 ** 64, r"has shape \[a number of 2\^64 or more, 5\]: a dimension over"),
                        (10 ** 30, r"has shape \[a number of 2\^64 or more, 5\]: a dimension over"),
                        (-(2 ** 63) - 1, r"non-negative integers, got \[a number of -2\^63 or less, 5\]")):
        doc = v2_doc()
        doc["inputs"][0]["shape"] = [big, 5]
        with pytest.raises(InvalidInput, match=needle) as e:
            codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
        assert "e+" not in str(e.value)
    doc = v2_doc()
    doc["inputs"][0]["shape"] = [3.0, 5]  # a float the client wrote is still named as it was
    with pytest.raises(InvalidInput, match=r"non-negative integers, got \[3\.0, 5\]"):
        codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    params = codecs.json_object(json.dumps({"shared_memory_region": "r", "shared_memory_byte_size": 2 ** 64}).encode())
    with pytest.raises(InvalidInput, match=r"shared_memory_byte_size must be a non-negative integer below 2\^64, "
                                           r"got a number of 2\^64 or more"):
        codecs.shm_params(params, "input 'hidden_states'")
    doc = v2_doc()
    doc["inputs"][0]["parameters"] = {"binary_data_size": 2 ** 64}
    del doc["inputs"][0]["data"]
    with pytest.raises(InvalidInput, match=r"binary_data_size must be a non-negative integer below 2\^64$"):
        codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    byte_size = codecs.json_object(json.dumps({"byte_size": 2 ** 64}).encode())["byte_size"]
    with pytest.raises(InvalidInput, match=r"'byte_size' must be an integer >= 1 below 2\^64, got a number of "):
        regions._count(byte_size, "byte_size", 1)  # a region's registration


def test_json_bodies_orjson_refuses_keep_their_old_answer():
    """UTF-16 (json detects it; orjson reads UTF-8 only) is still read, invalid UTF-8 is malformed
    JSON, a request id with a lone surrogate is echoed, and a duplicate key keeps its last value:
    as json did."""
    x, ids, w = tensors(T=3, seed=13)
    body = forward_body()
    req = codecs.decode_forward_json(body.decode().encode("utf-16"), SPEC)
    assert torch.equal(req.x, codecs.decode_forward_json(body, SPEC).x)
    with pytest.raises(InvalidInput, match="malformed JSON"):
        codecs.decode_forward_json(b"\xff" + body, SPEC)
    doc = v2_doc(id="\ud800")  # a lone surrogate: json reads and writes it, orjson neither
    req = codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    assert json.loads(b"".join(codecs.encode_v2_http(req.x, req, "moe")[0]))["id"] == "\ud800"
    dup = body[:-1] + b', "topk_ids": ' + json.dumps([[5, 4]] * 3).encode() + b"}"
    assert codecs.decode_forward_json(dup, SPEC).ids.tolist() == [[5, 4]] * 3
    for not_object in (b"[]", b"1", b'"x"', b"null"):
        with pytest.raises(InvalidInput, match="the JSON body must be an object"):
            codecs.decode_forward_json(not_object, SPEC)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_json_answers_round_trip_exactly(dtype):
    """Every value of the answer, as a client's json parses it, is the answer's value bit for bit
    (random bit patterns: subnormals, extremes, -0.0 included)."""
    gen = torch.Generator().manual_seed(14)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (37, SPEC.H), generator=gen, dtype=torch.int64)
    width = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    out = (bits.to(torch.int32) if width == torch.int32 else (bits % 2 ** 16 - 2 ** 15).to(torch.int16)).view(dtype)
    out = torch.where(torch.isfinite(out), out, torch.zeros((), dtype=dtype))
    out[0, :4] = torch.tensor([-0.0, torch.finfo(dtype).max, torch.finfo(dtype).tiny, -torch.finfo(dtype).max])
    back = torch.tensor(json.loads(codecs.encode_forward_json(out))["output"], dtype=torch.float32).to(dtype)
    assert torch.equal(back.view(width), out.view(width))
    req = codecs.decode_v2_http(json.dumps(v2_doc()).encode(), None, SPEC)
    doc = json.loads(b"".join(codecs.encode_v2_http(out, req, "moe")[0]))
    got = torch.tensor(doc["outputs"][0]["data"], dtype=torch.float32).to(dtype).reshape(out.shape)
    assert doc["outputs"][0]["shape"] == [37, SPEC.H] and torch.equal(got.view(width), out.view(width))


# ---- values beyond the declared datatype: a named 400, never a wrapped or rounded value ----------

WRAPPING_IDS = [2 ** 32 + 3, (1 << 33) + 2, -(1 << 32) + 3, 2 ** 31, -(2 ** 31) - 1]  # each a valid id mod 2**32


@pytest.mark.parametrize("bad", WRAPPING_IDS)
def test_v2_json_int32_ids_beyond_int32_are_refused(bad):
    """`"datatype": "INT32", "data": [0, 1, 2, 4294967299]` was answered as ids [0, 1, 2, 3]."""
    doc = v2_doc()
    doc["inputs"][1].update(datatype="INT32", data=[1, bad])
    with pytest.raises(InvalidInput, match=f"input 'topk_ids' has values outside the range of INT32 \\({bad}\\)"):
        codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    doc["inputs"][1]["datatype"] = "INT64"  # in range of INT64: then it is not an expert id
    with pytest.raises(InvalidInput, match=f"topk_ids\\[0, 1\\] = {bad} is not an expert id"):
        codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    with pytest.raises(InvalidInput, match=f"= {bad} is not an expert id"):  # /moe/forward JSON: int64, never cast
        codecs.decode_forward_json(forward_body(topk_ids=[[0, bad]] * 3), SPEC)
    doc["inputs"][1].update(datatype="INT32", data=[1, 2 ** 31 - 1 if bad > 0 else -(2 ** 31)])  # INT32's edges
    with pytest.raises(InvalidInput, match="is not an expert id"):
        codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)


@pytest.mark.parametrize("bad", WRAPPING_IDS[:3])
def test_grpc_int_contents_beyond_int32_are_refused(bad):
    """A varint past 32 bits in int_contents (what a client that does not use protobuf's setters can
    send) was truncated by protobuf to a valid id; the server's parser reads 64 bits and refuses it."""
    x, ids, w = tensors(T=1)
    wide = grpc_codec._ModelInferRequest(model_name="moe")
    for name, dt, t in zip(codecs.INPUT_NAMES, ("FP32", "INT32", "FP32"), (x, ids, w), strict=True):
        item = wide.inputs.add(name=name, datatype=dt, shape=list(t.shape))
        if dt == "INT32":
            item.contents.int_contents.extend([1, bad])
        else:
            item.contents.fp32_contents.extend(t.flatten().tolist())
    data = wide.SerializeToString()
    assert list(pb.ModelInferRequest.FromString(data).inputs[1].contents.int_contents) == [1, bad % 2 ** 32], \
        "protobuf's own parse wraps the value (what this test guards against)"
    with pytest.raises(InvalidInput, match=f"input 'topk_ids' has values outside the range of INT32 \\({bad}\\)"):
        grpc_codec.decode_grpc(grpc_codec.parse_grpc_request(data), SPEC)
    del wide.inputs[1].contents.int_contents[:]
    wide.inputs[1].contents.int_contents.extend(ids.flatten().tolist())
    req = grpc_codec.decode_grpc(grpc_codec.parse_grpc_request(wide.SerializeToString()), SPEC)
    assert torch.equal(req.ids, ids.int()) and torch.equal(req.x, x)


@pytest.mark.parametrize("datatype, value", [("FP16", 70000.0), ("BF16", 3.4e38), ("FP32", 1e39)])
def test_v2_json_floats_beyond_the_datatype_are_refused(datatype, value):
    """A finite JSON number that the declared datatype cannot hold is named as such (the cast made it
    an infinity, which was then refused as "NaN or infinity", a value the client never sent)."""
    for i, name in ((0, "hidden_states"), (2, "topk_weights")):
        doc = v2_doc()
        doc["inputs"][i].update(datatype=datatype)
        doc["inputs"][i]["data"][-1] = value
        with pytest.raises(InvalidInput, match=f"{name}'? has values outside the range of {datatype}"):
            codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
    if datatype == "FP32":
        with pytest.raises(InvalidInput, match="topk_weights has values outside the range of float32"):
            codecs.decode_forward_json(forward_body(topk_weights=[[0.5, value]] * 3), SPEC)


@pytest.mark.parametrize("value,kept", [(65504.0, 65504.0), (65519.0, 65504.0), (65519.999, 65504.0),
                                        (-65519.999, -65504.0), (6e-8, 2 ** -24), (-0.0, -0.0), (65520.0, None)])
def test_v2_json_fp16_rounds_once_at_its_limit(value, kept):
    """A JSON number is rounded to FP16 once (through float32, 65519.999 became 65520 and then an
    infinity: refused, though FP16's nearest value is 65504); 65520 and past are beyond FP16."""
    doc = v2_doc()
    doc["inputs"][0].update(datatype="FP16")
    doc["inputs"][0]["data"][-1] = value
    if kept is None:
        with pytest.raises(InvalidInput, match="hidden_states has values outside the range of FP16"):
            codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC)
        return
    got = codecs.decode_v2_http(json.dumps(doc).encode(), None, SPEC).x.reshape(-1)[-1]
    assert got.dtype == torch.float16 and float(got) == kept and math.copysign(1, float(got)) == math.copysign(1, kept)


def test_v2_input_with_both_data_and_binary_data_size_is_refused():
    """The binary blob used to win silently over the input's JSON `data`."""
    x, ids, w = tensors(T=1)
    doc = v2_doc()
    blob = codecs.to_bytes(ids.int())
    doc["inputs"][1].update(datatype="INT32", parameters={"binary_data_size": len(blob)})
    header = json.dumps(doc).encode()
    with pytest.raises(InvalidInput, match="input 'topk_ids' has both 'data' and binary_data_size"):
        codecs.decode_v2_http(header + blob, str(len(header)), SPEC)
    del doc["inputs"][1]["data"]
    header = json.dumps(doc).encode()
    assert torch.equal(codecs.decode_v2_http(header + blob, str(len(header)), SPEC).ids, ids.int())
