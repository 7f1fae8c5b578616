"""The event loop's time from an HTTP inference request's ASGI call to its handler's first line: the
server's app (service.api.http.create_app: InferenceFirst) against FastAPI's stack alone (its `.app`),
in one run, on the CPU (no server, no socket, no layer).

    python bench/http_dispatch.py [--iters 3000]

The request is POST /v2/models/moe/infer and POST /moe/forward with an empty body. The handler's
first call stamps the clock: codecs.check_model raises (the v2 handler answers 500 at once),
_media_type returns no type (/moe/forward answers 415 at once); the answers go to a no-op `send`. The two apps
alternate in rounds. Prints the p50 and p90 per app and route in us, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Stop(Exception):
    pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from service.api import codecs, frontend
    from service.api import http as http_api
    from service.api.batcher import Batcher
    from service.config import Settings, preset
    from service.metrics import Metrics

    cfg = preset("cpu")
    metrics = Metrics()
    batcher = Batcher(budget=cfg.tokens_per_step, delay_s=0.0, queue_tokens=1 << 16, slots=1, metrics=metrics)
    fe = frontend.Frontend(Settings(), cfg, metrics, batcher)
    server_app = http_api.create_app(fe)
    apps = {"server (InferenceFirst)": server_app, "FastAPI alone": server_app.app}
    reached: list[float] = []

    def stop(*_args, **_kwargs):
        reached.append(time.perf_counter())
        raise _Stop  # inside the v2 handler's `answer`: its error response, the rest of the handler skipped

    def media(*_args, **_kwargs):
        reached.append(time.perf_counter())
        return None  # outside `answer`: no content type, so the handler answers 415 at once

    logging.disable(logging.ERROR)  # each stopped request logs its traceback otherwise
    codecs.check_model = stop  # type: ignore[assignment]  (looked up at call time by the v2 handler)
    http_api._media_type = media  # type: ignore[assignment]  (the /moe/forward handler's first call)

    def scope(path: str) -> dict:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                            (b"content-length", b"0")],
                "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message):
        return None

    times: dict[tuple[str, str], list[float]] = {}

    async def run() -> None:
        for _ in range(args.rounds):
            for name, app in apps.items():
                for path in ("/v2/models/moe/infer", "/moe/forward"):
                    for i in range(args.iters):
                        reached.clear()
                        t0 = time.perf_counter()
                        await app(scope(path), receive, send)
                        assert len(reached) == 1, f"{name} {path}: the handler was not reached"
                        if i >= args.iters // 10:
                            times.setdefault((name, path), []).append((reached[0] - t0) * 1e6)

    asyncio.run(run())
    print(f"# ASGI call -> the handler's first line, us, {args.rounds} rounds of {args.iters} calls each")
    print("| app | route | p50 | p90 |\n|---|---|---|---|")
    p50 = {}
    for (name, path), v in times.items():
        p50[name, path] = statistics.median(v)
        print(f"| {name} | POST {path} | {p50[name, path]:.1f} | {statistics.quantiles(v, n=10)[8]:.1f} |")
    for path in ("/v2/models/moe/infer", "/moe/forward"):
        ratio = p50["FastAPI alone", path] / p50["server (InferenceFirst)", path]
        print(f"POST {path}: FastAPI's stack takes {ratio:.0f}x the server's dispatch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
