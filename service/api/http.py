"""The HTTP front end (FastAPI): /moe/forward, the Open Inference Protocol v2 routes, /metrics; the
inference routes are dispatched ahead of FastAPI's stack (`InferenceFirst`).

Bodies are read raw and decoded by `service.api.codecs` (no pydantic models: a [T, H] tensor
as a pydantic list of lists would cost far more than the layer). Every error leaves through
`error_response`, which asks `service.api.error_map` for the code. Bodies must arrive within the
request's deadline (408 otherwise); a client that disconnects mid-body, or while it waits for its
answer (`unless_gone`), is a 499, not an error.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import choose_encoder
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.api import codecs, json_codec
from service.api.connections import BODY, FIRST_BYTE, HEADER_LENGTH, WRITER
from service.api.error_map import (
    RETRY_AFTER_S,
    BodyTimeout,
    ClientGone,
    PayloadTooLarge,
    UnsupportedMediaType,
    classify,
    message,
)
from service.api.frontend import Frontend
from service.api.regions import cuda_register, cuda_status
from service.errors import DeadlineExceeded, InvalidInput, MoEError

log = logging.getLogger(__name__)

JSON = "application/json"
SAFETENSORS = "application/x-safetensors"
OCTET_STREAM = "application/octet-stream"
TIMEOUT_HEADER = "x-request-timeout"
REGISTER_BODY_LIMIT = 4096  # bytes of a shared-memory register request ({"key", "offset", "byte_size"})
T = TypeVar("T")


class PartsResponse(Response):
    """A response whose body is sent as several parts (bytes-like: the answer tensor's memory is
    sent as it is, never joined into one bytes object); `sent(seconds)` is called with the time
    from its start to its last part in the kernel or the transport's buffer (a large part is sent
    by a thread: service.api.send_thread)."""

    def __init__(self, parts: list, media_type: str, headers: dict | None = None,
                 sent: Callable[[float], None] | None = None):
        self.parts, self.sent = parts, sent
        super().__init__(b"", media_type=media_type, headers=headers)
        self.headers["content-length"] = str(sum(len(p) for p in parts))

    async def __call__(self, scope, receive, send) -> None:
        started = time.perf_counter()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i + 1 < len(self.parts)})
        if self.sent is not None:
            sent = self.sent
            writer = scope.get(WRITER)
            if writer is None:  # (an h11 request pipelined behind another)
                sent(time.perf_counter() - started)
            else:
                writer.when_written(lambda at: sent(at - started))


def error_response(exc: BaseException) -> JSONResponse:
    status, _ = classify(exc)
    if status == 500:  # a bug of ours; 503/504 are expected states, logged where they arise
        log.error("request failed: %s", exc, exc_info=True)
    elif isinstance(exc, ClientGone):
        log.debug("%s", exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    if isinstance(exc, (BodyTimeout, PayloadTooLarge)):
        # Answered before (all of) the body was read: what is left of it would be parsed as the next
        # request on a kept-alive connection (400 "Invalid HTTP request"). uvicorn closes the connection
        # after a response that says so, on either parser.
        headers = {"Connection": "close"}
    return JSONResponse({"error": message(exc)}, status_code=status, headers=headers)


def _media_type(request: Request) -> str | None:
    value = request.headers.get("content-type")
    return value.split(";", 1)[0].strip().lower() if value else None


# A body gets at least this long to arrive, whatever the request's deadline: a deadline shorter than
# the body's transfer is the work's 504 (checked once the body is in), not a slow client's 408.
MIN_BODY_TIMEOUT_S = 1.0


# Content-Encoding -> zlib's wbits: gzip's framing, or zlib's (HTTP's "deflate" is the zlib format,
# RFC 9110 8.4.1.2, as tritonclient's request_compression_algorithm="deflate" sends it).
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
INFLATE_PIECE = 1 << 20  # bytes of output per zlib call: a body past the limit stops within one piece
# A compressed body may grow to at most this many times its size (and to INFLATE_FLOOR whatever its
# size): real bodies shrink little (random fp32 rows to ~92 %, JSON numbers ~2-3x), while a few KiB
# of zip bomb just under --max-request-bytes would make each of many concurrent requests hold
# megabytes that no client sent (a review: 24 bombs of 64 KB held 2 GiB).
MAX_INFLATE_RATIO = 32
INFLATE_FLOOR = 1 << 20


def deadline_left(request: Request, timeout_s: float) -> float:
    """What is left of the request's deadline of `timeout_s` seconds, counted from its first byte
    (connections.FIRST_BYTE, where its books start): its body's arrival and decoding spend it, so a
    client's X-Request-Timeout bounds its wait for the answer. DeadlineExceeded (504) when nothing is
    left: a body given MIN_BODY_TIMEOUT_S to arrive that took longer than a shorter deadline."""
    first_byte = request.scope.get(FIRST_BYTE)
    spent = 0.0 if first_byte is None else time.perf_counter() - first_byte
    if spent >= timeout_s:
        raise DeadlineExceeded(f"the request's deadline of {timeout_s:g} s passed before it was queued ({spent:.3g} s "
                               "after its first byte: its body's arrival and decoding)")
    return timeout_s - spent


def inflate(chunks: list[bytes], encoding: str, limit: int) -> list[bytes]:
    """A compressed body, decompressed as it streams (in pieces of at most INFLATE_PIECE bytes), and
    refused (413) as soon as its output passes `limit` or MAX_INFLATE_RATIO times the compressed size
    (at least INFLATE_FLOOR): a zip bomb costs at most that + INFLATE_PIECE bytes of memory and the
    time to produce them, never its full size. Each compressed chunk is dropped from `chunks` once
    decompressed."""
    compressed = sum(len(c) for c in chunks)
    ratio_limit = max(INFLATE_FLOOR, MAX_INFLATE_RATIO * compressed)
    stream = zlib.decompressobj(ENCODINGS[encoding])
    out: list[bytes] = []
    size = 0

    def take(data: bytes) -> None:
        nonlocal size
        while True:
            piece = stream.decompress(data, INFLATE_PIECE)
            size += len(piece)
            if size > limit:
                raise PayloadTooLarge(f"the {encoding} body decompresses to over the limit of {limit} bytes "
                                      "(max_request_bytes)")
            if size > ratio_limit:
                raise PayloadTooLarge(f"the {encoding} body of {compressed} bytes decompresses to over "
                                      f"{ratio_limit} bytes ({MAX_INFLATE_RATIO} times its size): send it "
                                      "uncompressed")
            if piece:
                out.append(piece)
            data = stream.unconsumed_tail
            if not data and (len(piece) < INFLATE_PIECE or stream.eof):  # all in, nothing pending
                return

    rest: list[bytes] = []  # chunks after the stream's end
    try:
        for i, chunk in enumerate(chunks):
            take(chunk)
            chunks[i] = b""  # (its bytes are in `out` now)
            if stream.eof:
                rest = chunks[i + 1:]
                break
    except zlib.error as e:
        raise InvalidInput(f"the body is not valid {encoding} data (Content-Encoding): {e}") from None
    if not stream.eof:
        raise InvalidInput(f"the {encoding} body ends before its compressed stream does (truncated)")
    if stream.unused_data or any(len(c) for c in rest):
        raise InvalidInput(f"the {encoding} body has bytes after the end of its compressed stream")
    return out


def _content_encoding(request: Request) -> str | None:
    """The body's Content-Encoding (a key of ENCODINGS), None when it is sent as it is; 415 for others."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "identity":
        return None
    if encoding not in ENCODINGS:
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; send the body uncompressed "
                                   "or as gzip or deflate")
    return encoding


