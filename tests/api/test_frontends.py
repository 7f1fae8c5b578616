"""Two front-end processes feeding one rank group (`--frontends 2`, service.fleet): the no-mixing,
bad-row and solo-equality tests of test_e2e over every protocol with connections spread over
both processes, metrics and statistics summed whichever process answers, both processes serving,
a killed front end restarted, a killed rank restarting the group for both, SIGTERM draining both,
and a killed owner taking its front ends with it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from http.client import HTTPConnection

import grpc
import httpx
import pytest
import safetensors.torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.server import EXIT_CANNOT_LISTEN
from tests.api import test_e2e
from tests.api.common import CFG, check, inputs
from tests.serverproc import ServerProcess, cmdline, comm, descendants, free_port

# The same tests as against one front end, here with connections spread over two processes.
test_concurrent_clients_get_their_own_rows = test_e2e.test_concurrent_clients_get_their_own_rows
test_concurrent_protocols_bad_rows_and_solo_answers = test_e2e.test_concurrent_protocols_bad_rows_and_solo_answers
post_safetensors, scrape, value = test_e2e.post_safetensors, test_e2e.scrape, test_e2e.value

FLAGS = ("--frontends", "2", "--max-request-bytes", str(test_e2e.MAX_REQUEST_BYTES),
         "--grpc-max-message-bytes", str(test_e2e.GRPC_MAX_MESSAGE_BYTES))
CONNECTIONS = 24  # P(all on one of 2 processes) = 2 * 2**-24 with SO_REUSEPORT's hash


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    metrics_port = free_port()  # the server also serves --metrics-port (the owner, summed); picked as it starts
    with ServerProcess.serving(tmp_path_factory.mktemp("frontends") / "server.log", *FLAGS,
                               "--metrics-port", str(metrics_port)) as proc:
        proc.metrics_port = metrics_port
        yield proc


http = test_e2e.http  # a client of this module's server


def accepted_by(port: int) -> dict[int, int]:
    """Client port -> pid of the process holding the server side, for the established connections
    on `port` (`ss -tnp`, iproute2)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]): int(line.split("pid=")[1].split(",")[0])
            for line in out.splitlines() if "pid=" in line}


def holders(port: int) -> dict[int, int]:
    """pid -> established connections it accepted on `port`."""
    return dict(collections.Counter(accepted_by(port).values()))


def open_clients(server, n: int) -> list[httpx.Client]:
    """n HTTP connections, each with one answered request (so each is accepted and kept alive)."""
    clients = []
    for i in range(n):
        c = httpx.Client(base_url=server.url, timeout=60)
        x, ids, w = inputs(3 + i, seed=500 + i)
        r = post_safetensors(c, x, ids, w)
        assert r.status_code == 200, r.text
        check(safetensors.torch.load(r.content)["output"], x, ids, w)
        clients.append(c)
    return clients


def test_the_owner_turns_ready_after_every_front_end_listens(server):
    """The first rank group is often up before front end 1 has imported and bound its ports: the
    owner used to turn ready then, and every client that came at once reached it alone (12 of 14
    server logs of these tests, loaded machine or not)."""
    deadline = time.monotonic() + 10  # the owner logs "ready" a moment after it turns ready
    while "moe-serve: ready (rank pids" not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)
    lines = server.log().splitlines()
    ready = next(i for i, line in enumerate(lines) if "moe-serve: ready (rank pids" in line)
    listening = next((i for i, line in enumerate(lines) if "front end 1 listening" in line), len(lines))
    assert listening < ready, "\n".join(lines[:max(ready, listening) + 1])


def test_both_processes_serve_and_report_the_same_state(server):
    (fe1,) = server.frontend_pids()
    clients = open_clients(server, CONNECTIONS)
    try:
        held = holders(server.http_port)
        assert held.get(server.pid, 0) >= 1 and held.get(fe1, 0) >= 1, held
        for c in clients:  # whichever process a connection reached: ready, and the same metadata
            assert c.get("/v2/health/ready").status_code == 200
            assert c.get("/v2/models/moe").json()["inputs"][0]["shape"] == [-1, CFG.H]
    finally:
        for c in clients:
            c.close()
    for _ in range(6):  # gRPC health over fresh channels (SO_REUSEPORT on the gRPC port too)
        with grpc.insecure_channel(server.grpc_url) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_and_statistics_add_up_over_both_processes(server):
    def totals(c) -> tuple[float, float, int]:
        fams = scrape(c)
        stats = c.get("/v2/models/moe/stats").json()["model_stats"][0]
        return (value(fams["moe_requests"], "moe_requests_total", protocol="http_safetensors", status="200"),
                value(fams["moe_tokens"], "moe_tokens_total"), stats["inference_count"])

    with httpx.Client(base_url=server.url, timeout=60) as c:
        before = totals(c)
    clients = open_clients(server, CONNECTIONS)  # requests of 3..26 tokens, over both processes
    try:
        sent = sum(3 + i for i in range(CONNECTIONS))
        held = holders(server.http_port)
        assert len([p for p in held if held[p]]) == 2, held
        for c in clients:  # each scrape lands on one process or the other: all see the sum
            after = totals(c)
            assert after[0] - before[0] == CONNECTIONS
            assert after[1] - before[1] >= sent  # steps' tokens (the scrapes' answers add none)
            assert after[2] - before[2] == sent
        with httpx.Client(base_url=f"http://127.0.0.1:{server.metrics_port}", timeout=60) as c:
            fams = scrape(c)
            # the summed registry has no name[] filter: the whole exposition, not a 500
            filtered = c.get("/metrics", params={"name[]": "moe_ready"})
            assert filtered.status_code == 200 and "moe_requests_total" in filtered.text, filtered.text[:300]
        assert value(fams["moe_requests"], "moe_requests_total", protocol="http_safetensors",
                     status="200") - before[0] == CONNECTIONS
    finally:
        for c in clients:
            c.close()


