"""The real front end, no GPU: where a request's milliseconds go outside the layer.

    python bench/frontend_load.py [--protocols v2_binary,grpc,v2_shm,grpc_shm] [--sizes 512,2048] [--concurrency 1,4]
        [--step-ms 1.4] [--seconds 3] [--client raw|stock] [--timeline] [--server-flags "..."]
        [--trees floor,floor@sync,floor@server=V@client=V,BASE,.,.@uvloop] [--reps 2]

A `service.server.Server` (HTTP on uvicorn, gRPC on grpc.aio, the batcher, shared-memory slots:
everything the front end runs) is started in its own process (`frontend_load.py serve ...`) on the
seed shape (E=64, H=4096, K=8, bf16, R=1, C=512) with bench/standin_serve.py's stand-in rank group:
one step at a time (as on one GPU), each sleeping --step-ms (the H200's layer time at 512 tokens,
1.4 ms) and copying slot.x into slot.out, so what is measured is the front end alone. Load:
bench/serve_load.py's closed-loop client processes (one per concurrent caller); `--client raw`
replaces its HTTP client (http.client) with a raw-socket one (sendall the prepared request,
recv_into one preallocated buffer) so that the load generator is not what is timed (its gRPC client
is grpc's own, bytes in, bytes out). v2_shm and grpc_shm are Triton's system shared memory
(serve_load.ShmJob: the tensors in the client's regions, the request and answer without data; the
servers then get `--shared-memory system`). The front end runs on one torch thread, as the server's
does on every device.

`--trees` starts one server per entry and alternates every cell between them (`--reps` rounds):
a checkout's root (its `service` is imported: before/after in one run), `PATH@uvloop` (that server
on uvloop's loop), or `floor`: bench/frontend_floor.py, the same exchange with no front end
(`floor@sync`: its gRPC on a synchronous grpc.server; `floor@server=V`: with frontend_floor's
transport variant V). `@client=V` after any entry gives the bench's gRPC client variant V's
channel arguments (what a user's client could set), e.g. `floor,floor@server=all@client=all`;
`@MOE_X=V` serves that entry with the setting MOE_X=V in its environment (`.,.@MOE_COPY_THREADS=2`).

`--timeline` (concurrency 1 only): the server records timestamps of each request (HTTP: first
byte read, headers, body complete, decoded, submitted, step start, rows in the slot, group.run
back, answer encoded, response written to the transport; gRPC: message handed to the
deserializer, handler entered, decoded, ..., serializer done) and the raw client its own (send
start, sent, first answer byte, answer read); both use CLOCK_MONOTONIC (time.perf_counter), so
the median of each gap is printed as one table. The hooks are this script's wrappers around the
service's functions, installed only in that server process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

import serve_load
from frontend_floor import TRANSPORT
from standin_serve import StandInGroup, StandInServer

from service.api import batcher as batcher_mod
from service.api import codecs, connections, grpc_codec
from service.api import grpc as grpc_mod
from service.api import http as http_mod
from service.cli import parse_settings
from service.config import Settings

# ---- server-side timeline (installed by `serve --timeline`) -------------------------------------

RECORDS: list[dict] = []  # one per request, in order; the server appends, at concurrency 1
_current: dict | None = None
_enabled = False


def mark(event: str, new: bool = False) -> None:
    """Timestamp `event` on the current request's record (`new`: this event opens a record)."""
    global _current
    if not _enabled:
        return
    if new or _current is None:
        _current = {}
        RECORDS.append(_current)
    _current.setdefault(event, time.perf_counter())


def _wrap(owner, name: str, before: str | None = None, after: str | None = None, new: bool = False) -> None:
    fn = getattr(owner, name)

    if asyncio.iscoroutinefunction(fn):
        async def wrapped(*a, **k):
            if before:
                mark(before, new)
            out = await fn(*a, **k)
            if after:
                mark(after)
            return out
    else:
        def wrapped(*a, **k):
            if before:
                mark(before, new)
            out = fn(*a, **k)
            if after:
                mark(after)
            return out
    setattr(owner, name, wrapped)


