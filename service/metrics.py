"""Every Prometheus metric of the service, declared once.

Metrics live in the front ends only: ranks report their timings with each finished step
(no Prometheus multiprocess mode). With several front-end processes (service.fleet) each keeps
its own registry and a scrape of any of them answers the sum over all of them (`Snapshot`,
`merge`): the owner gathers every process's snapshot on demand.

Names carry the `moe_` prefix and base units; every label takes values from a fixed, small set.
The registry also carries the standard process_* and python_info series (the owner's, when
merged), and no `_created` series (Prometheus reads counter resets by itself; the extra series
only double the exposition).

Series known in advance are exported from the start, so dashboards and alerts see zeros rather
than "no data"; those of a backend appear once the rank group says which one runs
(`use_backend`), so a replica running serial never shows empty "fused" legend entries.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Metric,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from service.api import arena_objects

# 50 microseconds to 60 seconds, roughly 1-2.5-5 per decade, with a bound at 30 s (the default
# request deadline, request_timeout_s) and one past it, so that requests that ran into their
# deadline are told apart from those just under it.
TIME_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(0, 17))  # 1 .. 65536 tokens

PROTOCOLS = ("http_json", "http_safetensors", "v2_json", "v2_binary", "grpc")
# Stage labels of each backend (service.moe.serial, service.moe.fused); "fused" is the whole
# captured graph, the fused names after it are its launches when it runs without the graph.
# copy_in: the rank's host-to-device copies of its rows (a CUDA rank adds them to either backend's
# stages; a CPU rank reads the slot itself, so its serial copy_in series stays at zero).
SERIAL_STAGES = ("copy_in", "tables", "all_gather", "scatter", "gemm1", "swiglu", "gemm2", "combine",
                 "reduce_scatter")
FUSED_STAGES = ("copy_in", "fused", "stage", "exchange", "kernel1", "kernel2", "reduce")
STAGES = tuple(dict.fromkeys(SERIAL_STAGES + FUSED_STAGES))  # each once, in order
# What each backend reports: the fused one also times its tables when it runs without the graph.
BACKEND_STAGES = {"serial": SERIAL_STAGES, "fused": ("tables",) + FUSED_STAGES}


COMPUTE_PHASES = ("compute_input", "compute_infer", "compute_output")  # Triton's statistics names
STEP_PARTS = ("group", "rank")  # moe_step_seconds{part}: the owner's wall of a step, rank 0's
# moe_step_phase_seconds{phase}: a step's wall in the owner cut at host timestamps (CLOCK_MONOTONIC,
# one clock for every process of the host), in order; they add up to part=group. Rank 0's: to_rank
# (the owner's send to the step message read: pipe, wake-up, a step ahead in the pipe), copy_in (its
# rows' host-to-device copies issued), launch (layer.forward: the CPU layer's whole work, a GPU
# layer's launches; on CPU ranks of one host also rank 0's wait for its peers at the shared
# barrier), device (waiting for the GPU layer), copy_out (the answer into the slot), checks
# (check_seq, stage times, exposed communication); then peers (rank 0's answer to the last rank's),
# to_owner (the last answer sent to the owner holding all of them), owner (to run's return: the hand-off
# to the step's own thread). A step a CUDA rank enqueued behind another (rank lookahead, StepStats.behind)
# keeps the same cuts: its to_rank is short (its message was read while the step before ran), its
# device holds the rest of the step before it (that step's device time and rank 0 finishing it).
STEP_PHASES = ("to_rank", "copy_in", "launch", "device", "copy_out", "checks", "peers", "to_owner", "owner")


@dataclasses.dataclass
class Duration:
    """A count and a cumulative time, as Triton's statistics report them."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += round(seconds * 1e9)


class ObjectsWindow:
    """The wire arena's window for gRPC messages (--wire-arena-grpc: service.api.arena_objects), read
    from its allocator at each scrape: all zero where the process has none. A window full of long-lived
    objects shows as used bytes that do not fall back between loads and a no-room count that grows."""

    def collect(self):
        now = arena_objects.stats()
        yield GaugeMetricFamily("moe_wire_arena_objects_bytes",
                                "Bytes of the wire arena's gRPC window in blocks held by live objects now.",
                                value=now["used_bytes"])
        yield GaugeMetricFamily("moe_wire_arena_objects_blocks",
                                "Live objects in the wire arena's gRPC window now.", value=now["blocks"])
        yield GaugeMetricFamily("moe_wire_arena_objects_free_extents",
                                "Free extents of the wire arena's gRPC window now (1 per front end when nothing "
                                "is held; many with little free space: fragmented).", value=now["free_extents"])
        yield CounterMetricFamily("moe_wire_arena_objects_placed",
                                  "Objects (gRPC messages and responses, and any other object of 64 KiB or more "
                                  "made on the event loop) placed in the wire arena's gRPC window.",
                                  value=now["placed_total"])
        yield CounterMetricFamily("moe_wire_arena_objects_no_room",
                                  "Objects of 64 KiB or more made on the event loop that found no room in the "
                                  "wire arena's gRPC window and went to the heap (their rows then take the copies).",
                                  value=now["no_room_total"])


