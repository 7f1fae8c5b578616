"""A rank group that can never be restarted (a bad GPU, a broken driver): after
--max-restart-failures failures in a row (failed restarts, and groups that failed within 60 s of
turning ready; a group that served longer ends the row) the server exits with EXIT_RESTARTS_FAILED, so that
the orchestrator restarts or reschedules it, instead of staying live for ever; 0 never gives up.

In process: the first group is a real CPU group (it must start and warm up for the server to serve);
it is killed, and every group after it fails to start as a lost GPU does."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import pytest

from service.config import Settings
from service.errors import WorkerError
from service.server import EXIT_RESTARTS_FAILED, Server

READY_TIMEOUT_S = 180.0  # the real group's start and warm-up (4 CPU ranks, ~10-20 s here)
EXIT_TIMEOUT_S = 60.0  # a few failed starts without back-off take well under a second


class NeverStarts:
    """A rank group whose start always fails, as one on a GPU that fell off the bus."""

    starts = 0

    def start(self) -> None:
        NeverStarts.starts += 1
        raise WorkerError("rank 0: CUDA error: no CUDA-capable device is detected")

    def close(self) -> None:
        pass


class Running:
    """A Server on ephemeral loopback ports in a thread of its own: its exit code once it returns."""

    def __init__(self, max_restart_failures: int, caplog, real_groups: bool = False, later=None):
        settings = Settings(device="cpu", host="127.0.0.1", http_port=0, grpc_port=0, restart_backoff_s=0,
                            max_restart_failures=max_restart_failures)
        self.groups: list = []
        later = later or NeverStarts

        def factory():
            group = self.server._new_group() if real_groups or not self.groups else later()
            self.groups.append(group)
            return group

        NeverStarts.starts = 0
        self.server = Server(settings, group_factory=factory)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.server.fe.ready:
            assert self.thread.is_alive() and time.monotonic() < deadline, f"not ready:\n{caplog.text[-3000:]}"
            time.sleep(0.1)

    def _run(self) -> None:
        self.code = asyncio.run(self.server.serve())

    def live(self) -> int:
        return httpx.get(f"http://127.0.0.1:{self.server.http_port}/v2/health/live", timeout=10).status_code

    def kill_a_rank(self) -> None:
        os.kill(self.groups[-1].pids[-1], signal.SIGKILL)

    def exits_after_a_kill(self) -> bool:
        """Kill a rank of the newest group: whether the server then returns within EXIT_TIMEOUT_S."""
        self.kill_a_rank()
        self.thread.join(EXIT_TIMEOUT_S)
        return not self.thread.is_alive()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server._loop.call_soon_threadsafe(self.server.request_stop)
        self.thread.join(EXIT_TIMEOUT_S)


@pytest.mark.parametrize("limit", [1, 3])
def test_a_group_that_never_restarts_exits_with_its_own_status(limit, caplog):
    caplog.set_level("INFO")
    server = Running(limit, caplog)
    try:
        assert server.live() == 200
        alive = not server.exits_after_a_kill()
    finally:
        server.stop()
    assert not alive, f"still serving after {NeverStarts.starts} failed restarts:\n{caplog.text[-3000:]}"
    assert server.code == EXIT_RESTARTS_FAILED == 4
    # the killed group served under HEALTHY_RESET_S: it is the first failure of the row
    assert NeverStarts.starts == limit - 1
    last = (r"rank 0: CUDA error: no CUDA-capable device is detected" if limit > 1
            else r"the group failed \d+ s after it turned ready")
    assert re.search(rf"the rank group failed {limit} times in a row, none serving 60 s \(last: {last}\); giving up: "
                     rf"exit 4 \(--max-restart-failures {limit}\)", caplog.text), caplog.text[-3000:]


def test_a_crash_loop_gives_up_too(caplog):
    """Groups that start, pass the warm-up and turn ready, then fail at once (a GPU that dies on the
    first real batches): each counts, as it served under HEALTHY_RESET_S (the count was reset at
    every "ready", so this looped for ever with readiness flapping)."""
    caplog.set_level("INFO")
    server = Running(2, caplog, real_groups=True)
    try:
        server.kill_a_rank()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(server.groups) < 2 or not server.server.fe.ready:  # the second group is up and ready
            assert server.thread.is_alive() and time.monotonic() < deadline, caplog.text[-3000:]
            time.sleep(0.1)
        alive = not server.exits_after_a_kill()
    finally:
        server.stop()
    assert not alive and server.code == EXIT_RESTARTS_FAILED, caplog.text[-3000:]
    assert "the rank group failed 2 times in a row, none serving 60 s (last: the group failed" in caplog.text


def test_zero_never_gives_up(caplog):
    caplog.set_level("INFO")
    server = Running(0, caplog)
    try:
        server.kill_a_rank()
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while NeverStarts.starts < 20 and time.monotonic() < deadline:  # far past the default limit of 5
            time.sleep(0.05)
        assert NeverStarts.starts >= 20 and server.thread.is_alive(), caplog.text[-3000:]
        assert server.live() == 200 and not server.server.fe.ready
    finally:
        server.stop()
    assert not server.thread.is_alive() and server.code == 0  # SIGTERM's exit, as ever
    assert "giving up" not in caplog.text


def test_a_group_that_served_long_ends_the_row(monkeypatch, caplog):
    """A group that served HEALTHY_RESET_S (here 0.5 s) and then failed does not count: with a
    limit of 1 the server still tries one restart, and gives up on that failing (the count restarted
    at the healthy group's failure gave up at once, restarting nothing)."""
    import service.server as server_mod

    monkeypatch.setattr(server_mod, "HEALTHY_RESET_S", 0.5)
    caplog.set_level("INFO")
    server = Running(1, caplog)
    try:
        time.sleep(1.0)  # past HEALTHY_RESET_S
        alive = not server.exits_after_a_kill()
    finally:
        server.stop()
    assert not alive and server.code == EXIT_RESTARTS_FAILED, caplog.text[-3000:]
    assert NeverStarts.starts == 1


def test_a_close_that_raises_does_not_end_the_restarts(caplog):
    """The failed group's close() raising (it did, when a failing step's thread and the supervisor
    closed the same pipes at once) is logged, and the next group is started: before, the supervisor
    task died with that exception, and the server stayed live and unready for good, restarting nothing."""
    caplog.set_level("INFO")
    server = Running(2, caplog)
    group = server.groups[0]
    real_close = group.close

    def close():
        real_close()
        raise OSError(9, "Bad file descriptor")

    group.close = close
    try:
        alive = not server.exits_after_a_kill()
    finally:
        server.stop()
    assert not alive, f"hung after the close raised:\n{caplog.text[-3000:]}"
    assert "closing the rank group raised; going on" in caplog.text
    assert NeverStarts.starts == 1 and server.code == EXIT_RESTARTS_FAILED, caplog.text[-3000:]


def test_a_supervisor_that_raises_stops_the_server(caplog):
    """Any bug that ends the supervisor with an exception stops the server with exit 1 and the
    traceback, instead of leaving it live and never ready again."""
    caplog.set_level("INFO")

    def broken():
        raise RuntimeError("a bug in the group factory")

    server = Running(0, caplog, later=broken)
    try:
        alive = not server.exits_after_a_kill()
    finally:
        server.stop()
    assert not alive, f"live and unready after the supervisor raised:\n{caplog.text[-3000:]}"
    assert server.code == 1
    assert "the supervisor of the rank group failed; stopping (exit 1)" in caplog.text
    assert "RuntimeError: a bug in the group factory" in caplog.text