def install_timeline() -> None:
    global _enabled
    _enabled = True
    bounded = connections.bounded_protocol

    def timed_protocol(*args):
        cls = bounded(*args)

        class Timed(cls):  # type: ignore[misc, valid-type]
            def data_received(self, data: bytes) -> None:
                if not self.busy:  # the first bytes of a new request
                    mark("first_byte", new=True)
                super().data_received(data)

            def on_response_complete(self) -> None:
                mark("response_complete")
                super().on_response_complete()
        return Timed

    import service.server as server_mod
    server_mod.bounded_protocol = timed_protocol
    _wrap(http_mod, "read_body", before="headers", after="body_read")
    _wrap(codecs, "decode_v2_http", before="decode_start", after="decoded")
    _wrap(grpc_codec, "parse_grpc_request", before="grpc_message", new=True)
    _wrap(grpc_mod.InferenceServicer, "ModelInfer", before="handler")
    _wrap(grpc_codec, "decode_grpc", before="decode_start", after="decoded")
    _wrap(batcher_mod.Batcher, "submit", before="submitted", after="answered")
    _wrap(batcher_mod.Batcher, "_execute", before="slot_copy")
    _wrap(StandInGroup, "run", before="step_start", after="run_back")
    _wrap(codecs, "encode_v2_http", after="encoded")
    _wrap(grpc_codec, "grpc_response", after="response_made")  # made before the step; the copy out writes its rows
    _wrap(grpc_codec, "serialize_grpc_response", after="serialized")
    _wrap(http_mod.PartsResponse, "__call__", after="written")


def serve(args) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.timeline:
        install_timeline()
    settings = parse_settings(["--host", "127.0.0.1", "--http-port", str(args.http_port), "--grpc-port",
                               str(args.grpc_port), "--device", "cpu", "--preset", "seed", "--world-size", "1",
                               "--log-level", "WARNING", *args.server_flags.split()])
    holder = types.SimpleNamespace(server=None)

    def factory():
        return StandInGroup(holder.server.cfg, settings.slots, args.step_ms / 1e3)

    # The front end keeps the torch threads the server gives it (one, service.fleet.set_frontend_threads,
    # on every device): torch's default here (2 on this VM, 16 on an H200 host) measured OpenMP teams
    # spinning in the step threads, 2-4x the p50 on a busy VM (bench/NOTES.md, issue 11q).
    holder.server = StandInServer(settings, group_factory=factory)
    if args.loop == "uvloop":  # the service runs asyncio's loop; this measures what uvloop would change
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            code = runner.run(holder.server.serve())
    else:
        code = asyncio.run(holder.server.serve())
    if args.timeline:
        with open(args.timeline, "w") as f:
            json.dump(RECORDS, f)
    return code


class Clients(serve_load.Clients):
    """serve_load's client processes; HTTP through its raw-socket client when asked."""

    def __init__(self, n: int, raw: bool):
        super().__init__(n, serve_load.raw_client if raw else None)
        self.raw = raw


# ---- the timeline's table -------------------------------------------------------------------------

HTTP_EVENTS = ["send_start", "first_byte", "headers", "body_read", "decode_start", "decoded", "submitted",
               "slot_copy", "step_start", "run_back", "answered", "encoded", "written", "response_complete",
               "first_answer_byte", "answer_read"]
GRPC_EVENTS = ["send_start", "grpc_message", "handler", "decode_start", "decoded", "response_made", "submitted",
               "slot_copy", "step_start", "run_back", "answered", "serialized", "answer_read"]
CLIENT_EVENTS = ("send_start", "sent", "first_answer_byte", "answer_read")


def timeline_table(records: list[dict], stamps: list[tuple], proto: str) -> list[tuple[str, float, float]]:
    """(gap, median us, p90 us) of consecutive events, each server record matched to the client
    request whose [send start, answer read] holds its first event."""
    events = HTTP_EVENTS if proto.startswith("v2") else GRPC_EVENTS
    joined = []
    recs = sorted(records, key=lambda r: min(r.values()))
    i = 0
    for st in sorted(stamps):
        client = dict(zip(CLIENT_EVENTS, st, strict=True))
        while i < len(recs) and min(recs[i].values()) < client["send_start"]:
            i += 1
        if i < len(recs) and min(recs[i].values()) <= client["answer_read"]:
            joined.append({**recs[i], **client})
            i += 1
    rows = []
    present = [e for e in events if joined and all(e in j for j in joined)]
    for a, b in zip(present, present[1:], strict=False):
        gaps = sorted((j[b] - j[a]) * 1e6 for j in joined)
        rows.append((f"{a} -> {b}", statistics.median(gaps), gaps[int(0.9 * (len(gaps) - 1))]))
    total = sorted((j["answer_read"] - j["send_start"]) * 1e6 for j in joined)
    if total:
        rows.append(("total (client)", statistics.median(total), total[int(0.9 * (len(total) - 1))]))
    rows.append(("requests matched", len(joined), len(stamps)))
    return rows


