"""The gRPC front end: inference.GRPCInferenceService (Open Inference Protocol), grpc.health.v1
and server reflection, on grpc.aio in the same event loop as HTTP.

ModelInfer answers in `raw_output_contents`. The deadline is the smallest of the client's gRPC
deadline, the request's `timeout` parameter (microseconds) and the server default. Every error
leaves through `_abort`, which asks `service.api.error_map` for the code.
"""

from __future__ import annotations

import logging
import time

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from service.api import codecs
from service.api.frontend import Frontend
from service.api.proto import grpc_predict_v2_pb2 as pb
from service.api.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from service.api.error_map import classify, message

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    status, code = classify(exc)
    if status == 500:  # a bug of ours; 503/504 are expected states, logged where they arise
        log.error("gRPC request failed: %s", exc, exc_info=True)
    await context.abort(code, message(exc))


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, fe: Frontend):
        self.fe = fe

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.fe.ready)

    async def ModelReady(self, request, context):
        try:
            codecs.check_model(request.name, request.version, self.fe.model_name)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
        return pb.ModelReadyResponse(ready=self.fe.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**self.fe.server_metadata())

    async def ModelMetadata(self, request, context):
        try:
            codecs.check_model(request.name, request.version, self.fe.model_name)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
        meta = self.fe.model_metadata()
        response = pb.ModelMetadataResponse(name=meta["name"], platform=meta["platform"])
        for field in ("inputs", "outputs"):
            for t in meta[field]:
                getattr(response, field).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return response

    async def ModelInfer(self, request, context):
        fe = self.fe
        started = time.perf_counter()
        try:
            codecs.check_model(request.model_name, request.model_version, fe.model_name)
            req = await fe.offload(codecs.grpc_elements(request), codecs.decode_grpc, request, fe.spec)
            out = await fe.infer(req, transport_timeout_s=context.time_remaining())
            response = await fe.offload(out.numel(), codecs.encode_grpc, out, req, fe.model_name)
        except Exception as exc:  # noqa: BLE001  mapped to a code in one place
            fe.observe("grpc", classify(exc)[0], started)
            await _abort(context, exc)
        fe.observe("grpc", 200, started)
        return response


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """The files reflection describes. Our messages live in a private pool (see proto/generate.sh),
    so reflection gets its own pool holding them, health and reflection itself."""
    pool = descriptor_pool.DescriptorPool()
    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        pool.AddSerializedFile(file.serialized_pb)
    return pool


class GrpcServer:
    """grpc.aio server with the inference service, health (follows readiness) and reflection."""

    def __init__(self, fe: Frontend, host: str, port: int):
        limit = fe.settings.grpc_max_message_bytes
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                               ("grpc.max_send_message_length", limit)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(fe), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server, pool=_reflection_pool())
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC port {host}:{port}")

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
