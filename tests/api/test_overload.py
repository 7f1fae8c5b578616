"""A second server with a tiny queue and a long batching delay, so that queueing is slow and
deterministic: overload -> 503 at once while accepted requests succeed; a deadline passing in the
queue -> 504; and last, SIGTERM: readiness drops, in-flight requests finish, exit 0.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest
import safetensors.torch

from tests.api.common import check, inputs
from tests.api.test_e2e import post_safetensors, scrape, value
from tests.serverproc import ServerProcess, free_port

QUEUE_TOKENS = 64
# Every request waits this long in the queue (the budget is never filled; idle wait on): long enough
# that what the tests do meanwhile (a rejection's round trip; after SIGTERM, readiness probes and a
# refused POST before the drain ends) fits well within it on a loaded 2-core machine, where a GET can
# take 0.6 s (1.5 s left the drain test about three such round trips: 2.5 s, five).
DELAY_MS = 2500


def process_running(pid: int) -> bool:
    """True while `pid` is a live process (not gone, not a zombie); the ranks are not our children."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    metrics_port = free_port()  # picked as the server starts, not at import minutes before
    proc = ServerProcess.module(tmp_path_factory.mktemp("overload") / "server.log",
                                "--queue-tokens", str(QUEUE_TOKENS), "--batch-delay-ms", str(DELAY_MS),
                                "--batch-idle-wait", "true",
                                "--drain-timeout-s", "20", env={"MOE_METRICS_PORT": str(metrics_port)})
    proc.metrics_port = metrics_port
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def wait_for(http, gauge: str, level: float, timeout_s: float = 30) -> None:
    """Poll /metrics until `gauge` reads `level`."""
    deadline = time.monotonic() + timeout_s
    while (now := value(scrape(http)[gauge], gauge)) != level:
        assert time.monotonic() < deadline, f"{gauge} is {now}, not {level}, after {timeout_s} s"
        time.sleep(0.01)


def test_overload_rejects_at_once_while_accepted_requests_succeed(http):
    first = inputs(40, seed=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        t_first = time.monotonic()
        accepted = pool.submit(post_safetensors, http, *first)
        wait_for(http, "moe_queued_tokens", 40)  # the first request now sits in the queue for the delay
        r = post_safetensors(http, *inputs(40, seed=2))
        took = time.monotonic() - t_first
        assert r.status_code == 503, r.text
        # Answered while the first request still waited out its delay: a rejection held until the
        # queue's step would come after it (a scrape and a round trip here: 0.6 s each when loaded)
        assert took < DELAY_MS / 1e3 and not accepted.done(), f"the rejection waited in the queue ({took:.2f} s)"
        assert "queue is full" in r.json()["error"] and r.headers["Retry-After"]
        r = accepted.result(timeout=30)
    assert r.status_code == 200, r.text
    check(safetensors.torch.load(r.content)["output"], *first)


def test_more_tokens_than_the_queue_holds(http):
    r = post_safetensors(http, *inputs(QUEUE_TOKENS + 1, seed=3))
    assert r.status_code == 413 and "queue_tokens" in r.json()["error"]


def test_deadline_in_the_queue_drops_the_work(http):
    steps = value(scrape(http)["moe_steps"], "moe_steps_total")
    r = post_safetensors(http, *inputs(8, seed=4), **{"X-Request-Timeout": "0.1"})
    assert r.status_code == 504, r.text
    time.sleep(DELAY_MS / 1e3 + 0.3)
    after = scrape(http)
    assert value(after["moe_steps"], "moe_steps_total") == steps, "an expired request reached a step"
    assert value(after["moe_queued_tokens"], "moe_queued_tokens") == 0
    assert value(after["moe_inflight_requests"], "moe_inflight_requests") == 0
    assert value(after["moe_requests"], "moe_requests_total", protocol="http_safetensors", status="504") == 1


def test_metrics_on_their_own_port_set_from_the_environment(server):
    r = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
    assert r.status_code == 200 and "moe_requests_total" in r.text


def test_sigterm_drains_then_exits_zero(server, http):
    ranks = server.rank_pids()
    assert ranks
    x, ids, w = inputs(16, seed=5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(post_safetensors, http, x, ids, w)
        wait_for(http, "moe_inflight_requests", 1)  # accepted: it sits in the queue for the delay
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while http.get("/v2/health/ready").status_code != 503:  # until the signal is handled
            assert time.monotonic() < deadline, "still ready 10 s after SIGTERM"
            time.sleep(0.01)
        r = post_safetensors(http, *inputs(4, seed=6))
        assert r.status_code == 503 and "shutting down" in r.json()["error"]
        r = inflight.result(timeout=30)
    assert r.status_code == 200, r.text
    check(safetensors.torch.load(r.content)["output"], x, ids, w)
    assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
    assert not any(process_running(pid) for pid in ranks), "a rank outlived the server"
    assert "drain complete" in server.log()