# ---- main ---------------------------------------------------------------------------------------


def parse_tree(tree: str | None) -> tuple[str, dict[str, str]]:
    """A `--trees` entry: PATH[@MOD]...: the path and its modifiers (`uvloop`: the server's loop;
    `sync`: floor only, gRPC on a synchronous grpc.server; `server=V`: floor only, the server's
    gRPC transport variant V of frontend_floor.TRANSPORT; `client=V`: the bench client's channel
    arguments, the same variants; `MOE_X=V`: that server's environment has MOE_X=V, where x is a field
    of service.config.Settings: a misspelt setting is an error, not a server run with the default)."""
    path, *mods = (tree or "").split("@")
    parsed = dict(m.partition("=")[::2] for m in mods)
    unknown = {m for m in parsed if (m.removeprefix("MOE_").lower() not in Settings.model_fields
                                     if m.startswith("MOE_") else m not in {"uvloop", "sync", "server", "client"})}
    if unknown:
        raise SystemExit(f"--trees: unknown modifiers {sorted(unknown)} in {tree!r} (a MOE_ one names no setting "
                         "of service.config.Settings)")
    if path != "floor" and {"sync", "server"} & set(parsed):
        raise SystemExit(f"--trees: sync and server= apply to the floor only, in {tree!r}")
    for key in ("server", "client"):
        if key in parsed and parsed[key] not in TRANSPORT:
            raise SystemExit(f"--trees: {key}={parsed[key]} is not one of {sorted(TRANSPORT)}")
    return path, parsed


def tree_name(tree: str | None) -> str:
    if tree is None:
        return "this tree"
    path, _, mods = tree.partition("@")
    name = "floor" if path == "floor" else "this tree" if os.path.samefile(path, ".") else \
        os.path.basename(os.path.normpath(path))
    return f"{name} ({mods.replace('@', ', ')})" if mods else name


