"""What the HTTP and gRPC layers share: readiness, the model's description, inference, metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import torch

from service.api.batcher import Batcher
from service.api.codecs import INPUT_NAMES, OUTPUT_NAME, V2_NAMES, Decoded, ModelSpec
from service.config import LayerConfig, Settings
from service.errors import GroupUnavailable
from service.metrics import PROTOCOLS, Metrics

SERVER_NAME = "moe-serve"
EXTENSIONS = ["binary_tensor_data", "parameters"]  # Triton's names for what v2 infer supports
OFFLOAD_ELEMENTS = 1 << 20  # tensors above this many elements are encoded/decoded off the event loop


class Frontend:
    def __init__(self, settings: Settings, cfg: LayerConfig, metrics: Metrics, batcher: Batcher):
        self.settings, self.cfg, self.metrics, self.batcher = settings, cfg, metrics, batcher
        self.spec = ModelSpec.of(cfg, max_tokens=settings.queue_tokens)
        self.model_name = settings.model_name
        self._ready = False
        self._why_not = "the service is starting"
        self.on_ready_change: list[Callable[[bool], None]] = []
        metrics.ready.set(0)
        for protocol in PROTOCOLS:
            metrics.requests.labels(protocol, "200")  # export the zero series up front

    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool, why_not: str = "the service is not ready") -> None:
        if not ready:
            self._why_not = why_not
        if ready != self._ready:
            self._ready = ready
            self.metrics.ready.set(1 if ready else 0)
            for callback in self.on_ready_change:
                callback(ready)

    async def infer(self, req: Decoded, transport_timeout_s: float | None = None) -> torch.Tensor:
        """The layer's answer [T, H] in the request's dtype."""
        if not self._ready:
            raise GroupUnavailable(self._why_not)
        timeout = req.timeout_s or self.settings.request_timeout_s
        if transport_timeout_s is not None:
            timeout = min(timeout, transport_timeout_s)
        out = await self.batcher.submit(req.x, req.ids, req.w, timeout)
        return out if out.dtype == req.out_dtype else out.to(req.out_dtype)

    async def offload(self, size: int, fn, *args):
        """fn(*args), in a thread when the tensor is large enough to stall the event loop."""
        if size > OFFLOAD_ELEMENTS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def observe(self, protocol: str, status: int, started: float) -> None:
        code = str(status)
        self.metrics.requests.labels(protocol, code).inc()
        self.metrics.request_duration.labels(protocol, code).observe(time.perf_counter() - started)

    # ---- descriptions ----------------------------------------------------------------------

    def server_metadata(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("moe-serve")
        except PackageNotFoundError:
            ver = "unknown"
        return {"name": SERVER_NAME, "version": ver, "extensions": EXTENSIONS}

    def model_metadata(self) -> dict:
        cfg = self.cfg
        dt = V2_NAMES[cfg.dtype]
        shapes = {"hidden_states": (dt, [-1, cfg.H]), "topk_ids": ("INT32", [-1, cfg.K]),
                  "topk_weights": ("FP32", [-1, cfg.K])}
        return {
            "name": self.model_name,
            "versions": [],
            "platform": "pytorch_moe",
            "inputs": [{"name": n, "datatype": shapes[n][0], "shape": shapes[n][1]} for n in INPUT_NAMES],
            "outputs": [{"name": OUTPUT_NAME, "datatype": dt, "shape": [-1, cfg.H]}],
        }
