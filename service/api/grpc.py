"""The gRPC front end: inference.GRPCInferenceService (Open Inference Protocol), grpc.health.v1
and server reflection, on grpc.aio in the same event loop as HTTP.

ModelInfer answers in `raw_output_contents`. It has its own (de)serializers
(grpc_codec.parse_grpc_request, grpc_codec.serialize_grpc_response): the tensors' bytes are viewed
in the received message, and the response's bytes are made before the step with room for the
answer, which the batcher copies out of the slot straight into them (grpc_codec.grpc_response),
instead of protobuf copying every blob on the way in and on the way out. With a wire arena both the
received message and the response lie in it (service.api.arena_objects), and the ranks read the
rows and write the answer there themselves.
The deadline is the smallest of the client's gRPC deadline, the request's `timeout` parameter
(microseconds) and the server default. Every error is mapped by `_failure`, which asks
`service.api.error_map` for the code, and the call fails through `_reject`: set code and
details, return nothing. Never `context.abort()`: it raises, and
grpc.aio keeps that exception in a reference cycle with the call's coroutine frames, and so the
request, until a full gc pass (measured: 12 refused 48 MiB messages held 634 MiB).
A message that does not parse is INVALID_ARGUMENT (`LenientParsing`), not grpc's UNKNOWN.
A call that ends without our answer (grpc cancels the handler: the client cancelled, or its deadline
passed) is counted 499, or 504 past the deadline; its rows no step has taken are dropped. A call
that grpc ends before the handler starts is never seen here. An answer ready after the deadline is
not sent (grpc has already ended the call); one whose deadline passes while grpc sends it still
makes grpc log the failed send (ExecuteBatchError), which no handler can prevent.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf import descriptor_pool, json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from service.api import codecs, grpc_codec
from service.api.address import bind_error, grpc_port_taken, host_port
from service.api.error_map import ClientGone, classify, message
from service.api.frontend import Frontend
from service.api.proto import grpc_predict_v2_pb2 as pb
from service.api.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from service.api.regions import cuda_register, cuda_status
from service.errors import DeadlineExceeded

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MAX_STREAMS = 64             # concurrent calls per connection (HTTP/2 streams)
KEEPALIVE_MS = 60_000        # ping a connection that has been silent this long
KEEPALIVE_TIMEOUT_MS = 20_000  # and close it if the ping is not answered within this


def _failure(exc: BaseException) -> tuple[int, grpc.StatusCode, str]:
    """HTTP-style status, gRPC code and message for an error."""
    status, code = classify(exc)
    if status == 500:  # a bug of ours; 503/504 are expected states, logged where they arise
        log.error("gRPC request failed: %s", exc, exc_info=True)
    return status, code, message(exc)


def _past_deadline(context: grpc.aio.ServicerContext) -> bool:
    left = context.time_remaining()
    return left is not None and left <= 0


def _gone_status(context: grpc.aio.ServicerContext) -> int:
    """The books' status of a call that ended without our answer: 504 past its deadline, else 499
    (ClientGone's: the client cancelled)."""
    return classify(DeadlineExceeded("") if _past_deadline(context) else ClientGone(""))[0]


def _reject(context: grpc.aio.ServicerContext, code: grpc.StatusCode, text: str) -> None:
    """Fail the call without raising (see the module docstring); the handler then returns None."""
    context.set_code(code)
    context.set_details(text)


class _Malformed:
    """What LenientParsing hands the servicer in place of a message that did not parse."""

    def __init__(self, error: str):
        self.error = error


class LenientParsing(grpc.aio.ServerInterceptor):
    """Parse unary requests ourselves: bytes that are not the method's message get INVALID_ARGUMENT
    with the parser's reason (grpc answers a failed deserializer with UNKNOWN and logs it)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary

        def lenient(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001  protobuf's DecodeError and others
                return _Malformed(f"malformed {handler_call_details.method} request: {exc}")

        async def checked(request, context):
            if isinstance(request, _Malformed):
                return _reject(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)
            return await behavior(request, context)

        return handler._replace(request_deserializer=lenient, unary_unary=checked)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, fe: Frontend):
        self.fe = fe

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.fe.ready)

    def _known_model(self, context, name: str, version: str) -> bool:
        """True if `name` (with no version or MODEL_VERSION) is the served model; else the call is
        rejected (NOT_FOUND)."""
        try:
            codecs.check_model(name, version, self.fe.model_name)
        except Exception as exc:  # noqa: BLE001
            _reject(context, *_failure(exc)[1:])
            return False
        return True

    async def ModelReady(self, request, context):
        if not self._known_model(context, request.name, request.version):
            return None
        return pb.ModelReadyResponse(ready=self.fe.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**self.fe.server_metadata())

    async def ModelMetadata(self, request, context):
        if not self._known_model(context, request.name, request.version):
            return None
        meta = self.fe.model_metadata()
        response = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
        for field in ("inputs", "outputs"):
            for t in meta[field]:
                getattr(response, field).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return response

    async def ModelConfig(self, request, context):
        if not self._known_model(context, request.name, request.version):
            return None
        return pb.ModelConfigResponse(config=json_format.ParseDict(self.fe.model_config(), pb.ModelConfig()))

    async def ModelStatistics(self, request, context):
        # An empty name asks for every model: ours.
        if (request.name or request.version) and not self._known_model(context, request.name, request.version):
            return None
        return json_format.ParseDict(await self.fe.model_statistics(), pb.ModelStatisticsResponse())

    async def ModelInfer(self, request, context):
        fe = self.fe
        started = time.perf_counter()
        if isinstance(request, grpc_codec.GrpcInferRequest):  # timed from the deserializer's start
            fe.metrics.request_receive.labels("grpc").observe(started - request.received)
            started = request.received
        try:
            message = request.message if isinstance(request, grpc_codec.GrpcInferRequest) else request
            codecs.check_model(message.model_name, message.model_version, fe.model_name)
            req = await fe.offload(grpc_codec.grpc_decode_work(request), grpc_codec.decode_grpc, request, fe.spec,
                                   fe.regions)
            response = grpc_codec.grpc_response(req, fe.model_name)  # the answer's rows are written into it
            await fe.infer(req, transport_timeout_s=context.time_remaining(), out=response.out)
        except asyncio.CancelledError:  # grpc cancels the handler: the client cancelled, or its deadline passed
            fe.observe("grpc", _gone_status(context), started)
            raise
        except Exception as exc:  # noqa: BLE001  mapped to a code in one place
            status, code, text = _failure(exc)
            fe.observe("grpc", status, started)
            return _reject(context, code, text)
        if _past_deadline(context):
            # The answer came as the deadline passed: grpc has already ended the call (DEADLINE_EXCEEDED to
            # the client), so sending fails, and grpc logs that failure as an error with a traceback.
            # Ending the handler as grpc's own cancel does leaves one debug line.
            fe.observe("grpc", _gone_status(context), started)
            raise asyncio.CancelledError
        fe.observe("grpc", 200, started)
        return response

    # ---- Triton's system shared-memory extension (service.api.regions) ---------------------

    async def SystemSharedMemoryStatus(self, request, context):
        try:
            regions = self.fe.shared_memory().status(request.name)
        except Exception as exc:  # noqa: BLE001
            return _reject(context, *_failure(exc)[1:])
        response = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**r))
        return response

    async def SystemSharedMemoryRegister(self, request, context):
        try:
            self.fe.shared_memory().register(request.name, request.key, request.offset, request.byte_size)
        except Exception as exc:  # noqa: BLE001
            return _reject(context, *_failure(exc)[1:])
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        try:
            self.fe.shared_memory().unregister(request.name)
        except Exception as exc:  # noqa: BLE001
            return _reject(context, *_failure(exc)[1:])
        return pb.SystemSharedMemoryUnregisterResponse()


    # ---- Triton's CUDA shared-memory extension: no region ever (service.api.regions) ------

    async def CudaSharedMemoryStatus(self, request, context):
        try:
            cuda_status(request.name)
        except Exception as exc:  # noqa: BLE001
            return _reject(context, *_failure(exc)[1:])
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        try:
            cuda_register(request.name)  # refused, always
        except Exception as exc:  # noqa: BLE001
            return _reject(context, *_failure(exc)[1:])

    async def CudaSharedMemoryUnregister(self, request, context):
        return pb.CudaSharedMemoryUnregisterResponse()  # nothing is registered: nothing to remove

    # ---- Triton's model repository extension: the index; no load or unload (Frontend) -------

    async def RepositoryIndex(self, request, context):
        try:
            models = self.fe.repository_index(request.ready, request.repository_name)
        except Exception as exc:  # noqa: BLE001
            return _reject(context, *_failure(exc)[1:])
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in models])

    async def RepositoryModelLoad(self, request, context):
        try:
            self.fe.refuse_model_control(request.model_name, request.repository_name)
        except Exception as exc:  # noqa: BLE001  always: the model is loaded at start
            return _reject(context, *_failure(exc)[1:])

    RepositoryModelUnload = RepositoryModelLoad  # (refused alike: the two requests have the same fields)


class _Handlers:
    """Records what the generated add_..._to_server registers, so that one method can be swapped."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


async def _stream_refused(requests, context) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                        "ModelStreamInfer is not served: the model answers each request once (it is not "
                        "decoupled); use ModelInfer (tritonclient: infer or async_infer)")