class Metrics:
    """The service's metrics on their own registry (one per front end; tests make several)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        disable_created_metrics()  # process-wide in prometheus_client; every registry here wants it
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.request_duration = Histogram(
            "moe_request_duration_seconds",
            "Time from a request's arrival (HTTP: its first byte on the connection; gRPC: its message "
            "reaching the server's deserializer, after grpc's own receive) to its answer, before the send.",
            ["protocol", "status"], buckets=TIME_BUCKETS, registry=r)
        self.request_receive = Histogram(
            "moe_request_receive_seconds",
            "The receive part of moe_request_duration_seconds: HTTP from the request's first byte to its "
            "whole body read by the handler, gRPC from the deserializer's start to the handler.",
            ["protocol"], buckets=TIME_BUCKETS, registry=r)
        self.response_send = Histogram(
            "moe_response_send_seconds",
            "HTTP v2 infer: time from a response's start to its last byte handed to the kernel, or to the "
            "transport's buffer where the socket is full (after moe_request_duration_seconds); with --send-threads, "
            "to when the last thread send returned, the rest of a partial send then in the transport's buffer.",
            ["protocol"], buckets=TIME_BUCKETS, registry=r)
        self.requests = Counter(
            "moe_requests_total", "Requests answered, by protocol and status code.",
            ["protocol", "status"], registry=r)
        self.queue_time = Histogram(
            "moe_queue_time_seconds", "Time a request's first rows waited before their step started.",
            buckets=TIME_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "moe_batch_tokens", "Tokens in one step of the rank group.",
            buckets=TOKEN_BUCKETS, registry=r)
        self.layer_time = Histogram(
            "moe_layer_seconds", "Time of the MoE layer for one step, measured on rank 0.",
            ["backend"], buckets=TIME_BUCKETS, registry=r)
        self.stage_time = Histogram(
            "moe_stage_seconds", "Time of one stage of the layer for one step, measured on rank 0.",
            ["stage"], buckets=TIME_BUCKETS, registry=r)
        self.exposed_comm = Histogram(
            "moe_exposed_comm_seconds",
            "Communication time not hidden behind compute, per step (serial backend: all time in "
            "collectives; see service.moe.serial).",
            ["backend"], buckets=TIME_BUCKETS, registry=r)
        self.step_time = Histogram(
            "moe_step_seconds",
            "Wall time of one step: part=group in the process that owns the rank group (sent to answered: "
            "the pipes, and any wait behind a step in flight), part=rank on rank 0 (step message received "
            "to answer ready to send: its copies, the layer, its checks).",
            ["part"], buckets=TIME_BUCKETS, registry=r)
        self.step_phase_time = Histogram(
            "moe_step_phase_seconds",
            "A step's wall time in the process that owns the rank group, by phase (STEP_PHASES in "
            "service.metrics: the pipes, rank 0's copies, launches, device wait and checks, the other ranks); "
            "the phases add up to moe_step_seconds{part=group}.",
            ["phase"], buckets=TIME_BUCKETS, registry=r)
        self.tokens = Counter("moe_tokens_total", "Tokens processed by the layer.", registry=r)
        self.steps = Counter("moe_steps_total", "Steps run by the rank group.", registry=r)
        self.steps_behind = Counter(
            "moe_steps_behind_total",
            "Steps rank 0 enqueued while the step before was still in flight (rank lookahead, "
            "--rank-lookahead 2): the share of moe_steps_total whose host work the device did not wait for.",
            registry=r)
        self.queued_tokens = Gauge("moe_queued_tokens", "Tokens waiting in the batcher's queue.", registry=r)
        self.inflight = Gauge("moe_inflight_requests", "Requests accepted and not yet answered.", registry=r)
        self.worker_restarts = Counter(
            "moe_worker_restarts_total", "Restarts of the rank group after a failure.", registry=r)
        self.ready = Gauge("moe_ready", "1 when the service answers inference requests, else 0.", registry=r)
        self.arena_full = Counter(
            "moe_wire_arena_full_total",
            "v2 binary request bodies, and their answers, that found no room in the front end's wire arena "
            "(--wire-arena-mib) and took the front end's copies instead.", registry=r)
        self.arena_rows = Counter(
            "moe_wire_arena_rows_total",
            "Request rows the ranks read from the front end's wire arena and answered into it (the front end "
            "copied them neither way): v2 binary bodies and, with --wire-arena-grpc, gRPC messages.", registry=r)
        r.register(ObjectsWindow())
        # Per answered request, the time of the steps its rows ran in, by phase: rows copied into
        # the slot, the layer, answers copied out (for the model statistics, not exported here).
        self.request_compute = {phase: Duration() for phase in COMPUTE_PHASES}
        for protocol in PROTOCOLS:
            self.request_duration.labels(protocol, "200")

    def use_backend(self, backend: str) -> None:
        """Export the zero series of `backend` (a key of BACKEND_STAGES) and its stages: the group runs it."""
        self.layer_time.labels(backend)
        self.exposed_comm.labels(backend)
        for part in STEP_PARTS:
            self.step_time.labels(part)
        for phase in STEP_PHASES:
            self.step_phase_time.labels(phase)
        for stage in BACKEND_STAGES[backend]:
            self.stage_time.labels(stage)

    def observe_request_compute(self, seconds: tuple[float, float, float]) -> None:
        """Record one answered request's compute time by phase (COMPUTE_PHASES order)."""
        for phase, s in zip(COMPUTE_PHASES, seconds, strict=True):
            self.request_compute[phase].add(s)

    def observe_step(self, stats) -> None:
        """Record one finished step (a `service.worker.group.StepStats`)."""
        self.steps.inc()
        if stats.behind:
            self.steps_behind.inc()
        self.tokens.inc(stats.tokens)
        self.batch_tokens.observe(stats.tokens)
        self.layer_time.labels(stats.backend).observe(stats.layer_s)
        self.exposed_comm.labels(stats.backend).observe(stats.exposed_comm_s)
        self.step_time.labels("group").observe(stats.wall_s)
        self.step_time.labels("rank").observe(stats.rank_wall_s)
        for phase, seconds in stats.phases.items():
            self.step_phase_time.labels(phase).observe(seconds)
        for stage, seconds in stats.stages.items():
            self.stage_time.labels(stage).observe(seconds)


