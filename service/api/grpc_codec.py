"""Open Inference Protocol v2 over gRPC: ModelInfer's own deserializer and serializer, and the
decoder of its request.

T tokens, H hidden (see service.config).

A request's tensors come as raw contents (raw_input_contents: one blob per input, in order), as
typed contents (InferTensorContents), or in shared-memory regions. `parse_grpc_request`, the
server's deserializer, walks the message's top-level fields once: raw_input_contents become views
of the received bytes, the rest (small) is parsed by protobuf. `decode_grpc` decodes it with the v2
pieces of service.api.codecs and ends, as every decoder there, in `validate`. The response is made
before the step (`grpc_response`): its bytes have room for the answer, which the batcher copies
out of the slot straight into them (or the ranks write there themselves, where the message and the
response lie in the wire arena: service.api.arena_objects), and `serialize_grpc_response` returns
them as they are; so protobuf copies no blob on the way in or on the way out. service.api.grpc
serves them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import time
import typing
import warnings

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from service.api.codecs import (
    INPUT_NAMES,
    INT_DTYPES,
    MODEL_VERSION,
    OUTPUT_NAME,
    SHM_REGION,
    V2_NAMES,
    Decoded,
    ModelSpec,
    decoded_v2,
    from_bytes,
    require_keys,
    shm_input,
    shm_params,
    v2_tensor_header,
    v2_timeout,
    within,
)
from service.api.proto import grpc_predict_v2_pb2 as pb
from service.api.regions import Regions, Rows
from service.errors import InvalidInput

_RAW_INPUTS = 7   # ModelInferRequest.raw_input_contents (grpc_predict_v2.proto)
_RAW_OUTPUTS = 6  # ModelInferResponse.raw_output_contents
_LEN = 2          # protobuf wire type of a length-delimited field


@dataclasses.dataclass
class GrpcInferRequest:
    """A received ModelInferRequest: every field but raw_input_contents, parsed by protobuf (its
    int_contents as int64: `_wide_int_request`), and raw_input_contents as views of the received
    bytes (upb would copy each blob on every access)."""

    message: pb.ModelInferRequest
    raw: list[memoryview]
    received: float = 0.0  # time.perf_counter() when the deserializer got the message: where its books start


def _wide_int_request() -> typing.Any:
    """ModelInferRequest with InferTensorContents.int_contents read as int64: the wire encoding is
    the same varint, but protobuf truncates a value past int32 to its low 32 bits (4294967299 would
    be id 3), so the parser keeps all 64 and `_grpc_contents` refuses what INT32 cannot hold."""
    file = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    contents = next(m for m in file.message_type if m.name == "InferTensorContents")
    next(f for f in contents.field if f.name == "int_contents").type = descriptor_pb2.FieldDescriptorProto.TYPE_INT64
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{file.package}.ModelInferRequest"))


_ModelInferRequest = _wide_int_request()  # what the server's deserializer parses into


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def parse_grpc_request(data: bytes) -> GrpcInferRequest:
    """The gRPC deserializer of ModelInfer. Top-level fields are walked once: raw_input_contents
    become memoryviews, the rest (small) is handed to protobuf. Anything this walk does not
    understand goes to protobuf whole, which then parses it or raises its own DecodeError."""
    received = time.perf_counter()
    view = memoryview(data)
    raw: list[memoryview] = []
    rest: list[memoryview] = []
    i = 0
    try:
        while i < len(view):
            start = i
            tag, i = _varint(view, i)
            kind = tag & 7
            if kind == 0:
                _, i = _varint(view, i)
            elif kind == 1:
                i += 8
            elif kind == 5:
                i += 4
            elif kind == _LEN:
                n, i = _varint(view, i)
                if tag >> 3 == _RAW_INPUTS:
                    raw.append(view[i:i + n])
                    i += n
                    if i > len(view):
                        raise ValueError("truncated")
                    continue
                i += n
            else:
                raise ValueError(f"wire type {kind}")
            if i > len(view):
                raise ValueError("truncated")
            rest.append(view[start:i])
    except (ValueError, IndexError):
        return GrpcInferRequest(_ModelInferRequest.FromString(data), [], received)
    return GrpcInferRequest(_ModelInferRequest.FromString(b"".join(rest)), raw, received)


def decode_grpc(request: pb.ModelInferRequest | GrpcInferRequest, spec: ModelSpec,
                regions: Regions | None = None) -> Decoded:
    """A ModelInferRequest; an input in a shared-memory region has no raw_input_contents entry
    (raw_input_contents holds the other inputs', in order), as tritonclient sends it."""
    if isinstance(request, GrpcInferRequest):
        request, raw = request.message, request.raw or request.message.raw_input_contents
    else:
        raw = request.raw_input_contents
    shms = [shm_params(_grpc_params(item.parameters), f"input '{item.name}'") for item in request.inputs]
    on_wire = sum(shm is None for shm in shms)
    if raw and len(raw) != on_wire:
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {on_wire} inputs")
    tensors: dict[str, Rows] = {}
    blobs = iter(raw)
    for item, shm in zip(request.inputs, shms, strict=True):
        name, dtype, shape = v2_tensor_header(item.name, item.datatype, list(item.shape), tensors)
        if shm is not None:
            if item.HasField("contents"):
                raise InvalidInput(f"input '{name}' is in a shared-memory region: it must have no contents")
            tensors[name] = shm_input(regions, shm, dtype, shape, name)
        elif raw:
            if item.HasField("contents"):
                raise InvalidInput(f"input '{name}' has contents although raw_input_contents is used")
            tensors[name] = from_bytes(memoryview(next(blobs)), dtype, shape, name)
        else:
            tensors[name] = _grpc_contents(item.contents, dtype, shape, name)
    require_keys(tensors, INPUT_NAMES, "the request's inputs")
    out_shm = None
    for out in request.outputs:
        if out.name != OUTPUT_NAME:
            raise InvalidInput(f"unknown output '{out.name}'; the model has one output, '{OUTPUT_NAME}'")
        out_shm = shm_params(_grpc_params(out.parameters), f"output '{OUTPUT_NAME}'")
    timeout = None
    if "timeout" in request.parameters:
        param = request.parameters["timeout"]
        timeout = v2_timeout(getattr(param, param.WhichOneof("parameter_choice") or "int64_param"))
    return decoded_v2(tensors, spec, request.id or None, timeout, regions, out_shm)


def grpc_decode_work(request: GrpcInferRequest | pb.ModelInferRequest) -> int:
    """The elements decode_grpc converts from protobuf's typed contents: what decides whether
    decoding leaves the event loop. Raw contents are viewed, not converted (0: decoded on the loop;
    hidden_states' values are checked later, in the slot), and so are inputs in a shared-memory
    region (not counted: a grpc_shm request of T=512 was sent to a thread for nothing, a hop v2_shm
    does not take; bench/NOTES.md, issue 11, helper G); typed ones count their declared shapes
    (measuring the contents instead would copy them: upb hands out copies, ByteSize() encodes the
    whole message)."""
    if isinstance(request, GrpcInferRequest):
        if request.raw:
            return 0
        request = request.message
    return sum(math.prod(item.shape) for item in request.inputs if SHM_REGION not in item.parameters)


@dataclasses.dataclass
class GrpcInferResponse:
    """A ModelInferResponse made before the step, as its serialized bytes: protobuf's bytes of every
    field but raw_output_contents, then that field's key and length, then the answer's rows, which
    `out` [T, H] views: the batcher's copy out of the slot writes them in place (the answer's one
    copy), and the serializer returns `data` as it is (grpc takes `bytes` only: a bytearray or a
    memoryview is refused, so there was a join of the answer on the event loop before)."""

    data: bytes
    out: Rows  # or the answer's rows in the client's output region (then `data` holds no rows)

    def to_message(self) -> pb.ModelInferResponse:
        """The whole message (tests and in-process callers)."""
        return pb.ModelInferResponse.FromString(self.data)


def grpc_response(req: Decoded, model_name: str) -> GrpcInferResponse:
    """The response to `req`, its answer's rows still to be written into `.out`."""
    T, H = req.x.shape
    response = pb.ModelInferResponse(model_name=model_name, model_version=MODEL_VERSION, id=req.request_id or "")
    response.outputs.add(name=OUTPUT_NAME, datatype=V2_NAMES[req.out_dtype], shape=[T, H])
    if req.out_region is not None:
        # The answer goes into the client's region: its metadata and an empty raw_output_contents
        # entry, as Triton answers (clients index raw_output_contents by output: perf_analyzer's
        # gRPC client crashes without it).
        response.raw_output_contents.append(b"")
        return GrpcInferResponse(response.SerializeToString(), req.out_region)
    size = T * H * req.out_dtype.itemsize
    head = response.SerializeToString() + key_and_length(_RAW_OUTPUTS, size)
    data = bytes_to_fill(len(head) + size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bytes are read-only to Python: see bytes_to_fill
        torch.frombuffer(data, dtype=torch.uint8, count=len(head)).copy_(torch.frombuffer(bytearray(head),
                                                                                          dtype=torch.uint8))
        out = torch.frombuffer(data, dtype=req.out_dtype, count=T * H, offset=len(head)).view(T, H)
    return GrpcInferResponse(data, out)


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)


def bytes_to_fill(n: int) -> bytes:
    """A new bytes object of `n` uninitialized bytes, to be written once before anyone reads it:
    CPython's PyBytes_FromStringAndSize(NULL, n), whose contents its C API lets the creator fill
    (torch.frombuffer of it is then writable memory: it holds a reference, so the bytes outlive
    every write). bytes(n) would zero them first (calloc: +140 us for 4 MiB), and a bytearray is
    refused by grpc."""
    assert n > 1, n  # CPython shares its empty bytes object; a message is never that short
    return _new_bytes(None, n)


def serialize_grpc_response(response: GrpcInferResponse | pb.ModelInferResponse) -> bytes:
    """The gRPC serializer of ModelInfer: a GrpcInferResponse is already its bytes."""
    if isinstance(response, pb.ModelInferResponse):
        return response.SerializeToString()
    return response.data


def key_and_length(field: int, n: int) -> bytes:
    out = bytearray()
    for value in ((field << 3) | _LEN, n):
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


# --------------------------------------------------------------------------------------------
# helpers


def _grpc_contents(contents: pb.InferTensorContents, dtype: torch.dtype, shape: list[int], name: str
                   ) -> torch.Tensor:
    fields = {torch.float32: ("fp32_contents", np.float32), torch.int32: ("int_contents", np.int64),
              torch.int64: ("int64_contents", np.int64)}  # int_contents: 64 bits as parsed (_wide_int_request)
    if dtype not in fields:
        raise InvalidInput(f"input '{name}' is {V2_NAMES[dtype]}: it must travel in raw_input_contents")
    field, np_dtype = fields[dtype]
    others = sorted(f.name for f, _ in contents.ListFields() if f.name != field)
    if others:
        raise InvalidInput(f"input '{name}' is {V2_NAMES[dtype]}: its values belong in {field}, "
                           f"not {', '.join(others)}")
    values = getattr(contents, field)
    # Count first (len() of a repeated field is O(1)): a request that declares [1, H] but carries
    # millions of values is refused before they are converted, which holds the event loop.
    if len(values) != shape[0] * shape[1]:
        raise InvalidInput(f"input '{name}' has {len(values)} values; shape {shape} needs {shape[0] * shape[1]}")
    t = torch.from_numpy(np.asarray(values, dtype=np_dtype))
    return (within(t, dtype, name) if dtype in INT_DTYPES else t).reshape(shape)


def _grpc_params(params) -> dict:
    """A protobuf map of InferParameter as plain values."""
    return {key: getattr(p, p.WhichOneof("parameter_choice")) for key, p in params.items()
            if p.WhichOneof("parameter_choice") is not None}