async def read_body(request: Request, limit: int, timeout_s: float) -> list[bytes]:
    """The body as the chunks it arrived in (the decoders join them, off the event loop for a large
    body), refusing (413) anything over `limit` bytes before reading it all and (408) a body that
    takes longer than `timeout_s` (at least MIN_BODY_TIMEOUT_S) to arrive. A gzip or deflate body
    (Content-Encoding) is decompressed in a worker thread, the same `limit` applying to its
    decompressed size (`inflate`)."""
    timeout_s = max(timeout_s, MIN_BODY_TIMEOUT_S)
    encoding = _content_encoding(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body has {declared} bytes, over the limit of {limit} (max_request_bytes)")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if not len(chunk):  # Starlette's stream ends with an empty chunk: one chunk stays unjoined
                    continue
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"the body is over the limit of {limit} bytes (max_request_bytes)")
    except TimeoutError:
        direct = request.scope.get(BODY)  # read into one buffer: it reaches the stream only once it is all in
        size = max(size, direct.filled if direct is not None else 0)
        raise BodyTimeout(f"the body did not arrive within {timeout_s:g} s ({size} bytes read)") from None
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after {size} bytes of the body") from None
    if encoding is not None:
        return await asyncio.to_thread(inflate, chunks, encoding, limit)
    return chunks


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (the request's answer; its body is read) unless the client disconnects first:
    then `work` is cancelled, which drops the request's rows that no step has taken yet (as a gRPC
    cancel does), and ClientGone (499) is raised. Without this an abandoned request is computed in
    full, its 200 counted, and under load its queued rows delay everyone behind them. Costs one task
    per request, which waits in receive() for the disconnect (ASGI: the next message after the body)."""
    task = asyncio.current_task()
    assert task is not None
    watch = asyncio.get_running_loop().create_task(_cancel_when_gone(request, task))
    try:
        return await work
    except asyncio.CancelledError:
        # The watch's cancel (it returned), not the server's own (which also counts on the task)
        if watch.done() and not watch.cancelled() and watch.exception() is None and task.uncancel() == 0:
            raise ClientGone("the client disconnected before its answer") from None
        raise
    finally:
        watch.cancel()


async def _cancel_when_gone(request: Request, task: asyncio.Task) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass  # (nothing else comes once the body is read; each receive() waits for the next message)
    task.cancel()


def create_app(fe: Frontend) -> InferenceFirst:
    app = FastAPI(title="moe-serve", description="A Mixture-of-Experts layer as a service",
                  docs_url=None, redoc_url=None)
    limit = fe.settings.max_request_bytes

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    # Our own errors (a 404 on a model route, ...) are answered here. A handler for Exception sits
    # in Starlette's outermost middleware, which answers and then re-raises (uvicorn logs a
    # traceback): it is kept only for bugs.
    @app.exception_handler(MoEError)
    async def _service_error(request: Request, exc: MoEError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    def received(protocol: str, request: Request) -> None:
        """The body is in: its receive time, from the request's first byte, goes to the books."""
        first_byte = request.scope.get(FIRST_BYTE)
        if first_byte is not None:
            fe.metrics.request_receive.labels(protocol).observe(time.perf_counter() - first_byte)

    async def answer(protocol: str, request: Request, handle) -> Response:
        """Run one inference handler; every outcome is counted under its status code, timed from the
        request's first byte where the connection saw it (service.api.connections.FIRST_BYTE)."""
        started = request.scope.get(FIRST_BYTE) or time.perf_counter()
        try:
            response = await handle()
        except Exception as exc:  # noqa: BLE001  mapped to a status in one place
            response = error_response(exc)
            # Its traceback holds the handler's frames, and so the request's tensors (a wire arena block),
            # in a cycle only the collector frees (the batcher's _step does the same)
            exc.__traceback__ = None
        fe.observe(protocol, response.status_code, started)
        return response

    # ---- /moe/forward ----------------------------------------------------------------------

    @app.post("/moe/forward")
    async def forward(request: Request) -> Response:
        media = _media_type(request)
        protocol = "http_safetensors" if media == SAFETENSORS else "http_json"

        async def handle() -> Response:
            if media not in (JSON, SAFETENSORS):
                raise UnsupportedMediaType(f"Content-Type must be {JSON} or {SAFETENSORS}, got {media!r}")
            timeout = (codecs.parse_timeout_s(request.headers.get(TIMEOUT_HEADER), "X-Request-Timeout")
                       or fe.settings.request_timeout_s)
            body = await read_body(request, limit, timeout)
            received(protocol, request)
            decode = codecs.decode_safetensors if media == SAFETENSORS else codecs.decode_forward_json
            req = await fe.offload(codecs.forward_decode_work(body, media == JSON), decode, body, fe.spec)
            req.timeout_s = deadline_left(request, timeout)
            out = await unless_gone(request, fe.infer(req))
            assert isinstance(out, torch.Tensor)  # (no shared memory on /moe/forward)
            if media == SAFETENSORS:
                return Response(await fe.offload(out.numel(), codecs.encode_safetensors, out),
                                media_type=SAFETENSORS)
            return Response(await fe.offload(out.numel() * codecs.JSON_NUMBER_WORK, codecs.encode_forward_json, out),
                            media_type=JSON)

        return await answer(protocol, request, handle)

    # ---- Open Inference Protocol v2 --------------------------------------------------------

    @app.get("/v2")
    async def server_metadata() -> dict:
        return fe.server_metadata()

    # Health and readiness also answer HEAD (a load balancer's check, e.g. HAProxy's
    # `option httpchk HEAD ...`): the same status, no body (uvicorn drops it for HEAD).
    @app.api_route("/v2/health/live", methods=["GET", "HEAD"])
    async def live() -> dict:
        return {"live": True}

    @app.api_route("/v2/health/ready", methods=["GET", "HEAD"])
    async def ready() -> JSONResponse:
        return JSONResponse({"ready": fe.ready}, status_code=200 if fe.ready else 503)

    def model_document(suffix: str, document) -> None:
        """GET /v2/models/{model}[/versions/{version}]{suffix}: `document()` once the name checks out."""
        async def route(model: str, version: str | None = None) -> Response:
            codecs.check_model(model, version, fe.model_name)
            doc = document()
            return JSONResponse(await doc if inspect.isawaitable(doc) else doc)

        for path in (f"/v2/models/{{model}}{suffix}", f"/v2/models/{{model}}/versions/{{version}}{suffix}"):
            app.get(path, name=document.__name__)(route)

    # Every model's statistics (tritonclient's get_inference_statistics() with no model name): ours.
    # Declared before the model routes, which would read "stats" as a model name.
    @app.get("/v2/models/stats")
    async def all_statistics() -> Response:
        return JSONResponse(await fe.model_statistics())

    model_document("", fe.model_metadata)
    model_document("/config", fe.model_config)       # Triton's model configuration extension
    model_document("/stats", fe.model_statistics)    # Triton's statistics extension

    @app.api_route("/v2/models/{model}/ready", methods=["GET", "HEAD"])
    @app.api_route("/v2/models/{model}/versions/{version}/ready", methods=["GET", "HEAD"])
    async def model_ready(model: str, version: str | None = None) -> Response:
        codecs.check_model(model, version, fe.model_name)
        return JSONResponse({"name": model, "ready": fe.ready}, status_code=200 if fe.ready else 503)

    @app.post("/v2/models/{model}/infer")
    @app.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str | None = None) -> Response:
        header_length = request.headers.get(HEADER_LENGTH)
        protocol = "v2_json" if header_length is None else "v2_binary"

        async def handle() -> Response:
            codecs.check_model(model, version, fe.model_name)
            media = _media_type(request)
            if media not in (None, JSON, OCTET_STREAM):
                raise UnsupportedMediaType(f"Content-Type must be {JSON} or {OCTET_STREAM}, got {media!r}")
            timeout = codecs.parse_timeout_s(request.headers.get(TIMEOUT_HEADER), "X-Request-Timeout")
            body = await read_body(request, limit, timeout or fe.settings.request_timeout_s)
            received(protocol, request)
            work = codecs.v2_http_decode_work(body, header_length)
            req = await fe.offload(work, codecs.decode_v2_http, body, header_length, fe.spec, fe.regions)
            req.timeout_s = deadline_left(request, timeout or req.timeout_s or fe.settings.request_timeout_s)
            out = await unless_gone(request, fe.infer(req, out=fe.answer_rows(req)))  # (the arena's rows, if any)
            # Binary output is a JSON header and a view of `out`: nothing worth a thread hop.
            work = 0 if req.binary_output or req.out_region is not None else out.shape.numel() * codecs.JSON_NUMBER_WORK
            parts, json_length = await fe.offload(work, codecs.encode_v2_http, out, req, fe.model_name)
            sent = fe.metrics.response_send.labels(protocol).observe
            if json_length is None:
                return PartsResponse(parts, media_type=JSON, sent=sent)
            return PartsResponse(parts, media_type=OCTET_STREAM, sent=sent,
                                 headers={"Inference-Header-Content-Length": str(json_length)})

        return await answer(protocol, request, handle)

    # ---- Triton's system shared-memory extension (service.api.regions) ---------------------

    @app.get("/v2/systemsharedmemory/status")
    @app.get("/v2/systemsharedmemory/region/{name}/status")
    async def shm_status(name: str = "") -> Response:
        try:
            return JSONResponse(fe.shared_memory().status(name))
        except Exception as exc:  # noqa: BLE001  mapped to a status in one place
            return error_response(exc)

    @app.post("/v2/systemsharedmemory/region/{name}/register")
    async def shm_register(name: str, request: Request) -> Response:
        try:
            regions = fe.shared_memory()
            body = await read_body(request, REGISTER_BODY_LIMIT, fe.settings.request_timeout_s)
            doc = json_codec.json_object(codecs.join_chunks(body))
            unknown = sorted(set(doc) - {"key", "offset", "byte_size"})
            if unknown or "key" not in doc or "byte_size" not in doc:
                raise InvalidInput(f"a register request is {{\"key\", \"offset\", \"byte_size\"}}; got the keys "
                                   f"{sorted(doc)}")
            regions.register(name, doc["key"], doc.get("offset", 0), doc["byte_size"])
            return Response(b"", media_type=JSON)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    @app.post("/v2/systemsharedmemory/unregister")
    @app.post("/v2/systemsharedmemory/region/{name}/unregister")
    async def shm_unregister(name: str = "") -> Response:
        try:
            fe.shared_memory().unregister(name)
            return Response(b"", media_type=JSON)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    # ---- Triton's CUDA shared-memory extension: no region ever (service.api.regions) ------

    @app.get("/v2/cudasharedmemory/status")
    @app.get("/v2/cudasharedmemory/region/{name}/status")
    async def cuda_shm_status(name: str = "") -> Response:
        try:
            return JSONResponse(cuda_status(name))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    @app.post("/v2/cudasharedmemory/region/{name}/register")
    async def cuda_shm_register(name: str) -> Response:
        try:
            cuda_register(name)  # refused, always
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    @app.post("/v2/cudasharedmemory/unregister")
    @app.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_shm_unregister(name: str = "") -> Response:
        return Response(b"", media_type=JSON)  # nothing is registered: nothing to remove

    # ---- Triton's model repository extension: the index; no load or unload ----------------

    @app.post("/v2/repository/index")
    async def repository_index(request: Request) -> Response:
        try:
            chunks = await read_body(request, REGISTER_BODY_LIMIT, fe.settings.request_timeout_s)
            body = bytes(codecs.join_chunks(chunks))
            doc = json_codec.json_object(body) if body.strip() else {}  # tritonclient sends no body
            unknown = sorted(set(doc) - {"ready"})
            if unknown or not isinstance(doc.get("ready", False), bool):
                raise InvalidInput(f'an index request is {{"ready": true|false}} or empty; got {doc!r}')
            return JSONResponse(fe.repository_index(doc.get("ready", False)))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    @app.post("/v2/repository/models/{model}/load")
    @app.post("/v2/repository/models/{model}/unload")
    async def repository_control(model: str) -> Response:
        try:
            fe.refuse_model_control(model)  # (always raises: gRPC's RepositoryModelLoad/Unload refuse alike)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    # ---- metrics ---------------------------------------------------------------------------

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # OpenMetrics for scrapers that ask for it (Accept), the Prometheus text format otherwise
        encode, media_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(await fe.aggregate()), media_type=media_type)

    return InferenceFirst(app, forward, infer)


