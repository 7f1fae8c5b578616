"""The moe-serve process: settings, the supervised rank group, HTTP + gRPC in one event loop.

    service.cli: flags over MOE_* variables -> Settings -> serve(settings) -> Server.serve():
      HTTP (uvicorn, :8000) and gRPC (grpc.aio, :8001) start at once: live, not ready
      supervisor: start the rank group -> one warm-up batch -> ready
                  a rank dies, raises or stops answering -> not ready, in-flight requests 503, close the group,
                  back off (restart_backoff_s, doubling to MAX_BACKOFF_S), start again
      SIGTERM/SIGINT: not ready, new requests 503, in-flight requests finish within
                  drain_timeout_s, servers stop, ranks stop, exit 0

A bad setting or an unreadable weights file (wrong path, missing key, wrong shape) exits with
status 2 before anything starts, with a message naming the problem; so does a checkpoint whose
experts the layer cannot compute exactly (service/moe/checkpoint.py names the feature). A first start of the rank
group that fails anyway exits with status 1 instead of retrying: that is a configuration
problem, not a transient one; 2 where the ranks refused a setting (`--backend fused` where the
fused backend cannot run).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time

import torch
import uvicorn

from service import logfilter
from service.api.batcher import Batcher
from service.api.connections import bounded_protocol, ensure_file_limit
from service.api.frontend import Frontend
from service.api.grpc import GrpcServer
from service.api.http import create_app
from service.config import Settings
from service.errors import ConfigError, GroupUnavailable, MoEError, WorkerError
from service.metrics import Metrics
from service.worker.warmup import expert_source, warm_up

log = logging.getLogger("moe-serve")

WATCH_INTERVAL_S = 0.5   # how often an idle group's rank processes are checked
MAX_BACKOFF_S = 30.0     # restart back-off doubles up to this
HEALTHY_RESET_S = 60.0   # a group that served this long resets the back-off
GRPC_STOP_GRACE_S = 1.0  # after the drain, what is left of gRPC calls gets this long


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the Server owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn versions
        pass


class Server:
    def __init__(self, settings: Settings, group_factory=None):
        self.settings = settings
        self.device, why = settings.resolve_device()
        cfg = settings.layer_config(self.device)
        self.weights_prefix = settings.weights_prefix
        if settings.weights:
            from service.moe.weights import checkpoint_layer

            cfg, spec = checkpoint_layer(cfg, settings.weights, prefix=settings.weights_prefix, layer=settings.layer,
                                         top_k=settings.top_k)
            self.weights_prefix = spec.prefix
        self.cfg = cfg
        log.info("device %s (%s); layer %s; backend %s; weights %s", self.device, why, cfg.describe(),
                 settings.backend, settings.weights or f"synthetic (seed {settings.seed})")
        log.info("batching: %d tokens per step (R*C), delay %.2f ms, queue %d tokens, deadline %.1f s",
                 cfg.tokens_per_step, settings.batch_delay_ms, settings.queue_tokens, settings.request_timeout_s)
        if self.device == "cpu":
            # The front end only copies rows; idle OpenMP workers spinning here would take CPU
            # from the rank processes on the same cores.
            torch.set_num_threads(1)
        self.group_factory = group_factory or self._new_group
        self.metrics = Metrics()
        self.batcher = Batcher(budget=cfg.tokens_per_step, delay_s=settings.batch_delay_ms / 1e3,
                               queue_tokens=settings.queue_tokens, slots=settings.slots, metrics=self.metrics,
                               on_failure=self._on_step_failure, slot_timeout_s=settings.step_timeout_s,
                               idle_wait=settings.batch_idle_wait)
        self.fe = Frontend(settings, cfg, self.metrics, self.batcher)
        self.group = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.exit_code = 0
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None

    def _new_group(self):
        from service.worker.group import WorkerGroup

        s = self.settings
        return WorkerGroup(self.cfg, device=self.device, weights=s.weights, weights_prefix=self.weights_prefix,
                           seed=s.seed, backend=s.backend, slots=s.slots, step_timeout_s=s.step_timeout_s,
                           start_timeout_s=s.start_timeout_s, log_level=s.log_level.upper())

    # ---- the process -----------------------------------------------------------------------

    def request_stop(self, *_) -> None:
        if not self._stopping:
            log.info("stop requested: draining (up to %.1f s)", self.settings.drain_timeout_s)
        self._stopping = True
        self.fe.set_ready(False, "the server is shutting down")
        self.batcher.refuse(GroupUnavailable("the server is shutting down"))
        self._stop.set()
        self._wake.set()

    async def serve(self) -> int:
        s = self.settings
        loop = asyncio.get_running_loop()
        self._stop, self._wake = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, self.request_stop)
        self.batcher.start()

        grpc_server = GrpcServer(self.fe, s.host, s.grpc_port)
        await grpc_server.start()
        self.grpc_port = grpc_server.port
        self.fe.on_ready_change.append(lambda ready: loop.create_task(grpc_server.set_serving(ready)))
        protocol = functools.partial(bounded_protocol(s.http_impl), idle_timeout_s=s.idle_timeout_s,
                                     max_connections=s.max_connections)
        config = uvicorn.Config(create_app(self.fe), host=s.host, port=s.http_port, log_config=None,
                                access_log=False, lifespan="off", http=protocol,
                                timeout_graceful_shutdown=max(1, int(s.drain_timeout_s)))
        http = _Uvicorn(config)
        http_task = loop.create_task(http.serve())
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            log.error("the HTTP server did not start on %s:%d", s.host, s.http_port)
            await grpc_server.stop(0)
            return 1
        self.http_port = http.servers[0].sockets[0].getsockname()[1]
        metrics_server = None
        if s.metrics_port:
            from prometheus_client import start_http_server

            metrics_server, _ = start_http_server(s.metrics_port, addr=s.host, registry=self.metrics.registry)
        log.info("serving HTTP (%s) on %s:%d, gRPC on %s:%d%s (pid %d)", s.http_impl, s.host, self.http_port,
                 s.host, self.grpc_port, f", metrics on :{s.metrics_port}" if s.metrics_port else "", os.getpid())

        supervisor = loop.create_task(self._supervise())
        await self._stop.wait()

        drain_end = time.monotonic() + (s.drain_timeout_s if self.exit_code == 0 else 0.0)
        if self.exit_code == 0:
            drained = await self.batcher.wait_idle(s.drain_timeout_s)
            log.info("drain %s; stopping", "complete" if drained else
                     f"timed out with {self.batcher.pending} requests left")
        # The supervisor returns at its next check; a group start in progress is let finish
        # (a start cannot be interrupted safely) and then closed below.
        await asyncio.gather(supervisor, return_exceptions=True)
        # Steps still in flight (those of requests past their deadline) get what is left of the
        # drain; the step threads are joined, so none is inside group.run when the group closes.
        await self.batcher.close(timeout_s=max(0.0, drain_end - time.monotonic()))
        http.should_exit = True
        await grpc_server.stop(GRPC_STOP_GRACE_S)
        await asyncio.gather(http_task, return_exceptions=True)
        if metrics_server is not None:
            metrics_server.shutdown()
        if self.group is not None:
            await asyncio.to_thread(self.group.close)
            self.group = None
        log.info("stopped")
        return self.exit_code

    # ---- supervision -----------------------------------------------------------------------

    def _on_step_failure(self, group, exc: BaseException) -> None:
        if group is self.group:
            log.error("a step failed: %s", exc)
            self._wake.set()

    async def _supervise(self) -> None:
        failures = 0
        first = True
        while not self._stopping:
            group = self.group_factory()
            self.group = group
            try:
                await asyncio.to_thread(group.start)
                if self._stopping:
                    return  # serve() closes self.group
                await asyncio.to_thread(self._warm_up, group)
            except Exception as exc:  # noqa: BLE001  any start failure
                self.group = None
                await asyncio.to_thread(group.close)
                if self._stopping:
                    return
                if first:
                    log.error("the rank group did not start: %s", exc)
                    self.exit_code = 2 if isinstance(exc, ConfigError) else 1  # 2: a setting it refused
                    self.request_stop()
                    return
                failures += 1
                delay = self._backoff(failures)
                log.error("restarting the rank group failed (%s); next try in %.1f s", exc, delay)
                self.metrics.worker_restarts.inc()
                await self._pause(delay)
                continue
            first = False
            self.metrics.use_backend(group.backend)
            self.batcher.attach(group)
            self.fe.set_ready(not self._stopping)
            log.info("ready (rank pids %s)", getattr(group, "pids", "?"))
            since = time.monotonic()
            await self._watch(group)
            if self._stopping:
                return  # serve() drains and closes the group
            self.fe.set_ready(False, "the rank group failed; it is being restarted")
            self.batcher.detach(GroupUnavailable("the rank group failed; it is being restarted"))
            self.group = None
            await asyncio.to_thread(group.close)
            if time.monotonic() - since > HEALTHY_RESET_S:
                failures = 0
            failures += 1
            delay = self._backoff(failures)
            log.warning("the rank group failed; restart %d in %.1f s", failures, delay)
            self.metrics.worker_restarts.inc()
            await self._pause(delay)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake up for a stop request."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    def _backoff(self, failures: int) -> float:
        return min(MAX_BACKOFF_S, self.settings.restart_backoff_s * 2 ** (failures - 1))

    async def _watch(self, group) -> None:
        """Return when the group fails (a step failed, a rank process is gone or, while idle, a
        rank does not answer the heartbeat) or on stop."""
        while not self._stopping:
            if not group.poll():
                log.error("a rank process of the group has exited")
                return
            try:
                await asyncio.to_thread(group.heartbeat)
            except (WorkerError, GroupUnavailable) as exc:
                log.error("the rank group failed its heartbeat: %s", exc)
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), WATCH_INTERVAL_S)

    def _warm_up(self, group) -> None:
        """One full step checked against the fp32 reference: the group is right before it is ready."""
        s = self.settings
        warm_up(group, self.cfg, expert_source(self.cfg, s.weights, self.weights_prefix, s.seed), s.step_timeout_s)


# ---- entry point (flags: service.cli) ------------------------------------------------------


def serve(settings: Settings) -> int:
    """Run the service with these settings until SIGTERM; the exit status of the process."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logfilter.install()
    ensure_file_limit(settings.max_connections)
    try:
        server = Server(settings)
    except MoEError as err:  # ConfigError, WeightsError: the message names the problem
        log.error("%s", err)
        return 2
    return asyncio.run(server.serve())


def main(argv: list[str] | None = None) -> int:
    from service.cli import parse_settings

    return serve(parse_settings(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