def start(args, timeline_path: str | None, tree: str | None = None):
    """The server process, importing `service` from `tree` (a checkout's root; `@uvloop` after it:
    on uvloop's event loop) when given."""
    http_port, grpc_port = serve_load._free_port(), serve_load._free_port()
    tree, mods = parse_tree(tree)
    if tree == "floor":
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "frontend_floor.py"),
               "--http-port", str(http_port), "--grpc-port", str(grpc_port),
               "--grpc-server", "sync" if "sync" in mods else "aio", "--transport", mods.get("server", "stock")]
    else:
        cmd = [sys.executable, __file__, "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
               "--step-ms", str(args.step_ms), "--server-flags", args.server_flags,
               "--loop", "uvloop" if "uvloop" in mods else "asyncio"]
    if timeline_path:
        cmd += ["--timeline", timeline_path]
    log_path = os.path.join(tempfile.gettempdir(), f"frontend-load-{os.getpid()}-{http_port}.log")
    path = None if tree in ("", "floor") else tree
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])),
               **{k: v for k, v in mods.items() if k.startswith("MOE_")})
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 120
    while serve_load._get(url + "/v2/health/ready", 2)[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start; see {log_path}")
        time.sleep(0.2)
    return proc, url, (f"127.0.0.1:{grpc_port}", TRANSPORT[mods.get("client", "stock")]), log_path


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        p = argparse.ArgumentParser()
        p.add_argument("mode")
        p.add_argument("--http-port", type=int, required=True)
        p.add_argument("--grpc-port", type=int, required=True)
        p.add_argument("--step-ms", type=float, default=1.4)
        p.add_argument("--timeline")
        p.add_argument("--server-flags", default="")
        p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
        args = p.parse_args()
        return serve(args)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocols", default="v2_binary,grpc")
    p.add_argument("--sizes", default="512,2048")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--step-ms", type=float, default=1.4, help="the stand-in step's sleep")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--client", choices=("raw", "stock"), default="raw", help="HTTP client: raw socket or http.client")
    p.add_argument("--timeline", action="store_true", help="per-request timestamps (concurrency 1)")
    p.add_argument("--server-flags", default="", help="extra moe-serve flags for the server, one string")
    p.add_argument("--trees", default="", help="comma-separated checkouts whose `service` the servers import, "
                   "e.g. a baseline and this tree, or `floor` (a bare asyncio / grpc.aio echo of the same sizes); "
                   "PATH@uvloop runs that server on uvloop: cells alternate between them (default: this tree)")
    p.add_argument("--reps", type=int, default=1, help="times each cell is run (per tree, interleaved)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    conc = [int(c) for c in args.concurrency.split(",")]
    trees = args.trees.split(",") if args.trees else [None]
    if args.timeline:
        conc, trees = [1], trees[:1]
    if set(args.protocols.split(",")) & set(serve_load.SHM_PROTOCOLS) and "--shared-memory" not in args.server_flags:
        args.server_flags += " --shared-memory system"
    settings = parse_settings(["--device", "cpu", "--preset", "seed", "--world-size", "1",
                               *args.server_flags.split()])
    cfg = settings.layer_config("cpu")
    print(f"# stand-in group ({args.step_ms} ms per step), {cfg.describe()}, http {settings.http_impl}, "
          f"client {args.client}, {args.seconds:g} s per cell; load average {os.getloadavg()[0]:.1f}", flush=True)
    timeline_path = tempfile.mktemp(suffix=".json") if args.timeline else None
    clients = Clients(max(conc), raw=args.client == "raw")
    servers = []
    results, all_stamps = [], {}
    try:
        for tree in trees:
            servers.append(start(args, timeline_path, tree))
        for T in sizes:
            tensors = serve_load._tensors(cfg, T, seed=T, wire="bf16")
            bodies = {"v2_binary": serve_load.v2_binary_body("moe", tensors),
                      "grpc": (serve_load.grpc_body("moe", tensors), 0),
                      **{proto: (tensors, 0) for proto in serve_load.SHM_PROTOCOLS}}  # (each client makes its regions)
            for proto in args.protocols.split(","):
                body, header_len = bodies[proto]
                for c in conc:
                    for rep in range(args.reps):
                        for tree, (_, url, grpc_target, _) in zip(trees, servers, strict=True):
                            target = grpc_target if proto in ("grpc", "grpc_shm") else url
                            job = (proto, target, "/v2/models/moe/infer", body, header_len, T * cfg.H * 2,
                                   serve_load.WIRE_BITS["bf16"][1])
                            lats, wall, stamps = clients.run(c, job, args.seconds)
                            all_stamps[(proto, T)] = stamps
                            q = statistics.quantiles(lats, n=100, method="inclusive")
                            name = tree_name(tree)
                            results.append((name, rep, proto, T, c, len(lats), len(lats) * T / wall, q[49] * 1e3,
                                            q[89] * 1e3))
                            print(f"  {name} {proto} T={T} c={c}: {len(lats)} requests, {len(lats) * T / wall:,.0f} "
                                  f"tok/s, p50 {q[49] * 1e3:.2f} ms", flush=True)
    finally:
        clients.close()
        for proc, *_ in servers:
            stop(proc)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}; server logs {[s[3] for s in servers]}")
    print("\n| tree | rep | protocol | T | concurrency | requests | tokens/s | p50 ms | p90 ms |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, rep, proto, T, c, n, tok, p50, p90 in results:
        print(f"| {name} | {rep} | {proto} | {T} | {c} | {n} | {tok:,.0f} | {p50:.2f} | {p90:.2f} |")
    if timeline_path:
        with open(timeline_path) as f:
            records = json.load(f)
        os.unlink(timeline_path)
        for (proto, T), stamps in all_stamps.items():
            print(f"\ntimeline {proto} T={T} (us)\n\n| gap | median | p90 |\n|---|---|---|")
            for gap, med, p90 in timeline_table(records, stamps, proto):
                print(f"| {gap} | {med:,.0f} | {p90:,.0f} |")
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # runs the finally clauses: the servers started here are stopped


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
