"""A served request's path through the front end as a timeline, from the running server's own code.

    python bench/frontend_timeline.py --out timeline.txt [--standin-step-ms 1.4] [moe-serve flags]
    (load it with ONE client, e.g. bench/serve_load.py --concurrency 1 --no-direct; SIGTERM ends it
    and writes the table)

The server runs in this process with one front end (its owner: no hop through service.fleet), as
`python -m service` would, or with --standin-step-ms in front of bench/standin_serve.py's stand-in
group (no GPU: each step sleeps that long and echoes the rows). A few of its functions are wrapped to
stamp the monotonic clock as they start and end: the HTTP body's read, the v2 and gRPC decoders and
encoders, Frontend.infer (the batcher's queue and step, seen from the handler), the step thread's
Batcher._execute and the group's run (the ranks' step); a request ends at
Frontend.observe, which also gives its first byte (HTTP; gRPC: the deserializer's start). The gaps
between consecutive stamps of each request, mean and p50 per protocol, go to --out: e.g. "infer> ->
execute>" is the hand-off from the handler through the batcher to the step thread, "execute< ->
infer<" the way back to the handler. latency_split.py gives the server's books (receive, queue,
compute_input/infer/output); this cuts what the books leave between them.

One client at a time only: the stamps of concurrent requests would interleave (a request whose stamps
are not in the one order a lone request makes is left out, and counted).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import itertools
import statistics
import sys
import time
from pathlib import Path

# After PYTHONPATH: bench/timeline_ab.sh serves another checkout's `service` with this script
sys.path.extend(str(Path(__file__).resolve().parents[i]) for i in (0, 1))

from service.api import batcher, codecs, frontend, grpc_codec  # noqa: E402
from service.api import http as http_api  # noqa: E402
from service.cli import parse_settings  # noqa: E402
from service.worker import group as group_mod  # noqa: E402

now = time.perf_counter  # the clock of FIRST_BYTE and of the gRPC request's `received`
_events: list[tuple[str, float]] = []
_requests: dict[str, list[list[tuple[str, float]]]] = collections.defaultdict(list)


def _stamp(name: str) -> None:
    _events.append((name, now()))


def _wrap(owner, attr: str, name: str) -> None:
    """owner.attr stamps `name>` as it starts and `name<` as it ends (looked up at call time by its callers)."""
    f = getattr(owner, attr)
    if asyncio.iscoroutinefunction(f):
        @functools.wraps(f)
        async def timed(*args, **kwargs):
            _stamp(name + ">")
            try:
                return await f(*args, **kwargs)
            finally:
                _stamp(name + "<")
    else:
        @functools.wraps(f)
        def timed(*args, **kwargs):
            _stamp(name + ">")
            try:
                return f(*args, **kwargs)
            finally:
                _stamp(name + "<")
    setattr(owner, attr, timed)


def instrument(group_cls) -> None:
    # the handler's first call: uvicorn's parse and the app's dispatch come before it
    _wrap(codecs, "check_model", "route")
    _wrap(http_api, "read_body", "read_body")
    _wrap(codecs, "decode_v2_http", "decode")
    _wrap(codecs, "encode_v2_http", "encode")
    _wrap(grpc_codec, "decode_grpc", "decode")
    _wrap(grpc_codec, "grpc_response", "response")
    _wrap(frontend.Frontend, "infer", "infer")
    _wrap(batcher.Batcher, "_execute", "execute")
    _wrap(group_cls, "run", "group_run")
    observe = frontend.Frontend.observe

    def observed(self, protocol: str, status: int, started: float) -> None:
        events = [("start", started), *_events, ("observe", now())]
        _events.clear()
        if status == 200:
            _requests[protocol].append(events)
        observe(self, protocol, status, started)

    frontend.Frontend.observe = observed  # type: ignore[method-assign]


def table(skip: int) -> list[str]:
    lines = []
    for protocol, requests in sorted(_requests.items()):
        kept = requests[skip:]
        orders = collections.Counter(tuple(n for n, _ in ev) for ev in kept)
        if not orders:
            continue
        order = orders.most_common(1)[0][0]  # a lone request's order
        gaps: dict[str, list[float]] = collections.defaultdict(list)
        used = 0
        for ev in kept:
            if tuple(n for n, _ in ev) != order:
                continue
            used += 1
            for (a, ta), (b, tb) in itertools.pairwise(ev):
                gaps[f"{a} -> {b}"].append((tb - ta) * 1e3)
        total = [sum(v[i] for v in gaps.values()) for i in range(used)]
        lines.append(f"## {protocol}: {used} requests of {len(kept)} in the lone order (after {skip} left out "
                     f"as warm-up); start -> observe mean {statistics.mean(total):.3f} ms")
        lines.append("| gap | mean ms | p50 ms |\n|---|---|---|")
        for key in (f"{a} -> {b}" for a, b in itertools.pairwise(order)):
            v = gaps[key]
            lines.append(f"| {key} | {statistics.mean(v):.3f} | {statistics.median(v):.3f} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the table is written here when the server stops")
    p.add_argument("--standin-step-ms", type=float, help="serve bench/standin_serve.py's stand-in group instead")
    p.add_argument("--skip", type=int, default=20, help="each protocol's first requests left out (warm-up)")
    args, flags = p.parse_known_args()
    settings = parse_settings([*flags, "--frontends", "1"])
    if args.standin_step_ms is not None:
        import logging

        from standin_serve import StandInGroup, StandInServer

        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        instrument(StandInGroup)
        server = StandInServer(settings)
        server.group_factory = lambda: StandInGroup(server.cfg, settings.slots, args.standin_step_ms / 1e3)
        rc = asyncio.run(server.serve())
    else:
        from service.server import serve

        instrument(group_mod.WorkerGroup)
        rc = serve(settings)
    Path(args.out).write_text("\n".join(table(args.skip)) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
