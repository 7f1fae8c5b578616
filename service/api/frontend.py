"""What the HTTP and gRPC layers share: readiness, the model's description, inference, metrics.

The model's configuration and statistics are Triton's (`/v2/models/{m}/config`, `/stats`; gRPC
ModelConfig, ModelStatistics), so that perf_analyzer and other Triton tools run unchanged. The
token dimension is Triton's batch dimension: `max_batch_size` is the most tokens one request may
carry, dims leave it out, and `inference_count` counts tokens as Triton counts batch items.
Triton's model repository calls are answered as a server with its one model loaded at start
(`repository_index`, `refuse_model_control`), alike on HTTP and gRPC.

With several front-end processes (service.fleet) `gather` returns every process's Snapshot, and
/metrics and the statistics answer their sum, whichever process is asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import NoReturn

import torch

from service.api.arena import WireArena
from service.api.batcher import Batcher
from service.api.codecs import INPUT_NAMES, MODEL_VERSION, OUTPUT_NAME, V2_NAMES, Decoded, ModelSpec, check_model
from service.api.error_map import ModelControlUnsupported, RepositoryNameUnsupported
from service.api.regions import Regions, Rows, enabled
from service.config import LayerConfig, Settings
from service.errors import GroupUnavailable
from service.metrics import PROTOCOLS, Metrics, Snapshot, merge

log = logging.getLogger(__name__)

SERVER_NAME = "moe-serve"
# Triton's names for what the server supports; perf_analyzer reads server-side statistics only
# where "statistics" is listed.
EXTENSIONS = ["binary_tensor_data", "parameters", "model_configuration", "statistics"]
OFFLOAD_ELEMENTS = 1 << 20  # tensors above this many elements are encoded/decoded off the event loop


class Frontend:
    def __init__(self, settings: Settings, cfg: LayerConfig, metrics: Metrics, batcher: Batcher):
        self.settings, self.cfg, self.metrics, self.batcher = settings, cfg, metrics, batcher
        self.spec = ModelSpec.of(cfg, max_tokens=settings.queue_tokens)
        self.model_name = settings.model_name
        self._ready = False
        self._accepting = False  # serves requests while not (yet) ready: see accept()
        self._inference_count = 0  # tokens of successful requests
        self._last_inference_ms = 0  # wall-clock time of the last successful one, ms since the epoch
        self._why_not = "the service is starting"
        self.on_ready_change: list[Callable[[bool], None]] = []
        # Every front-end process's snapshot, this one's included (blocking; run in a thread);
        # None: this process is the only front end.
        self.gather: Callable[[], list[Snapshot]] | None = None
        # The system shared-memory registry (service.api.regions) when Settings.shared_memory is
        # "system": set by the owner (service.server), or from the table it hands a front end.
        self.regions: Regions | None = None
        # The wire arena (service.api.arena, Settings.wire_arena_mib): set by the endpoint, which makes it
        self.arena: WireArena | None = None
        self._warm_up: asyncio.Task | None = None  # its one row through the ranks, after each group start
        metrics.ready.set(0)
        for protocol in PROTOCOLS:
            metrics.requests.labels(protocol, "200")  # export the zero series up front

    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool, why_not: str = "the service is not ready") -> None:
        if not ready:
            self._why_not = why_not
            self._accepting = False
        if ready != self._ready:
            self._ready = ready
            self.metrics.ready.set(1 if ready else 0)
            for callback in self.on_ready_change:
                callback(ready)
            if ready:  # a new group's ranks have not mapped the arena yet
                self.warm_arena()

    def accept(self) -> None:
        """Serve requests before turning ready: the owner's batcher has the group while the other
        front ends attach it (service.server), so a request that reaches the owner then is answered,
        not refused 503, though the owner reports ready only once every front end serves.
        set_ready(False) ends it."""
        self._accepting = True

    def shared_memory(self) -> Regions:
        """The shared-memory registry; SharedMemoryOff when the extension is off."""
        return enabled(self.regions)

    async def infer(self, req: Decoded, transport_timeout_s: float | None = None,
                    out: Rows | None = None) -> Rows:
        """The layer's answer [T, H] in the request's dtype (written into `out` when given, else
        into the request's output region when it named one)."""
        if not (self._ready or self._accepting):
            raise GroupUnavailable(self._why_not)
        timeout = req.timeout_s or self.settings.request_timeout_s
        if transport_timeout_s is not None:
            timeout = min(timeout, transport_timeout_s)
        answer = await self.batcher.submit(req.x, req.ids, req.w, timeout, out_dtype=req.out_dtype,
                                           out=req.out_region if out is None else out)
        self._inference_count += answer.shape[0]
        self._last_inference_ms = time.time_ns() // 1_000_000
        return answer

    def warm_arena(self) -> None:
        """Send one row through the wire arena (if any) in the background: at each turn to ready, and
        when the arena is made after it (a front end i >= 1 learns of the group before it serves)."""
        if self.arena is not None:
            self._warm_up = asyncio.get_running_loop().create_task(self._warm_arena(), name="moe-arena-warm-up")

    async def _warm_arena(self) -> None:
        """One row through the wire arena as soon as a group serves, so that each rank maps and page-locks
        this front end's arena now (tens of ms for 256 MiB on a GPU host), not in a client's first step."""
        arena, spec = self.arena, self.spec
        assert arena is not None
        x, out = arena.rows(1, spec.H, spec.dtype), arena.rows(1, spec.H, spec.dtype)
        if x is None or out is None:
            return
        x.zero_()
        ids = torch.arange(spec.K, dtype=torch.int32).view(1, spec.K)  # [1, K] distinct experts
        w = torch.full((1, spec.K), 1.0 / spec.K)                      # [1, K]
        started = time.perf_counter()
        try:
            await self.batcher.submit(x, ids, w, self.settings.request_timeout_s, out_dtype=spec.dtype, out=out)
        except Exception as err:  # noqa: BLE001  a client's first request maps it instead
            log.warning("the wire arena's warm-up step failed (%s): the ranks map it at its first request", err)
            return
        log.info("the ranks opened the wire arena (a CUDA rank maps and page-locks it): one row through it in "
                 "%.1f ms", (time.perf_counter() - started) * 1e3)

    def answer_rows(self, req: Decoded) -> torch.Tensor | None:
        """Rows for the answer in the wire arena, where the ranks write it and the response sends it from:
        for a request whose hidden_states arrived there in the compute dtype and whose answer goes in the
        response's binary part; None otherwise, or when the arena has no room (counted)."""
        arena = self.arena
        if (arena is None or not req.binary_output or req.out_region is not None or req.out_dtype != self.spec.dtype
                or not isinstance(req.x, torch.Tensor) or arena.place(req.x) is None):
            return None
        out = arena.rows(req.T, self.spec.H, req.out_dtype)
        if out is None:
            self.metrics.arena_full.inc()
        return out

    async def offload(self, size: int, fn, *args):
        """fn(*args), in a thread when the tensor is large enough to stall the event loop."""
        if size > OFFLOAD_ELEMENTS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def observe(self, protocol: str, status: int, started: float) -> None:
        code = str(status)
        self.metrics.requests.labels(protocol, code).inc()
        self.metrics.request_duration.labels(protocol, code).observe(time.perf_counter() - started)

    # ---- metrics of every front-end process ------------------------------------------------

    def snapshot(self) -> Snapshot:
        """This process's metrics and statistics (thread-safe)."""
        return Snapshot(list(self.metrics.registry.collect()), self._inference_count, self._last_inference_ms,
                        dict(self.metrics.request_compute))

    async def aggregate(self) -> Snapshot:
        """The metrics of the whole server: this process's, or the sum over every front end."""
        if self.gather is None:
            return self.snapshot()
        return merge(await asyncio.to_thread(self.gather))

    # ---- descriptions ----------------------------------------------------------------------

    def server_metadata(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("moe-serve")
        except PackageNotFoundError:
            ver = "unknown"
        extensions = EXTENSIONS + (["system_shared_memory"] if self.settings.shared_memory == "system" else [])
        return {"name": SERVER_NAME, "version": ver, "extensions": extensions}

    def model_metadata(self) -> dict:
        cfg = self.cfg
        dt = V2_NAMES[cfg.dtype]
        shapes = {"hidden_states": (dt, [-1, cfg.H]), "topk_ids": ("INT32", [-1, cfg.K]),
                  "topk_weights": ("FP32", [-1, cfg.K])}
        return {
            "name": self.model_name,
            "versions": [MODEL_VERSION],
            "platform": "pytorch_moe",
            "inputs": [{"name": n, "datatype": shapes[n][0], "shape": shapes[n][1]} for n in INPUT_NAMES],
            "outputs": [{"name": OUTPUT_NAME, "datatype": dt, "shape": [-1, cfg.H]}],
        }

    def repository_index(self, ready_only: bool = False, repository: str = "") -> list[dict]:
        """Triton's model repository index: the one model, READY or UNAVAILABLE with the reason
        (`ready_only`: only a ready one). A `repository` name is refused, as Triton does."""
        _no_repository(repository)
        if self._ready:
            return [{"name": self.model_name, "version": MODEL_VERSION, "state": "READY"}]
        if ready_only:
            return []
        return [{"name": self.model_name, "version": MODEL_VERSION, "state": "UNAVAILABLE", "reason": self._why_not}]

    def refuse_model_control(self, model: str, repository: str = "") -> NoReturn:
        """Triton's load or unload of `model`: refused, always, saying why; an unknown name is
        ModelNotFound, a `repository` name is refused first (as Triton checks it first)."""
        _no_repository(repository)
        check_model(model, None, self.model_name)
        raise ModelControlUnsupported(f"this server loads its one model, {self.model_name!r}, at start and "
                                      "cannot load or unload models (as Triton with --model-control-mode=none)")

    def model_config(self) -> dict:
        """Triton's model configuration (model_config.proto's field names, as its HTTP API prints
        them): what perf_analyzer reads to build its requests."""
        cfg, settings = self.cfg, self.settings
        dims = {"hidden_states": [cfg.H], "topk_ids": [cfg.K], "topk_weights": [cfg.K]}
        meta = self.model_metadata()
        return {
            "name": self.model_name,
            "platform": meta["platform"],
            "backend": "",
            "max_batch_size": self.spec.max_tokens,
            "input": [{"name": t["name"], "data_type": "TYPE_" + t["datatype"], "dims": dims[t["name"]]}
                      for t in meta["inputs"]],
            "output": [{"name": t["name"], "data_type": "TYPE_" + t["datatype"], "dims": [cfg.H]}
                       for t in meta["outputs"]],
            "dynamic_batching": {
                "preferred_batch_size": [cfg.tokens_per_step],
                "max_queue_delay_microseconds": round(settings.batch_delay_ms * 1000),
                "default_queue_policy": {
                    "timeout_action": "REJECT",
                    "default_timeout_microseconds": round(settings.request_timeout_s * 1e6),
                    "allow_timeout_override": True,
                    "max_queue_size": 0,  # the queue is bounded in tokens (queue_tokens), not requests
                },
            },
            "model_transaction_policy": {"decoupled": False},
        }

    async def model_statistics(self) -> dict:
        """Triton's statistics for the model, from the front ends' own metrics: success and fail
        are requests by outcome (arrival to answer), queue is arrival to the first step, the compute
        phases are the times of the steps a request's rows ran in (copy into the slot, the layer,
        copy out; Triton too charges a batch's times to each request in it). Durations are
        {"count", "ns"}."""
        snap = await self.aggregate()

        def duration(count: float | None, seconds: float | None) -> dict:  # None: never observed
            return {"count": int(count or 0), "ns": round((seconds or 0.0) * 1e9)}

        columns = {"moe_request_duration_seconds_count": 0, "moe_request_duration_seconds_sum": 1}
        success, fail = [0.0, 0.0], [0.0, 0.0]  # count, seconds
        for family in snap.families:
            for sample in family.samples:
                if sample.name in columns:
                    (success if sample.labels["status"] == "200" else fail)[columns[sample.name]] += sample.value
        value = snap.value
        empty = duration(0, 0.0)
        return {"model_stats": [{
            "name": self.model_name,
            "version": MODEL_VERSION,
            "last_inference": snap.last_inference_ms,
            "inference_count": snap.inference_count,
            "execution_count": int(value("moe_steps_total") or 0),
            "inference_stats": {
                "success": duration(*success),
                "fail": duration(*fail),
                "queue": duration(value("moe_queue_time_seconds_count"), value("moe_queue_time_seconds_sum")),
                **{phase: dataclasses.asdict(d) for phase, d in snap.request_compute.items()},
                "cache_hit": empty,
                "cache_miss": empty,
            },
            "batch_stats": [],
        }]}


def _no_repository(name: str) -> None:
    """Triton's model repository calls name no repository here (gRPC's `repository_name`)."""
    if name:
        raise RepositoryNameUnsupported(f"'repository_name' specification is not supported (got {name!r}): "
                                        "this server has no model repository, only its one model")
