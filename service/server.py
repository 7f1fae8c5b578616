"""The moe-serve process: settings, the supervised rank group, HTTP + gRPC in one event loop.

With `--frontends N` > 1 this process is front end 0 and the owner of the rank group; front ends
1..N-1 serve the same ports from their own processes and run their steps through it
(service.fleet; the design is in docs/CONTRACTS.md). `Endpoint` is what every front end runs.

    service.cli: flags over MOE_* variables -> Settings -> serve(settings) -> Server.serve():
      HTTP (uvicorn, :8000) and gRPC (grpc.aio, :8001) start at once: live, not ready
      supervisor: start the rank group -> one warm-up batch -> ready
                  a rank dies, raises or stops answering -> not ready, in-flight requests 503, close the group,
                  back off (restart_backoff_s, doubling to MAX_BACKOFF_S), start again; after
                  max_restart_failures failures in a row (none after 60 s of serving): exit 4
      SIGTERM/SIGINT: not ready, new requests 503, in-flight requests finish within
                  drain_timeout_s (every front end), servers stop, ranks stop, exit 0

A bad setting or an unreadable weights file (wrong path, missing key, wrong shape) exits with
status 2 before anything starts, with a message naming the problem; so does a checkpoint whose
experts the layer cannot compute exactly (service/moe/checkpoint.py names the feature). A first start of the rank
group that fails anyway exits with status 1 instead of retrying: that is a configuration
problem, not a transient one; 2 where the ranks refused a setting (`--backend fused` where the
fused backend cannot run). A port that cannot be listened on (another process holds it, or
`--host` is not an address of this host) exits with status 3, HTTP's, gRPC's or the metrics port
alike; no port is shared with another server (SO_REUSEPORT only among one fleet's front ends).
A rank group that fails `--max-restart-failures` times in a row (restarts that never got it ready,
or groups that failed within 60 s of turning ready: a GPU or driver gone bad) exits with status 4,
so that the orchestrator restarts or reschedules the process.
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
from service.api.address import bind_error, grpc_port_taken, host_port, listen_socket
from service.api.arena import adopt_objects, make_arena
from service.api.batcher import Batcher
from service.api.connections import bounded_protocol, ensure_file_limit
from service.api.frontend import Frontend
from service.api.grpc import GrpcServer
from service.api.http import create_app
from service.api.regions import Regions, RegionTable
from service.config import LayerConfig, Settings, unknown_variables, usable_cpus
from service.errors import BackendUnavailable, ConfigError, GroupUnavailable, MoEError, WeightsError, WorkerError
from service.fleet import (
    FRONTEND_STOP_GRACE_S,
    HEALTHY_RESET_S,
    WATCH_INTERVAL_S,
    Fleet,
    backoff_s,
    direct_regions,
    set_frontend_threads,
    wire_arena_mib,
)
from service.metrics import Metrics, merge, serve_metrics
from service.worker.malloc import keep_freed_memory
from service.worker.shm import check_room
from service.worker.warmup import expert_source, warm_up

log = logging.getLogger("moe-serve")

EXIT_CANNOT_LISTEN = 3  # a port taken or an address not this host's (uvicorn's own STARTUP_FAILURE code)
EXIT_RESTARTS_FAILED = 4  # --max-restart-failures failures of the rank group in a row, none after 60 s serving
GRPC_STOP_GRACE_S = 1.0  # after the drain, what is left of gRPC calls gets this long
MAX_DEFAULT_FRONTENDS = 4  # the default --frontends on a GPU host: min(this, CPU cores // 2)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the Server owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn versions
        pass


class Endpoint:
    """One front-end process's serving half: metrics, batcher, Frontend, HTTP and gRPC servers.

    The owner (Server) and every other front-end process (service.replica) run one each. With
    `reuse_port` (a fleet's front ends) both ports are bound with SO_REUSEPORT, so that several
    processes listen on the same ports and the kernel spreads connections over them; without it
    neither is, and a port another process holds is refused."""

    def __init__(self, settings: Settings, cfg: LayerConfig, slots: int, on_failure=None):
        self.settings = settings
        self.metrics = Metrics()
        self.batcher = Batcher(budget=cfg.tokens_per_step, delay_s=settings.batch_delay_ms / 1e3,
                               queue_tokens=settings.queue_tokens, slots=slots, metrics=self.metrics,
                               on_failure=on_failure, slot_timeout_s=settings.step_timeout_s,
                               idle_wait=settings.batch_idle_wait, copy_threads=settings.copy_threads)
        self.fe = Frontend(settings, cfg, self.metrics, self.batcher)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._grpc: GrpcServer | None = None
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task | None = None
        self._prune_task: asyncio.Task | None = None

    async def start(self, http_port: int, grpc_port: int, reuse_port: bool = False) -> bool:
        """Start the batcher and both servers; False (logged) if one cannot listen (its wire arena then
        removed: the process exits)."""
        if await self._start(http_port, grpc_port, reuse_port):
            return True
        if self.fe.arena is not None:
            self.fe.arena.close()
        return False

    async def _start(self, http_port: int, grpc_port: int, reuse_port: bool) -> bool:
        s = self.settings
        loop = asyncio.get_running_loop()
        self.batcher.start()
        if self.fe.regions is not None:  # (set before start: by the owner, or from its ("regions",))
            self._prune_task = loop.create_task(self.fe.regions.keep_pruned(), name="moe-regions")
        arena = self.fe.arena = self.batcher.arena = make_arena(s.wire_arena_mib or 0)
        if arena is not None and s.wire_arena_grpc:
            adopt_objects(arena)
        if arena is not None and self.fe.regions is not None:  # no client may register it under another name
            self.fe.regions.table.reserve([arena.fd])
        if arena is not None and self.fe.ready:  # (a front end i >= 1 may be attached before it starts)
            self.fe.warm_arena()
        try:
            self._grpc = GrpcServer(self.fe, s.host, grpc_port, reuse_port=reuse_port)
        except OSError as err:
            log.error("%s", err)
            return False
        await self._grpc.start()
        self.grpc_port = self._grpc.port
        grpc_server = self._grpc
        self.fe.on_ready_change.append(lambda ready: loop.create_task(grpc_server.set_serving(ready)))
        await grpc_server.set_serving(self.fe.ready)  # a change during start() came before the hook
        protocol = functools.partial(bounded_protocol(s.http_impl, s.max_request_bytes, s.send_threads, arena,
                                                      self.metrics.arena_full.inc),
                                     idle_timeout_s=s.idle_timeout_s, max_connections=s.max_connections)
        config = uvicorn.Config(create_app(self.fe), host=s.host, port=http_port, log_config=None,
                                access_log=False, lifespan="off", http=protocol,
                                # a kept-alive connection lives --idle-timeout-s after its last
                                # response, as ConnectionBounds says (uvicorn's own 5 s cut it first)
                                timeout_keep_alive=s.idle_timeout_s,  # type: ignore[arg-type]
                                timeout_graceful_shutdown=max(1, int(s.drain_timeout_s)))
        self._http = _Uvicorn(config)
        try:  # bound here, not by uvicorn: its bind error is a sys.exit(3) from inside its task
            sockets = [listen_socket(s.host, http_port, config.backlog, reuse_port=reuse_port)]
        except OSError as err:
            log.error("the HTTP server cannot listen on %s: %s", host_port(s.host, http_port), err)
            await self._grpc.stop(0)
            return False
        self._http_task = loop.create_task(self._http.serve(sockets=sockets))
        while not self._http.started and not self._http_task.done():
            await asyncio.sleep(0.01)
        if self._http_task.done():
            log.error("the HTTP server did not start on %s", host_port(s.host, http_port))
            await self._grpc.stop(0)
            return False
        self.http_port = self._http.servers[0].sockets[0].getsockname()[1]
        return True

    async def stop(self, drain_end: float) -> None:
        """Let the steps in flight finish until `drain_end` (monotonic), then stop everything."""
        await self.batcher.close(timeout_s=max(0.0, drain_end - time.monotonic()))
        if self._prune_task is not None:
            self._prune_task.cancel()
        if self._http is not None:
            self._http.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(GRPC_STOP_GRACE_S)
        if self._http_task is not None:
            await asyncio.gather(self._http_task, return_exceptions=True)
        if self.fe.arena is not None:  # (blocks still held keep their pages until they are let go)
            self.fe.arena.close()


def frontend_count(settings: Settings, device: str) -> int:
    """--frontends, or the default: min(4, CPU cores // 2) front-end processes on a GPU host (one
    Python process cannot feed one GPU: bench/NOTES.md, issue 11), 1 on the CPU (the ranks need the
    cores; one front end keeps up with the CPU layer). CPU cores: service.config.usable_cpus."""
    if settings.frontends is not None:
        return settings.frontends
    if device != "cuda":
        return 1
    return max(1, min(MAX_DEFAULT_FRONTENDS, usable_cpus() // 2))


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
        if settings.backend == "fused" and self.device != "cuda":  # known now: refuse before anything starts
            from service.moe.fused_plan import local_unavailable_reason  # (on CUDA the ranks decide, on their device)

            raise BackendUnavailable(f"--backend fused cannot run here: "
                                     f"{local_unavailable_reason(cfg, torch.device(self.device))}; "
                                     f"use --backend auto or serial")
        self.frontends = frontend_count(settings, self.device)
        check_room(cfg, settings.slots * self.frontends)  # (the group makes every front end's slots)
        # Each front end's wire arena, resolved here for every front-end process (they read it from settings)
        arena_mib, why_arena = wire_arena_mib(settings, self.device, self.frontends)
        settings = self.settings = settings.model_copy(update={"wire_arena_mib": arena_mib})
        log.info("device %s (%s); layer %s; backend %s; weights %s", self.device, why, cfg.describe(),
                 settings.backend, settings.weights or f"synthetic (seed {settings.seed})")
        log.info("batching: %d tokens per step (R*C), delay %.2f ms, queue %d tokens, deadline %.1f s; "
                 "%d front-end process(es) of %d slots, %d copy thread(s) and %d send thread(s) each",
                 cfg.tokens_per_step, settings.batch_delay_ms, settings.queue_tokens, settings.request_timeout_s,
                 self.frontends, settings.slots, settings.copy_threads, settings.send_threads)
        set_frontend_threads()
        keep_freed_memory(settings.malloc_keep_mib)
        self.group_factory = group_factory or self._new_group
        self.endpoint = Endpoint(settings, cfg, settings.slots, on_failure=self._on_step_failure)
        self.metrics, self.batcher, self.fe = self.endpoint.metrics, self.endpoint.batcher, self.endpoint.fe
        # Triton's system shared memory: one registry for every front end (service.api.regions)
        self.regions = RegionTable.create() if settings.shared_memory == "system" else None
        self.direct, why_direct = direct_regions(settings, self.device)
        if self.regions is not None:
            log.info("system shared memory on; direct %s (%s): %s", "on" if self.direct else "off", why_direct,
                     "the ranks read and write regions of the compute dtype themselves" if self.direct
                     else "the front ends copy rows in and out")
        if self.regions is not None:
            self.fe.regions = Regions(self.regions)
        log.info("wire arena %s (%s)", f"{arena_mib} MiB per front-end process" if arena_mib else "off", why_arena)
        self.fleet = Fleet(settings, cfg, self.frontends, self.fe.snapshot, self._on_remote_failure,
                           regions_fd=self.regions.fd if self.regions is not None else None) \
            if self.frontends > 1 else None
        if self.fleet is not None:
            self.fe.gather = self.fleet.gather
        self.group = None
        self._attached = None  # what the batcher runs its steps on: the group, or front end 0's share of it
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.exit_code = 0
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._failed = None  # the group a step failed on (kept: _watch's wake-up event is cleared)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _new_group(self):
        from service.worker.group import WorkerGroup

        s = self.settings
        return WorkerGroup(self.cfg, device=self.device, weights=s.weights, weights_prefix=self.weights_prefix,
                           seed=s.seed, backend=s.backend, slots=s.slots * self.frontends,
                           step_timeout_s=s.step_timeout_s, start_timeout_s=s.start_timeout_s,
                           log_level=s.log_level.upper(), lookahead=s.rank_lookahead,
                           copy_streams=s.rank_copy_streams, direct_regions=self.direct,
                           malloc_keep_mib=s.malloc_keep_mib, idle_spin_s=s.rank_idle_spin_ms / 1e3)

    # ---- the process -----------------------------------------------------------------------

    def request_stop(self, *_) -> None:
        if not self._stopping:
            log.info("stop requested: draining %d requests in flight (up to %.1f s)", self.batcher.pending,
                     self.settings.drain_timeout_s)
        self._stopping = True
        self.fe.set_ready(False, "the server is shutting down")
        self.batcher.refuse(GroupUnavailable("the server is shutting down"))
        if self.fleet is not None:
            self.fleet.drain()
        self._stop.set()
        self._wake.set()

    async def serve(self) -> int:
        s = self.settings
        self._loop = loop = asyncio.get_running_loop()
        self._stop, self._wake = asyncio.Event(), asyncio.Event()
        self._fleet_started = asyncio.Event()  # every other front end listens (or their start failed)
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, self.request_stop)
        if self.fleet is not None:
            # SO_REUSEPORT would share a port that another server (of the same user) holds with it:
            # a plain bind of each port first refuses that instead.
            checks = ((s.http_port, bind_error(s.host, s.http_port)),
                      (s.grpc_port, grpc_port_taken(s.host, s.grpc_port)))  # (grpc binds more addresses)
            taken = [f"{host_port(s.host, p)} ({why})" for p, why in checks if why is not None]
            if taken:
                log.error("cannot listen on %s", ", ".join(taken))
                return EXIT_CANNOT_LISTEN
        if not await self.endpoint.start(s.http_port, s.grpc_port, reuse_port=self.fleet is not None):
            return EXIT_CANNOT_LISTEN
        self.http_port, self.grpc_port = self.endpoint.http_port, self.endpoint.grpc_port
        metrics_server = None
        if s.metrics_port:
            registry = self.metrics.registry if self.fleet is None else _Gathered(self.fe)
            try:
                metrics_server = serve_metrics(s.host, s.metrics_port, registry)
            except OSError as err:
                log.error("the metrics server cannot listen on %s: %s", host_port(s.host, s.metrics_port), err)
                await self.endpoint.stop(time.monotonic())
                return EXIT_CANNOT_LISTEN
        metrics_at = f", metrics on {host_port(s.host, s.metrics_port)}" if s.metrics_port else ""
        log.info("serving HTTP (%s) on %s, gRPC on %s%s (pid %d)", s.http_impl, host_port(s.host, self.http_port),
                 host_port(s.host, self.grpc_port), metrics_at, os.getpid())

        supervisor = loop.create_task(self._supervise())
        supervisor.add_done_callback(self._supervisor_ended)
        if self.fleet is not None:  # the other front ends start while the rank group does
            try:
                await asyncio.to_thread(self.fleet.start, self.http_port, self.grpc_port)
            except MoEError as err:
                log.error("%s", err)
                self.exit_code = 1
                self.request_stop()
            finally:
                self._fleet_started.set()
        await self._stop.wait()

        drain_end = time.monotonic() + (s.drain_timeout_s if self.exit_code == 0 else 0.0)
        if self.exit_code == 0:
            waits = [self.batcher.wait_idle(s.drain_timeout_s)]
            if self.fleet is not None:  # the other front ends drain at the same time, their steps still run here
                waits.append(asyncio.to_thread(self.fleet.wait_exit, s.drain_timeout_s + FRONTEND_STOP_GRACE_S))
            drained = all(await asyncio.gather(*waits))
            log.info("drain %s; stopping", "complete" if drained else
                     f"timed out with {self.batcher.pending} requests left here")
        # The supervisor returns at its next check; a group start in progress is let finish
        # (a start cannot be interrupted safely) and then closed below.
        await asyncio.gather(supervisor, return_exceptions=True)
        if self.fleet is not None:  # no front end is left to send steps when the group closes
            await asyncio.to_thread(self.fleet.stop)
        # Steps still in flight (those of requests past their deadline) get what is left of the
        # drain; the step threads are joined, so none is inside group.run when the group closes.
        await self.endpoint.stop(drain_end)
        if metrics_server is not None:  # (shutdown waits for serve_forever's next poll, up to 0.5 s)
            await asyncio.to_thread(metrics_server.shutdown)
            metrics_server.server_close()
        if self.group is not None:
            await asyncio.to_thread(self.group.close)
            self.group = None
        log.info("stopped")
        return self.exit_code

    # ---- supervision -----------------------------------------------------------------------

    def _on_remote_failure(self, group, exc: BaseException) -> None:
        """A step of another front end failed (called in the fleet's thread for its slot)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_step_failure, group, exc)

    def _on_step_failure(self, group, exc: BaseException) -> None:
        if group is not None and group in (self.group, self._attached):
            log.error("a step failed: %s", exc)
            self._failed = self.group  # (front end 0's steps report its SlotShare of the group)
            self._wake.set()

    async def _supervise(self) -> None:
        failures = 0  # since the last group that served HEALTHY_RESET_S: the back-off's exponent
        # What --max-restart-failures counts: failures in a row, each a start that failed or a group
        # that failed within HEALTHY_RESET_S of turning ready (a GPU that passes the warm-up and dies
        # on the first batches is a crash loop, not a recovery); a group that served longer ends the row.
        row = 0
        first = True
        generation = 0  # of the attached group: a front end's step for an older one is refused
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
                await self._close(group)
                if self._stopping:
                    return
                if first:
                    log.error("the rank group did not start: %s", exc)
                    # 2: a setting or the weights refused (the ranks refuse a backend or a checkpoint's values)
                    self.exit_code = 2 if isinstance(exc, (ConfigError, WeightsError)) else 1
                    self.request_stop()
                    return
                failures += 1
                row += 1
                if self._give_up(row, exc):
                    return
                delay = self._backoff(failures)
                log.error("restarting the rank group failed (%s); next try in %.1f s", exc, delay)
                self.metrics.worker_restarts.inc()
                await self._pause(delay)
                continue
            first = False
            if self.regions is not None:  # its slots are never a client's region (their rows are others')
                self.regions.reserve(slot.owner_fd for slot in group.slots if slot.owner_fd >= 0)
            self.metrics.use_backend(group.backend)
            generation += 1
            if self.fleet is not None:
                # The first group may be up before the other front ends are (each imports, then
                # listens); attach only knows those started, so the owner would turn ready while
                # they do not listen yet, and every client would reach it alone.
                await self._fleet_started.wait()
                if self._stopping:
                    return  # serve() closes self.group
                if not group.poll():  # a rank died during that wait (seconds): never turn ready on it
                    log.error("a rank process of the group exited while the front ends started; restarting it")
                    self.group = None
                    await self._close(group)
                    if self._stopping:  # (a SIGTERM during that close is a drain, not a give-up)
                        return
                    failures += 1
                    row += 1
                    if self._give_up(row, "a rank process exited while the front ends started"):
                        return
                    self.metrics.worker_restarts.inc()
                    await self._pause(self._backoff(failures))
                    continue
            self._attached = group if self.fleet is None else self.fleet.share(group)
            self.batcher.attach(self._attached)
            if self.fleet is not None:  # ready once every front end serves it; the owner serves meanwhile
                if not self._stopping:
                    self.fe.accept()
                await asyncio.to_thread(self.fleet.attach, group, generation)
            self.fe.set_ready(not self._stopping)
            log.info("ready (rank pids %s)", getattr(group, "pids", "?"))
            since = time.monotonic()
            await self._watch(group)
            if self._stopping:
                return  # serve() drains and closes the group
            why = "the rank group failed; it is being restarted"
            self.fe.set_ready(False, why)
            self.batcher.detach(GroupUnavailable(why))
            if self.fleet is not None:
                self.fleet.detach(why)
            self.group = self._attached = None
            await self._close(group)
            if self._stopping:
                return
            served = time.monotonic() - since
            if served > HEALTHY_RESET_S:
                failures = row = 0
            else:
                row += 1
            failures += 1
            if self._give_up(row, f"the group failed {served:.0f} s after it turned ready"):
                return
            delay = self._backoff(failures)
            log.warning("the rank group failed; restart %d in %.1f s", failures, delay)
            self.metrics.worker_restarts.inc()
            await self._pause(delay)

    async def _close(self, group) -> None:
        """Close a failed (or unused) group. Whatever that raises is logged and not let through: the
        supervisor must go on to start the next group (a close that raised once left the server
        live and never ready again)."""
        try:
            await asyncio.to_thread(group.close)
        except Exception:  # noqa: BLE001  a bug in the close, not a reason to stop supervising
            log.exception("closing the rank group raised; going on")

    def _supervisor_ended(self, task: asyncio.Task) -> None:
        """The supervisor returns only on stop; if it raised, no group would ever be started again
        and the server would stay live and unready for good: say why and stop (exit 1), so that
        the orchestrator restarts the pod."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("the supervisor of the rank group failed; stopping (exit 1)", exc_info=exc)
        if not self._stopping:
            self.exit_code = 1
            self.request_stop()

    def _give_up(self, failures: int, why: object) -> bool:
        """After --max-restart-failures failures in a row (failed starts, and groups that failed
        within HEALTHY_RESET_S of turning ready; `row` in _supervise), stop the server with EXIT_RESTARTS_FAILED: a pod
        whose GPUs or driver went bad must not stay live for ever holding them; the orchestrator
        restarts or reschedules it. Nothing is in flight by then (the failed group's requests got
        503 when it was detached; later ones are refused)."""
        limit = self.settings.max_restart_failures
        if not limit or failures < limit:
            return False
        log.error("the rank group failed %d times in a row, none serving %.0f s (last: %s); giving up: exit %d "
                  "(--max-restart-failures %d)", failures, HEALTHY_RESET_S, why, EXIT_RESTARTS_FAILED, limit)
        self.exit_code = EXIT_RESTARTS_FAILED
        self.request_stop()
        return True

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake up for a stop request."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    def _backoff(self, failures: int) -> float:
        return backoff_s(self.settings.restart_backoff_s, failures - 1)

    async def _watch(self, group) -> None:
        """Return when the group fails (a step failed, a rank process is gone or, while idle, a
        rank does not answer the heartbeat) or on stop."""
        while not self._stopping:
            if self._failed is group:  # (a step of another front end may fail before this loop runs)
                return
            if not group.poll():
                log.error("a rank process of the group has exited")
                return
            try:
                await asyncio.to_thread(group.heartbeat)
            except (WorkerError, GroupUnavailable) as exc:
                log.error("the rank group failed its heartbeat: %s", exc)
                return
            if self._failed is group:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), WATCH_INTERVAL_S)

    def _warm_up(self, group) -> None:
        """One full step checked against the fp32 reference: the group is right before it is ready."""
        s = self.settings
        warm_up(group, self.cfg, expert_source(self.cfg, s.weights, self.weights_prefix, s.seed), s.step_timeout_s)


class _Gathered:
    """A registry for prometheus_client's own metrics server (another thread): every front end's sum."""

    def __init__(self, fe: Frontend):
        self.fe = fe

    def collect(self):
        return merge(self.fe.gather()).families


# ---- entry point (flags: service.cli) ------------------------------------------------------


def serve(settings: Settings) -> int:
    """Run the service with these settings until SIGTERM; the exit status of the process."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logfilter.install()
    unknown = unknown_variables()
    if unknown:
        log.warning("ignored: %s name no setting (the settings: moe-serve --help)", ", ".join(unknown))
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
