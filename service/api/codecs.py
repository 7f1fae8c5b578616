"""Request decoding, validation and response encoding for every wire format.

T tokens, H hidden, K top-k, E experts (see service.config).

Formats: `/moe/forward` JSON and safetensors, Open Inference Protocol v2 over HTTP (JSON
tensors and the binary tensor data extension) and over gRPC (raw contents or typed contents:
service.api.grpc_codec, which builds on the v2 pieces here); JSON text is read and written by
service.api.json_codec. Every decoder ends in `validate`: shapes, T agreement, dtypes, expert ids in [0, E), finite
weights and the token limit are checked there, and hidden_states' values (finite, within the
layer's dtype) by `rows_error` on the rows the batcher copies into the step's slot, before the
step runs; each error names the problem, so nothing reaches a rank that could make it fail.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
import warnings

import numpy as np
import safetensors.torch
import torch

from service.api.error_map import ModelNotFound, PayloadTooLarge
from service.api.json_codec import below_2_64, echoed, json_array, json_bytes, json_object, past_64_bits
from service.api.regions import RegionRows, Regions, Rows, enabled, sent_row
from service.config import DTYPE_NAMES, LayerConfig
from service.errors import InvalidInput

INPUT_NAMES = ("hidden_states", "topk_ids", "topk_weights")
OUTPUT_NAME = "output"

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)

# Open Inference Protocol datatype names <-> torch dtypes (only the ones this model speaks).
V2_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16,
             "INT32": torch.int32, "INT64": torch.int64}
V2_NAMES = {v: k for k, v in V2_DTYPES.items()}
V2_ACCEPTED = {"hidden_states": ("FP32", "FP16", "BF16"), "topk_ids": ("INT32", "INT64"),
               "topk_weights": ("FP32", "FP16", "BF16")}

US_PER_S = 1e6  # the v2 `timeout` parameter is in microseconds (Triton's convention)
MAX_DIM = 2**31 - 1  # a declared dimension past int32 is refused before any size arithmetic
X = typing.TypeVar("X", bound=Rows)  # hidden_states: a tensor, or rows in a shared-memory region


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a request must look like: the layer's shape plus the per-request token limit."""

    E: int
    H: int
    K: int
    dtype: torch.dtype  # the dtype the ranks compute in; inputs are cast to it
    max_tokens: int     # the most tokens one request may carry (the queue limit)

    @classmethod
    def of(cls, cfg: LayerConfig, max_tokens: int) -> ModelSpec:
        return cls(E=cfg.E, H=cfg.H, K=cfg.K, dtype=cfg.dtype, max_tokens=max_tokens)


@dataclasses.dataclass
class Decoded:
    """A validated request, ready for the batcher."""

    x: Rows             # [T, H] as sent (float32/16, bf16), contiguous, or rows in a shared-memory
                        # region (service.api.regions); converted into the slot
    ids: torch.Tensor   # [T, K] int32
    w: torch.Tensor     # [T, K] float32
    out_dtype: torch.dtype  # the answer's dtype: that of hidden_states as sent
    request_id: str | None = None
    timeout_s: float | None = None  # per-request deadline override
    binary_output: bool = False     # v2 HTTP: answer with the binary tensor extension
    out_region: RegionRows | None = None  # the answer's rows in the client's output region, if it asked

    @property
    def T(self) -> int:
        return self.x.shape[0]


# --------------------------------------------------------------------------------------------
# validation


def all_finite(t: torch.Tensor) -> bool:
    """True when no element of the float tensor `t` is NaN or infinite: one aminmax (min and max
    propagate NaN, and an infinity is the min or the max), ~30x faster than torch.isfinite on bf16."""
    return t.numel() == 0 or all(math.isfinite(float(v)) for v in torch.aminmax(t))