# Families a merge takes from the first snapshot (the owner's) instead of summing: the process's
# own series, and readiness (every process follows the owner's view of the group).
FIRST_ONLY_PREFIXES = ("process_", "python_", "moe_ready")


@dataclasses.dataclass
class Snapshot:
    """One front-end process's metrics and Triton statistics at one moment (picklable)."""

    families: list[Metric]
    inference_count: int = 0
    last_inference_ms: int = 0
    request_compute: dict[str, Duration] = dataclasses.field(default_factory=dict)

    def collect(self) -> list[Metric]:  # a registry for prometheus_client's encoders
        return self.families

    def value(self, name: str, **labels: str) -> float | None:
        """The sample's value (summed over label values not named), None if absent."""
        found = [s.value for f in self.families for s in f.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(found) if found else None


def merge(snapshots: list[Snapshot]) -> Snapshot:
    """The sum of several processes' snapshots: counters, histograms and the queue gauges add up;
    FIRST_ONLY_PREFIXES families are the first snapshot's."""
    first, rest = snapshots[0], snapshots[1:]
    order: list[str] = []
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, list]] = {}
    for i, snap in enumerate(snapshots):
        for family in snap.families:
            if i and family.name.startswith(FIRST_ONLY_PREFIXES):
                continue
            if family.name not in merged:
                order.append(family.name)
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                sums[family.name] = {}
            samples = sums[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key in samples:
                    samples[key][1] += s.value
                else:
                    samples[key] = [s, s.value]
    for name in order:
        merged[name].samples = [s._replace(value=v) for s, v in sums[name].values()]
    compute = {phase: Duration(d.count, d.ns) for phase, d in first.request_compute.items()}
    for snap in rest:
        for phase, d in snap.request_compute.items():
            total = compute.setdefault(phase, Duration())
            total.count += d.count
            total.ns += d.ns
    return Snapshot([merged[n] for n in order], sum(s.inference_count for s in snapshots),
                    max(s.last_inference_ms for s in snapshots), compute)


# ---- the --metrics-port listener -----------------------------------------------------------

METRICS_PATH = "/metrics"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002  (wsgiref's signature) one line per scrape
        pass


def serve_metrics(host: str, port: int, registry) -> WSGIServer:
    """The --metrics-port listener, in a daemon thread (stop it with `.shutdown()`): prometheus_client's
    exposition (the format chosen by Accept, gzip on Accept-Encoding) at METRICS_PATH, a 404 on every
    other path (prometheus_client's own start_http_server answers any path with the metrics)."""
    exposition = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: this port serves only {METRICS_PATH}\n".encode()]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")])
            return [b"GET or HEAD\n"]
        # The whole exposition, whatever the query: a gathered fleet's registry has no name[] filter
        # (prometheus_client raised on one: a 500 and a traceback on stderr).
        body = exposition({**environ, "QUERY_STRING": "", "REQUEST_METHOD": "GET"}, start_response)
        return [] if environ["REQUEST_METHOD"] == "HEAD" else body

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family  # an IPv6 --host binds an IPv6 socket

    server = make_server(host, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    return server