def _add_inference_service(servicer: InferenceServicer, server) -> None:
    """The generated registration, with ModelInfer's (de)serializers replaced by codecs' own."""
    recorded = _Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, recorded)
    handlers = dict(recorded.handlers)
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer, request_deserializer=grpc_codec.parse_grpc_request,
        response_serializer=grpc_codec.serialize_grpc_response)
    # Triton's streaming call (tritonclient's start_stream / async_stream_infer), which our proto leaves
    # out: named, rather than grpc's "Method not found!"
    handlers.setdefault("ModelStreamInfer", grpc.stream_stream_rpc_method_handler(_stream_refused))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(recorded.service, handlers),))
    server.add_registered_method_handlers(recorded.service, handlers)


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """The files reflection describes. Our messages live in a private pool (see proto/generate.sh),
    so reflection gets its own pool holding them, health and reflection itself."""
    pool = descriptor_pool.DescriptorPool()
    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        pool.AddSerializedFile(file.serialized_pb)
    return pool


class GrpcServer:
    """grpc.aio server with the inference service, health (follows readiness) and reflection.

    `reuse_port`: bind with SO_REUSEPORT, for the front ends of one fleet, which share the port on
    purpose (service.server.Endpoint). Off, the port is this process's alone: grpc's default on
    Linux is on, and two servers would then share a port silently, each answering some of the
    connections (with its own weights)."""

    def __init__(self, fe: Frontend, host: str, port: int, reuse_port: bool = False):
        self.fe = fe
        s = fe.settings
        idle_ms = int(s.idle_timeout_s * 1000)
        options = [
            ("grpc.max_receive_message_length", s.grpc_max_message_bytes),
            ("grpc.max_send_message_length", s.grpc_max_message_bytes),
            ("grpc.so_reuseport", int(reuse_port)),
            # Bounded connections: a TCP connection that has not finished the HTTP/2 handshake,
            # or has had no call in flight, for idle_timeout_s is closed; at most
            # max_connections are accepted; a connection carries at most MAX_STREAMS calls.
            ("grpc.server_handshake_timeout_ms", idle_ms),
            ("grpc.max_connection_idle_ms", idle_ms),
            ("grpc.max_allowed_incoming_connections", s.max_connections),
            ("grpc.max_concurrent_streams", MAX_STREAMS),
            # Peers that vanished without a FIN are found by keepalive pings.
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # No transport options: grpc 1.85 already offers 4 MiB frames and a 4 MiB initial
            # window; max_frame_size, lookahead_bytes, write_buffer_size, the TCP read chunk sizes
            # and bdp_probe made no 4-16 MiB message cheaper (bench/NOTES.md, issue 11g). Its cost
            # is the copies: grpc's Python layer copies a received message twice, a sent one once.
        ]
        self.server = grpc.aio.server(options=options, interceptors=[LenientParsing()],
                                      maximum_concurrent_rpcs=s.max_connections * MAX_STREAMS)
        _add_inference_service(InferenceServicer(fe), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server, pool=_reflection_pool())
        address = host_port(host, port)
        if not reuse_port and (held := grpc_port_taken(host, port)) is not None:
            raise OSError(f"the gRPC server cannot listen on {address}: {held}")
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc >= 1.57 raises where older ones returned 0
            self.port = 0
        if self.port == 0:  # grpc's message does not say why ("set GRPC_VERBOSITY=debug"): a bind does
            why = bind_error(host, port) or "grpc gives no reason"
            raise OSError(f"the gRPC server cannot listen on {address}: {why}")

    async def start(self) -> None:
        await self.set_serving(self.fe.ready)  # a front end may start after it is attached (service.replica)
        await self.server.start()

    async def set_serving(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