def rows_error(rows: torch.Tensor, sent: Rows, first: int = 0) -> tuple[int, InvalidInput] | None:
    """The check of hidden_states' values, made on `rows` [n, H] as the step's slot holds them (the
    one copy in, converted from `sent`, the request's rows `first`.. as they came): None when every
    element is finite. The screen is one sum of the rows: a NaN or an infinity anywhere makes it
    non-finite, so a finite sum proves every element finite; a non-finite one (also the rare overflow
    of the sum itself) is decided exactly. A value that the slot's narrower dtype cannot hold became
    an infinity in the copy, so the same check covers the range of the narrowing cast (rounding
    decides as it does on the ranks). ~2.5x cheaper than one aminmax of bf16 rows (bench/NOTES.md,
    issue 11d). Else (the request's row, the error naming it): its first bad row, whichever the reason."""
    if math.isfinite(float(rows.sum())) or all_finite(rows):
        return None
    bad = int((~torch.isfinite(rows)).any(dim=1).nonzero()[0])  # NaN, infinity or out of range there
    row = first + bad
    if all_finite(sent_row(sent, bad)):
        return row, InvalidInput(f"hidden_states has values outside the range of {_name(rows.dtype)} (row {row})")
    return row, nonfinite_error(row)


def nonfinite_error(row: int) -> InvalidInput:
    """The 400 of a request whose row `row` holds NaN or infinity (found here, or by a rank: --shm-direct)."""
    return InvalidInput(f"hidden_states contains NaN or infinity (row {row})")


def check_shapes(x: Rows, ids: Rows, w: Rows, spec: ModelSpec) -> None:
    """The tensors' shapes against the model: hidden_states [T, H] with 1 <= T <= max_tokens,
    topk_ids and topk_weights [T, K]. Needs only their shapes: a routing tensor in a shared-memory
    region is checked before it is read (a small request must never make the server read a large
    region)."""
    if x.dim() in (1, 2) and x.shape[0] == 0:
        raise InvalidInput("hidden_states has no rows (T = 0)")
    if x.dim() != 2 or x.shape[1] != spec.H:
        raise InvalidInput(f"hidden_states must have shape [T, {spec.H}], got {list(x.shape)}")
    T = x.shape[0]
    if T > spec.max_tokens:
        raise PayloadTooLarge(f"the request has T = {T} tokens, more than the limit of "
                              f"{spec.max_tokens} tokens per request (queue_tokens)")
    for name, t in (("topk_ids", ids), ("topk_weights", w)):
        if t.dim() != 2 or t.shape[1] != spec.K:
            raise InvalidInput(f"{name} must have shape [T, {spec.K}] (K = {spec.K}), got {list(t.shape)}")
        if t.shape[0] != T:
            raise InvalidInput(f"{name} has {t.shape[0]} rows but hidden_states has T = {T}")


def validate(x: X, ids: torch.Tensor, w: torch.Tensor, spec: ModelSpec) -> tuple[X, torch.Tensor, torch.Tensor]:
    """Check one request's tensors against the model: everything but hidden_states' values, which
    the batcher checks on the step's slot rows as it copies them in (`rows_error`: the one pass over
    them besides the one copy). x is returned as it came (a view of the request's bytes where it
    can be, or its rows in a shared-memory region: the batcher converts it to spec.dtype in that
    copy); ids become int32 and w float32 ([T, K], small)."""
    if x.dtype not in FLOAT_DTYPES:
        raise InvalidInput(f"hidden_states must be float32, float16 or bfloat16, got {_name(x.dtype)}")
    if ids.dtype not in INT_DTYPES:
        raise InvalidInput(f"topk_ids must be int32 or int64, got {_name(ids.dtype)}")
    if w.dtype not in FLOAT_DTYPES:
        raise InvalidInput(f"topk_weights must be float32, float16 or bfloat16, got {_name(w.dtype)}")
    check_shapes(x, ids, w, spec)
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0 or hi >= spec.E:
        bad = lo if lo < 0 else hi
        t, k = (ids == bad).nonzero()[0].tolist()
        raise InvalidInput(f"topk_ids[{t}, {k}] = {bad} is not an expert id in [0, {spec.E})")
    if not all_finite(w):
        raise InvalidInput("topk_weights contains NaN or infinity")
    if isinstance(x, torch.Tensor):
        x = typing.cast(X, x.contiguous())
    return x, ids.to(torch.int32).contiguous(), w.to(torch.float32).contiguous()