# The v2 inference routes' paths ({model} and {version} as Starlette's str convertor matches them: one
# path segment, at least one character)
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class InferenceFirst:
    """The ASGI app the server runs: POST /moe/forward and POST /v2/models/{model}[/versions/{version}]/infer
    go straight to their handlers; every other request (and these paths under a root_path) goes
    through `app` (FastAPI; kept as `.app`). FastAPI's stack (its middlewares, the route scan, the
    dependency solver) took 106 us of the event loop per v2 request on a 2-core VM before the handler's
    first line, against 6 us here (bench/http_dispatch.py; bench/NOTES.md, nineteenth session). What
    the stack gave these routes, they do themselves: `answer` turns any exception of the work into its
    status (the fallback below covers the two lines outside it), and read_body enforces
    max_request_bytes. The routes stay declared on `app` (405 for other methods, the same names)."""

    def __init__(self, app: FastAPI, forward, infer):
        self.app, self._forward, self._infer = app, forward, infer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            path = scope["path"]
            match = None if path == "/moe/forward" else _INFER_PATH.fullmatch(path)
            if path == "/moe/forward" or match is not None:
                request = Request(scope, receive, send)
                try:
                    response = await (self._forward(request) if match is None
                                      else self._infer(match[1], request, match[2]))
                except Exception as exc:  # noqa: BLE001  (what FastAPI's exception handlers did)
                    response = error_response(exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
