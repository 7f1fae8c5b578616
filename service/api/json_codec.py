"""JSON text: a request's JSON body parsed (orjson, json as the fallback), its nested lists of
numbers checked and made tensors, and an answer's JSON written. service.api.codecs decodes the
JSON routes' requests with these and checks an answer is finite before it is written.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import orjson
import torch

from service.errors import InvalidInput


def json_bytes(doc: dict) -> bytes:
    """An answer's JSON (finite numbers only: codecs' `_json_finite`), written by orjson; a request id that
    json read but orjson cannot write (a lone surrogate, "\\ud800") is echoed by json, escaped, as before."""
    try:
        return orjson.dumps(doc)
    except orjson.JSONEncodeError:
        return json.dumps(doc).encode()


def json_object(body: bytes | memoryview) -> dict:
    """A request's JSON body (an object), parsed by orjson (~5x faster than json, which holds the
    GIL and so every other client of the front end). What orjson refuses but json reads (NaN and
    Infinity literals, numbers past a double, UTF-16/32 or a BOM, lone surrogates) or names better
    (nesting too deep) is parsed again by json, so such a body gets the answer it got before:
    accepted or refused with the same message (a NaN as "contains NaN or infinity (row r)", a
    value, not a parse error)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            doc = json.loads(bytes(body))
        except (UnicodeDecodeError, ValueError) as e:
            raise InvalidInput(f"malformed JSON: {e}") from None
        except RecursionError:
            raise InvalidInput("malformed JSON: arrays or objects nested too deeply") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the JSON body must be an object")
    return doc


def json_array(data, name: str, np_dtype, range_name: str | None = None) -> torch.Tensor:
    """Nested JSON lists of numbers -> a tensor; np_dtype None means integers are required. A finite
    value past np_dtype's range is refused naming `range_name` (default: np_dtype's numpy name).

    Parsed without a dtype: np.asarray(["1.5", true], dtype=float32) would accept both. One
    C-level pass over the leaves' types then catches strings, null and booleans (which numpy
    would fold into a numeric array when mixed with numbers).
    """
    try:
        arr = np.asarray(data)
        types = _leaf_types(data, arr.ndim)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise InvalidInput(f"{name} must be a rectangular array of numbers") from None
    odd = types - _NUMBER_TYPES
    if odd:
        what = ", ".join(sorted(_JSON_NAMES.get(t, t.__name__) for t in odd))
        raise InvalidInput(f"{name} must be a rectangular array of numbers; it holds {what}")
    if arr.dtype == object:  # integers past 64 bits
        if np_dtype is None:
            raise InvalidInput(f"{name} has values outside the int64 range")
        try:
            arr = np.asarray(data, dtype=np.float64)
        except OverflowError:
            raise InvalidInput(f"{name} has integers too large for a float") from None
    if np_dtype is None:
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            if arr.dtype.kind == "f" and _past_int64(arr):  # orjson reads an integer past 64 bits as a float
                raise InvalidInput(f"{name} has values outside the int64 range")
            raise InvalidInput(f"{name} must hold integers")
        if arr.dtype != np.int64:
            try:
                arr = arr.astype(np.int64, casting="safe")
            except TypeError:
                raise InvalidInput(f"{name} has values outside the int64 range") from None
    else:
        try:  # a finite value past np_dtype's range (an infinity or NaN as sent is the later check's)
            with np.errstate(over="raise"):
                arr = arr.astype(np_dtype)
        except FloatingPointError:
            raise InvalidInput(f"{name} has values outside the range of {range_name or np.dtype(np_dtype).name}") \
                from None
    return torch.from_numpy(np.ascontiguousarray(arr))


def echoed(value) -> str:
    """A JSON header value as an error message shows it (its repr). orjson reads an integer of 2^64
    or more, or below -2^63, as a float (18446744073709551616 as 1.8446744073709552e+19; -2^63 - 1,
    rounded, as -2.0^63), so such a float is shown by its size ("a number of 2^64 or more"), true
    whichever the client wrote: a "must be an integer" is never answered with a float the client did
    not send. Lists (a shape) are echoed item by item."""
    if isinstance(value, list):
        return "[" + ", ".join(map(echoed, value)) + "]"
    if past_64_bits(value):
        return "a number of 2^64 or more" if value > 0 else "a number of -2^63 or less"
    return repr(value)


def below_2_64(value) -> str:
    """" below 2^64" where a header's integer was past 64 bits (see `echoed`), for a message that says
    what a size or offset must be: the client sent a non-negative integer and reads why it was refused."""
    return " below 2^64" if past_64_bits(value) and value > 0 else ""


def past_64_bits(value) -> bool:
    """Whether a parsed JSON value is orjson's float for an integer past 64 bits (see `echoed`)."""
    return isinstance(value, float) and math.isfinite(value) and (value >= 2.0**64 or value <= -(2.0**63))


def _past_int64(arr: np.ndarray) -> bool:
    """Whether the float array holds a finite value outside the int64 range (a double that large is
    a whole number)."""
    with np.errstate(invalid="ignore"):
        return bool(np.any(np.isfinite(arr) & (np.abs(arr) >= 2.0**63)))


_NUMBER_TYPES = frozenset((int, float))  # what json.loads (and orjson) makes of a JSON number
_JSON_NAMES = {bool: "true/false", str: "strings", type(None): "null", dict: "objects", list: "nested lists"}


def _leaf_types(data, ndim: int) -> set[type]:
    """The Python types of the leaves of a rectangular nested list `ndim` deep (one C-level pass)."""
    if ndim == 0:
        return {type(data)}
    leaves = data
    for _ in range(ndim - 1):
        leaves = itertools.chain.from_iterable(leaves)
    return set(map(type, leaves))