def test_killed_frontend_is_restarted(server):
    (fe1,) = server.frontend_pids()
    os.kill(fe1, signal.SIGKILL)
    # Connections it had (or had in its accept queue) are lost with it; once it has exited, every
    # new connection reaches the owner. Exited means reaped (the owner's watcher reaps it before it
    # logs the restart), not a zombie: the leader thread turns zombie while the process's other
    # threads may still be exiting, and the last one tears down the whole address space before it
    # closes the files, the listening socket among them. A connection that the kernel placed in
    # that socket's queue meanwhile was reset (seen three times in loaded suites).
    assert not unreaped([fe1], 30)
    x, ids, w = inputs(40, seed=31)
    deadline = time.monotonic() + 60
    while not [p for p in server.frontend_pids() if p != fe1]:
        assert time.monotonic() < deadline, "the front end was not restarted:\n" + server.log()[-3000:]
        with httpx.Client(base_url=server.url, timeout=60) as c:  # meanwhile the owner serves alone
            r = post_safetensors(c, x, ids, w)
        assert r.status_code == 200, r.text
        time.sleep(0.2)
    (new,) = server.frontend_pids()
    deadline = time.monotonic() + 60
    while True:  # until it is attached to the group: its own requests answered
        clients = open_clients(server, CONNECTIONS)
        held = holders(server.http_port)
        for c in clients:
            c.close()
        if held.get(new, 0):
            break
        assert time.monotonic() < deadline, held
    assert "front end 1 (pid" in server.log() and "restarting it" in server.log()


# A killed rank: the in-flight request gets 503, the group restarts, both processes serve again.
test_killed_rank_fails_fast_then_recovers = test_e2e.test_killed_rank_fails_fast_then_recovers


def post_on(conn: HTTPConnection, x, ids, w) -> tuple[int, bytes]:
    """A safetensors /moe/forward request on the kept-alive connection `conn`: (status, body)."""
    blob = safetensors.torch.save({"hidden_states": x, "topk_ids": ids, "topk_weights": w})
    conn.request("POST", "/moe/forward", body=blob, headers={"Content-Type": "application/x-safetensors"})
    answer = conn.getresponse()
    return answer.status, answer.read()


# test_sigterm_drains_every_front_end's batching delay, with idle waits: a step that is not full waits
# this long for company, so the last rows of each process's requests are still queued when SIGTERM
# comes (it comes one scrape after they are accepted). Without it each process's 4 requests could
# all be answered first: one loaded run drained "0 requests in flight" on the owner.
DRAIN_HOLD_MS = 3000


