"""What HTTP and gRPC share: large requests leave the event loop, one list of protocols."""

from __future__ import annotations

import asyncio
import threading

import torch

from service.api import codecs, frontend
from service.api.batcher import Batcher
from service.api.grpc import InferenceServicer
from service.config import Settings
from service.metrics import PROTOCOLS, Metrics
from tests.api.common import CFG, inputs


def make_frontend() -> frontend.Frontend:
    metrics = Metrics()
    batcher = Batcher(budget=CFG.tokens_per_step, delay_s=0.0, queue_tokens=1 << 16, slots=1, metrics=metrics)
    return frontend.Frontend(Settings(queue_tokens=1 << 16), CFG, metrics, batcher)


class Context:
    """The parts of grpc.aio.ServicerContext that ModelInfer uses."""

    def time_remaining(self):
        return None

    async def abort(self, code, details):
        raise AssertionError(f"aborted with {code}: {details}")


def test_grpc_decodes_large_requests_off_the_event_loop(monkeypatch):
    fe = make_frontend()
    decoded_on: list[threading.Thread] = []
    decode = codecs.decode_grpc

    def recording(request, spec):
        decoded_on.append(threading.current_thread())
        return decode(request, spec)

    async def echo(req, transport_timeout_s=None):
        return req.x

    monkeypatch.setattr(codecs, "decode_grpc", recording)
    monkeypatch.setattr(fe, "infer", echo)
    big = frontend.OFFLOAD_ELEMENTS // CFG.H + 1  # hidden_states alone is over the threshold
    for T in (3, big):
        x, ids, w = inputs(T, seed=T)
        request = codecs.pb.ModelInferRequest(model_name=fe.model_name)
        for name, dt, t in zip(codecs.INPUT_NAMES, ("FP32", "INT64", "FP32"), (x, ids, w), strict=True):
            request.inputs.add(name=name, datatype=dt, shape=list(t.shape))
            request.raw_input_contents.append(codecs.to_bytes(t))
        response = asyncio.run(InferenceServicer(fe).ModelInfer(request, Context())).to_message()
        out = torch.frombuffer(bytearray(response.raw_output_contents[0]), dtype=torch.float32)
        assert torch.equal(out.reshape(T, CFG.H), x)
    small_thread, big_thread = decoded_on
    assert small_thread is threading.main_thread(), "a small request is decoded on the event loop"
    assert big_thread is not threading.main_thread(), "a large request must be decoded in a worker thread"


def test_one_list_of_protocols():
    assert frontend.PROTOCOLS is PROTOCOLS  # the front end takes the list from service.metrics
    fe = make_frontend()
    exported = {s.labels["protocol"] for m in fe.metrics.requests.collect() for s in m.samples}
    assert exported == set(PROTOCOLS)