# A decimal number as a header writes it (Python's float() also takes "1_0", read as 10, and "inf")
_DECIMAL = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def parse_timeout_s(value: str | float | int | None, what: str) -> float | None:
    """A per-request deadline in seconds; None when absent."""
    if value is None:
        return None
    try:
        if isinstance(value, str) and not _DECIMAL.fullmatch(value):
            raise ValueError(value)
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"{what} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidInput(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return seconds


# --------------------------------------------------------------------------------------------
# POST /moe/forward


Body = bytes | memoryview | list  # a request body, or the chunks it arrived in (joined by the decoder)


def join_chunks(body: Body) -> bytes | memoryview:
    """One buffer of a body that arrived in chunks. The copy is numpy's, which releases the GIL
    (bytes.join holds it): run in a worker thread, it leaves the event loop free meanwhile."""
    if not isinstance(body, list):
        return body
    if len(body) == 1:
        return body[0]
    out = np.empty(sum(len(c) for c in body), dtype=np.uint8)
    at = 0
    for chunk in body:
        out[at:at + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        at += len(chunk)
    return out.data


def decode_forward_json(body: Body, spec: ModelSpec) -> Decoded:
    doc = json_object(join_chunks(body))
    require_keys(doc, INPUT_NAMES, "the JSON body")
    x = json_array(doc["hidden_states"], "hidden_states", np.float32)
    ids = json_array(doc["topk_ids"], "topk_ids", None)
    w = json_array(doc["topk_weights"], "topk_weights", np.float32)
    x, ids, w = validate(x, ids, w, spec)
    return Decoded(x, ids, w, out_dtype=torch.float32)


def encode_forward_json(out: torch.Tensor) -> bytes:
    _json_finite(out)
    return json_bytes({OUTPUT_NAME: out.float().tolist()})


def decode_safetensors(body: Body, spec: ModelSpec) -> Decoded:
    try:
        tensors = safetensors.torch.load(bytes(join_chunks(body)))
    except Exception as e:  # the Rust parser raises its own SafetensorError and others
        raise InvalidInput(f"malformed safetensors body: {e}") from None
    require_keys(tensors, INPUT_NAMES, "the safetensors body")
    x, ids, w = (tensors[n] for n in INPUT_NAMES)
    out_dtype = x.dtype
    x, ids, w = validate(x, ids, w, spec)
    return Decoded(x, ids, w, out_dtype=out_dtype)


def encode_safetensors(out: torch.Tensor) -> bytes:
    return safetensors.torch.save({OUTPUT_NAME: out.contiguous()})


# --------------------------------------------------------------------------------------------
# Open Inference Protocol v2 over HTTP


def decode_v2_http(body: Body, header_length: str | None, spec: ModelSpec, regions: Regions | None = None
                   ) -> Decoded:
    """A v2 infer body: JSON, or a JSON header of `header_length` bytes followed by blobs; tensors
    may also be in shared-memory regions registered with `regions` (None: the extension is off)."""
    view = memoryview(join_chunks(body))
    if header_length is None:
        header, blobs = view, view[len(view):]
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise InvalidInput(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
        if not 0 < n <= len(view):
            raise InvalidInput(f"Inference-Header-Content-Length = {n} does not fit a body of {len(view)} bytes")
        header, blobs = view[:n], view[n:]
    doc = json_object(header)
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        raise InvalidInput("the request must have an 'inputs' list")
    tensors: dict[str, Rows] = {}
    offset = 0
    for item in inputs:
        if not isinstance(item, dict):
            raise InvalidInput("each entry of 'inputs' must be an object")
        name, dtype, shape = v2_tensor_header(item.get("name"), item.get("datatype"), item.get("shape"), tensors)
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"input '{name}': 'parameters' must be an object")
        size = params.get("binary_data_size")
        shm = shm_params(params, f"input '{name}'")
        if shm is not None:
            if size is not None or "data" in item:
                raise InvalidInput(f"input '{name}' is in a shared-memory region: it must have neither 'data' "
                                   f"nor binary_data_size")
            tensors[name] = shm_input(regions, shm, dtype, shape, name)
        elif size is not None:
            if "data" in item:
                raise InvalidInput(f"input '{name}' has both 'data' and binary_data_size: send its values one way")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInput(f"input '{name}': binary_data_size must be a non-negative "
                                   f"integer{below_2_64(size)}")
            if offset + size > len(blobs):
                raise InvalidInput(f"input '{name}': binary_data_size = {size} runs past the end of the body")
            tensors[name] = from_bytes(blobs[offset:offset + size], dtype, shape, name)
            offset += size
        elif "data" in item:
            tensors[name] = _v2_json_data(item["data"], dtype, shape, name)
        else:
            raise InvalidInput(f"input '{name}' has neither 'data' nor a binary_data_size or "
                               f"shared_memory_region parameter")
    if offset != len(blobs):
        raise InvalidInput(f"the body has {len(blobs) - offset} bytes of binary data that no input claims")
    require_keys(tensors, INPUT_NAMES, "the request's inputs")

    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    binary, out_shm = _requested_binary(doc.get("outputs"), params.get("binary_data_output", False))
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    decoded = decoded_v2(tensors, spec, request_id, v2_timeout(params.get("timeout")), regions, out_shm)
    decoded.binary_output = binary
    return decoded


# What decides whether a body is decoded, or an answer encoded, off the event loop (the front end's
# OFFLOAD_ELEMENTS): about the elements of binary data that work costs. A JSON body counts each
# byte, an answer written as JSON JSON_NUMBER_WORK per number: orjson parses ~5 ns a byte (2.7 MB
# at T=512, H=256: 10-15 ms on the CPU VM) and tolist + orjson write ~40 ns a number, where copying
# a binary element takes ~1 ns. In a thread the work still holds the GIL, but the event loop gets
# it back every switch interval (5 ms) instead of after the whole body: beside one client looping
# JSON T=512, a T=1 gRPC client's p50 was 21-35 ms against 36-58 on the loop, v2 binary's the same
# (bench/NOTES.md, "Issue 11 item 3").
JSON_NUMBER_WORK = 16


def forward_decode_work(body: Body, json_body: bool) -> int:
    """The decode work of a /moe/forward body: its bytes (JSON) or its bytes / 4 (safetensors)."""
    size = sum(map(len, body)) if isinstance(body, list) else len(body)
    return size if json_body else size // 4


def v2_http_decode_work(body: Body, header_length: str | None) -> int:
    """The decode work of a v2 body: a JSON body's bytes; with binary tensors, the JSON header's
    bytes / 4 (binary blobs are viewed, not parsed, and hidden_states' values are checked later,
    in the slot), or the whole body's when it came in several chunks (joined first: a copy). A
    malformed length is the decoder's to name."""
    chunks = body if isinstance(body, list) else [body]
    size = sum(map(len, chunks))
    if header_length is None:
        return size
    if len(chunks) == 1 and header_length.isdigit():
        size = min(int(header_length), size)
    return size // 4


def encode_v2_http(out: Rows, req: Decoded, model_name: str) -> tuple[list, int | None]:
    """The response body as parts to send one after the other (the output's bytes are a view of
    `out`, not a copy) and, with binary output, the JSON header's length. An answer written into
    the client's output region is its metadata alone (name, datatype, shape), as Triton answers:
    no data and no parameters (perf_analyzer's HTTP client reads binary_data_size from any output
    that has parameters)."""
    tensor: dict[str, object] = {"name": OUTPUT_NAME, "datatype": V2_NAMES[out.dtype], "shape": list(out.shape)}
    doc: dict = {"model_name": model_name, "model_version": MODEL_VERSION, "outputs": [tensor]}
    if req.request_id is not None:
        doc["id"] = req.request_id
    if isinstance(out, RegionRows):
        return [json_bytes(doc)], None
    if not req.binary_output:
        _json_finite(out)
        tensor["data"] = out.float().reshape(-1).tolist()
        return [json_bytes(doc)], None
    raw = tensor_bytes(out)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json_bytes(doc)
    return [header, raw], len(header)


# --------------------------------------------------------------------------------------------
# helpers


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Row-major little-endian bytes of a CPU tensor (bf16 through its 16-bit pattern), as a view
    of the tensor's memory when it is contiguous (no copy; the view keeps the tensor alive)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().data.cast("B")


def to_bytes(t: torch.Tensor) -> bytes:
    """The same bytes as a bytes object (a copy)."""
    return bytes(tensor_bytes(t))


def _name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def _json_finite(out: torch.Tensor) -> None:
    """Refuses an answer that overflowed (in its own dtype): JSON (RFC 8259) has no NaN or Infinity,
    and orjson would write them as null, a value the layer never gave. Checked on the tensor, before
    it becomes a list."""
    if not all_finite(out):
        name = _name(out.dtype)
        # (not "beyond the float32 range": an fp16 layer's NaN, past 65504 inside it, reached a float32
        # answer and was named as float32's overflow)
        raise InvalidInput(f"the {name} answer holds NaN or infinity: the layer overflowed on these inputs (the "
                           f"range of its compute dtype, or of {name}); JSON cannot carry them: send smaller "
                           "values, or use a binary format")


def require_keys(found, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if n not in found]
    if missing:
        raise InvalidInput(f"{where} lacks {', '.join(repr(n) for n in missing)}; "
                           f"expected {', '.join(names)}")
    extra = [n for n in found if n not in names]
    if extra:
        raise InvalidInput(f"{where} has unexpected {', '.join(repr(str(n)) for n in extra)}; "
                           f"expected {', '.join(names)}")


def v2_tensor_header(name, datatype, shape, seen) -> tuple[str, torch.dtype, list[int]]:
    if name not in INPUT_NAMES:
        raise InvalidInput(f"unknown input {name!r}; the model takes {', '.join(INPUT_NAMES)}")
    if name in seen:
        raise InvalidInput(f"input '{name}' appears twice")
    if datatype not in V2_ACCEPTED[name]:
        raise InvalidInput(f"input '{name}' has datatype {datatype!r}; accepted: {', '.join(V2_ACCEPTED[name])}")
    if not isinstance(shape, list) or len(shape) != 2 or not all(map(_dimension, shape)):
        raise InvalidInput(f"input '{name}' must have a 2-D shape of non-negative integers, got {echoed(shape)}")
    if any(d > MAX_DIM for d in shape):
        raise InvalidInput(f"input '{name}' has shape {echoed(shape)}: a dimension over {MAX_DIM} cannot be a "
                           f"real request")
    return name, V2_DTYPES[datatype], shape


def _dimension(d) -> bool:
    """A shape's item: a non-negative integer, or one past 64 bits (which orjson reads as a float:
    refused as over MAX_DIM, not as a non-integer)."""
    return (isinstance(d, int) and not isinstance(d, bool) and d >= 0) or (past_64_bits(d) and d > 0)


def from_bytes(buf: memoryview, dtype: torch.dtype, shape: list[int], name: str) -> torch.Tensor:
    count = shape[0] * shape[1]
    need = count * dtype.itemsize
    if len(buf) != need:
        raise InvalidInput(f"input '{name}' has {len(buf)} bytes of data; shape {shape} of "
                           f"{V2_NAMES[dtype]} needs {need}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write into it
        return torch.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def _v2_json_data(data, dtype: torch.dtype, shape: list[int], name: str) -> torch.Tensor:
    """An input's JSON `data` as a [shape] tensor of its declared datatype. A value that datatype
    cannot hold is refused (a cast would wrap an integer: 2**32 + 3 as INT32 is 3, a valid id; and
    turn a float beyond FP16's range into an infinity the error would misname)."""
    if dtype in INT_DTYPES:
        t = within(json_array(data, name, None), dtype, name)
    elif dtype == torch.bfloat16:  # rounded once, as FP16 (through float32 nearest, 1 + 2**-8 + 2**-30 was 1.0)
        t = torch.from_numpy(round_to_odd_float32(json_array(data, name, np.float64, V2_NAMES[dtype]).numpy()))
    else:  # numpy rounds the parsed float64 to FP16 once (through float32, 65519.999 became 65520: inf)
        t = json_array(data, name, np.float16 if dtype == torch.float16 else np.float32, V2_NAMES[dtype])
    if t.numel() != shape[0] * shape[1]:
        raise InvalidInput(f"input '{name}' has {t.numel()} values; shape {shape} needs {shape[0] * shape[1]}")
    out = t.reshape(shape).to(dtype)
    if dtype in FLOAT_DTYPES and dtype != t.dtype and not all_finite(out) and all_finite(t):
        raise InvalidInput(f"input '{name}' has values outside the range of {V2_NAMES[dtype]}")
    return out


def round_to_odd_float32(a: np.ndarray) -> np.ndarray:
    """float64 values as float32, rounded to odd (toward zero, the last bit set where that was
    inexact): float32 keeps 16 bits more than bfloat16, so the nearest-even cast to bfloat16 after
    this is the one correct rounding of the float64 (nearest float32 first can round twice). A value
    past float32's range becomes its largest finite value, which bfloat16 rounds to infinity."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = a.astype(np.float32)
        away = np.isfinite(a) & (np.abs(f.astype(np.float64)) > np.abs(a))
        f = np.where(away, np.nextafter(f, np.float32(0)), f)
        inexact = np.isfinite(a) & (f.astype(np.float64) != a)
    bits = f.view(np.uint32)
    return np.where(inexact, bits | np.uint32(1), bits).view(np.float32)


def within(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`t` (int64 values of an input declared `dtype`), refused when a value is outside dtype's range."""
    info = torch.iinfo(dtype)
    if t.numel() and (info.min, info.max) != (-2**63, 2**63 - 1):
        lo, hi = (int(v) for v in torch.aminmax(t))
        if lo < info.min or hi > info.max:
            raise InvalidInput(f"input '{name}' has values outside the range of {V2_NAMES[dtype]} "
                               f"({lo if lo < info.min else hi})")
    return t


def v2_timeout(value) -> float | None:
    """The v2 `timeout` parameter (microseconds; 0 means the server default) in seconds."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"parameter 'timeout' must be a number of microseconds, got {value!r}")
    try:
        seconds = value / US_PER_S
    except OverflowError:  # an integer past the float range
        raise InvalidInput("parameter 'timeout' is out of range for microseconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidInput(f"parameter 'timeout' must be a positive, finite number of microseconds "
                           f"(0: the server's default), got {value!r}")
    return seconds


def _requested_binary(outputs, default) -> tuple[bool, tuple | None]:
    """Whether the answer goes in the binary extension, and its shared-memory parameters if any."""
    if not isinstance(default, bool):
        raise InvalidInput("parameter 'binary_data_output' must be a boolean")
    if outputs is None:
        return default, None
    if not isinstance(outputs, list):
        raise InvalidInput("'outputs' must be a list")
    binary, shm = default, None
    for out in outputs:
        if not isinstance(out, dict) or out.get("name") != OUTPUT_NAME:
            name = out.get("name") if isinstance(out, dict) else out
            raise InvalidInput(f"unknown output {name!r}; the model has one output, '{OUTPUT_NAME}'")
        params = out.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"output '{OUTPUT_NAME}': 'parameters' must be an object")
        flag = params.get("binary_data", default)
        if not isinstance(flag, bool):
            raise InvalidInput("output parameter 'binary_data' must be a boolean")
        shm = shm_params(params, f"output '{OUTPUT_NAME}'")
        if shm is not None and params.get("binary_data") is True:
            raise InvalidInput(f"output '{OUTPUT_NAME}' cannot set both 'shared_memory_region' and 'binary_data'")
        binary = flag and shm is None
    return binary, shm


def decoded_v2(tensors: dict[str, Rows], spec: ModelSpec, request_id, timeout,
                regions: Regions | None = None, out_shm: tuple | None = None) -> Decoded:
    x, ids, w = (tensors[n] for n in INPUT_NAMES)
    if isinstance(ids, RegionRows) or isinstance(w, RegionRows):  # read only once their shapes fit
        check_shapes(x, ids, w, spec)
    ids, w = (t.read() if isinstance(t, RegionRows) else t for t in (ids, w))
    out_dtype = x.dtype
    x, ids, w = validate(x, ids, w, spec)
    decoded = Decoded(x, ids, w, out_dtype=out_dtype, request_id=request_id, timeout_s=timeout)
    if out_shm is not None:
        region, offset, size = out_shm
        decoded.out_region = enabled(regions).rows(region, offset, size, out_dtype, list(x.shape),
                                                   f"output '{OUTPUT_NAME}'", output=True)
        x_sent = tensors[INPUT_NAMES[0]]
        if isinstance(x_sent, RegionRows):
            check_overlap(x_sent, decoded.out_region)
    return decoded


def check_overlap(x: RegionRows, out: RegionRows) -> None:
    """Refuse an output region over hidden_states' bytes where an answer could land on rows not read
    yet. A request of several steps reads each step's rows just before that step and writes its
    answer after it: an answer row that ends at or before the end of its own input row (in place, or
    the output starting earlier, rows no longer than the input's) covers only rows already read; any
    other overlap overwrote the rows of later steps (a 200 with wrong rows, before this check)."""
    same_object = (x.obj.region.dev, x.obj.region.ino) == (out.obj.region.dev, out.obj.region.ino)
    x_end, out_end = x.at + x.shape[0] * x.row_bytes, out.at + out.shape[0] * out.row_bytes
    if not same_object or out_end <= x.at or x_end <= out.at:
        return
    if out.at <= x.at and out.row_bytes <= x.row_bytes:
        return
    raise InvalidInput(
        f"output '{OUTPUT_NAME}' (bytes {out.at}-{out_end} of its shared-memory object) overlaps input "
        f"'{INPUT_NAMES[0]}' (bytes {x.at}-{x_end}) where it would overwrite rows not yet read: write the "
        f"answer in place (the same offset and datatype), before the input, or elsewhere")


SHM_REGION, SHM_OFFSET, SHM_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"


def shm_params(params: dict, what: str) -> tuple[str, int, int] | None:
    """A tensor's shared-memory parameters (region, offset, byte size), or None when it names no
    region. Region and byte size go together (Triton's rule); the offset defaults to 0."""
    if SHM_REGION not in params and SHM_SIZE not in params:
        if SHM_OFFSET in params:
            raise InvalidInput(f"{what} has shared_memory_offset without shared_memory_region")
        return None
    if SHM_REGION not in params or SHM_SIZE not in params:
        raise InvalidInput(f"{what}: shared_memory_region and shared_memory_byte_size must be given together")
    region, size, offset = params[SHM_REGION], params[SHM_SIZE], params.get(SHM_OFFSET, 0)
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{what}: shared_memory_region must be a region's name, got {region!r}")
    for key, value in ((SHM_SIZE, size), (SHM_OFFSET, offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(f"{what}: {key} must be a non-negative integer{below_2_64(value)}, got {echoed(value)}")
    return region, offset, size


def shm_input(regions: Regions | None, shm: tuple, dtype: torch.dtype, shape: list[int], name: str) -> RegionRows:
    """An input in a region: hidden_states stays there until its step copies it into the slot;
    the routing ([T, K], whose values `validate` checks) is read by `decoded_v2` once every
    input's shape is known and checked."""
    region, offset, size = shm
    return enabled(regions).rows(region, offset, size, dtype, shape, f"input '{name}'")


MODEL_VERSION = "1"  # the one version of the model (Triton's tools need a numeric one to key statistics)


def check_model(name: str, version: str | None, model_name: str) -> None:
    """Unknown model names and any version but MODEL_VERSION are a 404."""
    if name != model_name:
        raise ModelNotFound(f"unknown model {name!r}; this server serves {model_name!r}")
    if version and version != MODEL_VERSION:
        raise ModelNotFound(f"model {name!r} has no version {version!r}; its only version is {MODEL_VERSION!r}")