def test_sigterm_drains_every_front_end(tmp_path):
    """SIGTERM with requests in flight on both processes: every one is answered, both drain, exit 0."""
    proc = ServerProcess.module(tmp_path / "server.log", *FLAGS, "--batch-delay-ms", str(DRAIN_HOLD_MS),
                                "--batch-idle-wait", "true")
    conns: list[HTTPConnection] = []
    try:
        proc.wait_ready()
        (fe1,) = proc.frontend_pids()
        tree = {proc.pid, *descendants(proc.pid)}
        for i in range(CONNECTIONS):  # each accepted by one process or the other: a request answered
            conns.append(HTTPConnection("127.0.0.1", proc.http_port, timeout=60))
            # (a full step each: it does not wait out the delay)
            assert post_on(conns[-1], *inputs(test_e2e.STEP, seed=600 + i))[0] == 200
        by_pid = accepted_by(proc.http_port)
        on = {pid: [c for c in conns if by_pid.get(c.sock.getsockname()[1]) == pid] for pid in (proc.pid, fe1)}
        assert all(on.values()), {pid: len(c) for pid, c in on.items()}  # P(not) = 2 * 2**-24
        chosen = on[proc.pid][:4] + on[fe1][:4]  # 4 requests in flight on each process
        # several steps each; each process's last rows (4 + 5 + 6 + 7 on front end 1, 1 + 2 + 3 on the
        # owner) are no full step and wait DRAIN_HOLD_MS: a request of each is in flight at SIGTERM
        big = [inputs(3 * test_e2e.STEP + i, seed=700 + i) for i in range(len(chosen))]
        with httpx.Client(base_url=proc.url, timeout=60) as c:
            answered = value(scrape(c)["moe_requests"], "moe_requests_total", protocol="http_safetensors",
                             status="200")

        with concurrent.futures.ThreadPoolExecutor(len(big)) as pool:
            futures = [pool.submit(post_on, conn, *case) for conn, case in zip(chosen, big, strict=True)]
            # SIGTERM once every request is accepted (queued, running or answered; one still on its
            # way would be refused 503 by the drain, rightly); they take several steps each, so
            # some are in flight on both processes (the drain logs below say how many).
            deadline = time.monotonic() + 60
            while True:
                with httpx.Client(base_url=proc.url, timeout=60) as c:
                    fams = scrape(c)
                accepted = value(fams["moe_inflight_requests"], "moe_inflight_requests") + value(
                    fams["moe_requests"], "moe_requests_total", protocol="http_safetensors", status="200") - answered
                if accepted >= len(big):
                    break
                assert time.monotonic() < deadline, f"{accepted} of {len(big)} requests accepted"
                time.sleep(0.005)
            proc.proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=60) for f in futures]
        for case, (status, body) in zip(big, answers, strict=True):
            assert status == 200, body
            check(safetensors.torch.load(body)["output"], *case)
        assert proc.proc.wait(60) == 0, proc.log()[-3000:]
        log = proc.log()
        for who in ("moe-serve: stop requested:", "frontend1 INFO moe-serve.frontend:"):
            in_flight = re.search(who + r" draining (\d+) requests in flight", log)
            assert in_flight and int(in_flight.group(1)) >= 1, (who, log[-3000:])
        assert "frontend1 INFO moe-serve.frontend: drain complete" in log, log[-3000:]
        assert not leftovers(tree, 10), "processes left behind"
    finally:
        for conn in conns:
            conn.close()
        proc.stop()


def test_killed_owner_takes_its_front_ends_along(tmp_path):
    proc = ServerProcess.module(tmp_path / "server.log", *FLAGS)
    try:
        proc.wait_ready()
        tree = descendants(proc.pid)
        assert proc.frontend_pids() and proc.rank_pids(), [(p, comm(p), cmdline(p)) for p in tree]
        os.kill(proc.pid, signal.SIGKILL)
        proc.proc.wait(10)
        left = leftovers(tree, 20)
        assert not left, f"orphans left: {[(p, comm(p), cmdline(p)) for p in left]}\n{proc.log()[-3000:]}"
        assert "the owner process has exited; stopping" in proc.log(), proc.log()[-3000:]
    finally:
        proc.stop()


def unreaped(pids, wait_s: float) -> list[int]:
    """Those of `pids` whose /proc entry (zombies included) is still there after up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (left := [p for p in pids if os.path.exists(f"/proc/{p}")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def leftovers(pids, wait_s: float) -> list[int]:
    """Those of `pids` still running (zombies aside) after up to `wait_s` (multiprocessing's
    resource tracker leaves a moment after its parent)."""
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + wait_s
    while (left := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_taken_port_is_refused(server, tmp_path):
    """SO_REUSEPORT would let a second server share the port of the first; it exits instead."""
    env = {**ServerProcess.loopback_env(dict(os.environ)), "MOE_HTTP_PORT": str(server.http_port)}
    second = ServerProcess([sys.executable, "-m", "service", *FLAGS], tmp_path / "second.log", env=env)
    try:
        assert second.proc.wait(120) == EXIT_CANNOT_LISTEN, second.log()[-2000:]
    finally:
        second.stop()
    assert "already in use" in second.log()
    assert server.ready()


def test_default_count(monkeypatch):
    """min(4, cores // 2) front ends with a GPU, 1 on the CPU; the flag wins."""
    from service import server
    from service.config import Settings
    from service.server import frontend_count

    for cores, expected in ((16, 4), (64, 4), (6, 3), (3, 1), (1, 1)):
        monkeypatch.setattr(server, "usable_cpus", lambda n=cores: n)
        assert frontend_count(Settings(), "cuda") == expected, cores
        assert frontend_count(Settings(), "cpu") == 1
    assert frontend_count(Settings(frontends=3), "cpu") == 3
    monkeypatch.setenv("MOE_FRONTENDS", "2")
    assert frontend_count(Settings(), "cuda") == 2
