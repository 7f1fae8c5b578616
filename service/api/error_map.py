"""Exceptions -> HTTP status and gRPC code, in one place.

Every handler of `service.api` lets exceptions propagate to one of two funnels
(`http.error_response`, `grpc._failure`) which ask this module for the code. Bad input is
always a 4xx / INVALID_ARGUMENT (or NOT_FOUND for an unknown model); a client that goes away
mid-request is 499 (nginx's "client closed request"; nobody reads it, the metrics count it);
overload, a missing or
failed rank group and draining are 503 / UNAVAILABLE (clients retry these); a deadline is
504 / DEADLINE_EXCEEDED; anything else is a bug of ours and the only path to 500 / INTERNAL.
"""

from __future__ import annotations

import grpc

from service.errors import DeadlineExceeded, GroupUnavailable, InvalidInput, MoEError, Overloaded, WorkerError


class UnsupportedMediaType(InvalidInput):
    """A Content-Type (or Content-Encoding) the route does not speak."""


class PayloadTooLarge(InvalidInput):
    """A body over max_request_bytes, or more tokens than the queue can ever hold."""


class ModelNotFound(InvalidInput):
    """A model name (or version) this server does not serve."""


class BodyTimeout(InvalidInput):
    """The request body did not arrive within the request's deadline (a slow or stalled client)."""


class SharedMemoryOff(InvalidInput):
    """A shared-memory call (register, status, unregister, or a tensor in a region) while the
    `shared_memory` setting is off."""


class CudaSharedMemoryUnsupported(InvalidInput):
    """A CUDA shared-memory register call: the server reads no GPU memory of its clients."""


class RegionNotFound(InvalidInput):
    """A shared-memory region name that is not registered."""


class RegionExists(InvalidInput):
    """A register call for a region name that is registered already."""


class TooManyRegions(InvalidInput):
    """A register call past the cap on registered regions (service.api.regions.MAX_REGIONS)."""


class ModelControlUnsupported(InvalidInput):
    """A model repository load or unload call: the one model is loaded at start, for good."""


class RepositoryNameUnsupported(InvalidInput):
    """A model repository call that names a repository (gRPC's `repository_name`): there is none."""


class ClientGone(MoEError):
    """The client closed the connection before its request was read."""


RETRY_AFTER_S = 1  # Retry-After on 503s: about one restart back-off

# Most specific class first: the first isinstance match wins.
_TABLE: tuple[tuple[type[BaseException], int, grpc.StatusCode], ...] = (
    (UnsupportedMediaType, 415, grpc.StatusCode.INVALID_ARGUMENT),
    (PayloadTooLarge, 413, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound, 404, grpc.StatusCode.NOT_FOUND),
    (BodyTimeout, 408, grpc.StatusCode.DEADLINE_EXCEEDED),
    (SharedMemoryOff, 400, grpc.StatusCode.FAILED_PRECONDITION),
    (CudaSharedMemoryUnsupported, 400, grpc.StatusCode.UNIMPLEMENTED),  # Triton's UNSUPPORTED
    # Triton (--model-control-mode none or poll) answers UNAVAILABLE, which clients and gRPC retry
    # policies retry: this refusal is for good, a state of the server, hence FAILED_PRECONDITION.
    (ModelControlUnsupported, 400, grpc.StatusCode.FAILED_PRECONDITION),
    (RepositoryNameUnsupported, 400, grpc.StatusCode.UNIMPLEMENTED),  # Triton's UNSUPPORTED
    (RegionNotFound, 404, grpc.StatusCode.NOT_FOUND),
    (RegionExists, 409, grpc.StatusCode.ALREADY_EXISTS),
    (TooManyRegions, 400, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidInput, 400, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, 503, grpc.StatusCode.UNAVAILABLE),
    (GroupUnavailable, 503, grpc.StatusCode.UNAVAILABLE),
    (WorkerError, 503, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ClientGone, 499, grpc.StatusCode.CANCELLED),
)


def classify(exc: BaseException) -> tuple[int, grpc.StatusCode]:
    """The HTTP status and gRPC code for an exception raised while answering a request."""
    for cls, status, code in _TABLE:
        if isinstance(exc, cls):
            return status, code
    return 500, grpc.StatusCode.INTERNAL


def message(exc: BaseException) -> str:
    """The text the client sees. Rank tracebacks stay in the server log."""
    if isinstance(exc, WorkerError):
        return f"the rank group failed ({exc.args[0] if exc.args else 'no detail'}); retry shortly"
    if isinstance(exc, MoEError):
        return str(exc)
    return f"internal error: {type(exc).__name__}"
