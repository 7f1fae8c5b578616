"""A front end's steps through the owner (service.replica.RemoteGroup), without processes."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import threading
import time
import types

import pytest
import torch

from service.errors import GroupUnavailable, WorkerError
from service.fleet import set_frontend_threads
from service.replica import RemoteGroup


def step(group: RemoteGroup, on_loop: bool, slot, T: int = 8):
    """group.run, or group.run_async on an event loop of its own (a front end i >= 1's steps on its loop)."""
    if not on_loop:
        return group.run(slot, T)
    return asyncio.run(group.run_async(slot, T))


@pytest.mark.parametrize("on_loop", [False, True], ids=["run", "run_async"])
def test_a_late_answer_to_a_given_up_step_is_never_taken_by_the_next_group(on_loop):
    """Group A gives up on its step (no answer within its timeout); the owner answers it later. Group B,
    attached on the same slot connection, must get the answer to its own step, not A's late one."""
    here, owner = mp.Pipe()
    slot = types.SimpleNamespace(index=0)
    sent = [0]  # kept by the replica across groups
    given_up = threading.Event()

    def serve():  # the owner: step 1 answered once A gave up on it, every later step at once, each with its number
        for _ in range(2):
            _, gen, n, T = owner.recv()
            if n == 1:  # (answered after 10 s anyway: an A that never gives up then takes it and fails the test)
                given_up.wait(10)
            owner.send(("done", n, {"gen": gen, "n": n}))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    a = RemoteGroup(1, "fused", [slot], [here], sent, timeout_s=0.1)
    with pytest.raises(GroupUnavailable, match="did not answer"):
        step(a, on_loop, slot)
    assert not a.alive
    given_up.set()
    # A's answer is in the pipe before B sends (a fixed 0.4 s answer and 0.5 s wait assumed both)
    assert here.poll(10), "A's late answer never reached the pipe"
    b = RemoteGroup(2, "fused", [slot], [here], sent, timeout_s=5.0)
    assert step(b, on_loop, slot) == {"gen": 2, "n": 2}
    t.join(5)


def test_run_async_takes_the_owners_answers_on_the_loop_and_fails_as_run_does():
    """Answers in order on the loop thread while it stays free (another task runs meanwhile); a cancelled
    step's answer is skipped by the slot's next step; the owner's failure is raised; a closed connection
    fails the group."""
    here, owner = mp.Pipe()
    slot = types.SimpleNamespace(index=0)
    group = RemoteGroup(1, "fused", [slot], [here], [0], timeout_s=10.0)

    def serve():  # the owner: each step answered after 50 ms; step 3 fails; then it goes away
        for _ in range(3):
            _, gen, n, T = owner.recv()
            time.sleep(0.05)
            owner.send(("done", n, {"n": n, "T": T}) if n != 3 else ("failed", n, "worker", "rank 0 raised"))
        owner.close()

    async def main():
        ticks = 0

        async def ticker():  # the loop turns while a step waits: nothing blocks it
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        beat = asyncio.create_task(ticker())
        first = asyncio.create_task(group.run_async(slot, 5))
        await asyncio.sleep(0.01)
        first.cancel()  # its answer (n=1) arrives later and is skipped
        with contextlib.suppress(asyncio.CancelledError):
            await first
        second = await group.run_async(slot, 7)
        assert ticks >= 5, ticks
        with pytest.raises(WorkerError, match="rank 0 raised"):
            await group.run_async(slot, 9)
        assert group.alive  # (a failed step is the owner's to handle: the group is not gone)
        with pytest.raises(GroupUnavailable, match="gone"):
            await group.run_async(slot, 11)
        beat.cancel()
        return second

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert asyncio.run(main()) == {"n": 2, "T": 7}
    assert not group.alive
    t.join(5)


def start_replica():
    """Front end 1 serving in a thread of this process, on fresh ports; the owner's end of its control channel."""
    import asyncio

    from service.config import Settings
    from service.replica import Replica
    from tests.api.common import CFG
    from tests.serverproc import free_port

    ports = free_port(), free_port()
    owner, ctl = mp.Pipe()
    settings = Settings(host="127.0.0.1", slots=1, http_port=ports[0], grpc_port=ports[1])
    replica = Replica(1, settings, CFG, ctl, [mp.Pipe()[0]])
    code: list[int] = []
    t = threading.Thread(target=lambda: code.append(asyncio.run(replica.serve(*ports))), daemon=True)
    t.start()
    return replica, owner, t, code, ports


def test_a_front_end_listens_only_once_it_knows_the_groups_state():
    """A (re)started front end binds its ports only after the owner's first attach or detach: one
    that listened before would answer 503 ("starting") beside front ends that serve."""
    import socket

    replica, owner, t, code, (http_port, grpc_port) = start_replica()

    def listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    assert owner.poll(60) and owner.recv()[0] == "started"
    time.sleep(0.5)  # time it would have had to bind
    assert not listening(http_port) and not listening(grpc_port)
    owner.send(("detach", "the rank group is restarting"))
    assert owner.poll(60) and owner.recv()[0] == "listening"
    assert listening(http_port) and listening(grpc_port)
    import httpx

    r = httpx.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=10)
    assert r.status_code == 503 and not replica.fe.ready, r.text
    owner.close()  # the owner is gone: the front end stops
    t.join(30)
    assert code == [1]


def test_a_front_end_drained_before_it_listens_exits_without_listening():
    replica, owner, t, code, _ = start_replica()
    assert owner.poll(60) and owner.recv()[0] == "started"
    owner.send(("drain",))
    t.join(30)
    assert code == [0] and not owner.poll(0.2)  # no "listening"


def test_the_owner_turns_ready_only_once_every_front_end_serves_the_group(monkeypatch):
    """Fleet.attach returns (and the owner then turns ready) only after each front end has confirmed
    ("attached", gen): a client told "ready" by the owner is never answered 503 by another process."""
    import os

    from service import fleet as fleet_mod
    from service.config import Settings
    from service.fleet import Channel, Fleet, _Member
    from tests.api.common import CFG

    monkeypatch.setattr(fleet_mod, "ATTACH_TIMEOUT_S", 30.0)  # a loaded machine's stall is not a timeout

    fleet = Fleet(Settings(slots=1), CFG, 2, own_snapshot=lambda: None, on_failure=lambda *a: None)
    owner, fe = mp.Pipe()
    proc = types.SimpleNamespace(is_alive=lambda: True, pid=0)
    member = _Member(1, proc, Channel(owner), [])
    member.listened.set()
    fleet._members[1] = member
    threading.Thread(target=fleet._read, args=(member,), daemon=True).start()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]
    group = types.SimpleNamespace(backend="cpu", slots=[types.SimpleNamespace(owner_fd=fd) for fd in fds])
    returned = threading.Event()
    t = threading.Thread(target=lambda: (fleet.attach(group, 7), returned.set()), daemon=True)
    t.start()
    assert fe.poll(10)
    msg = fe.recv()
    assert msg[:2] == ("attach", 7), msg
    for fd in Channel(fe).recv_fds(msg[3]):
        os.close(fd)
    assert not returned.wait(0.5)  # the front end has not confirmed yet
    fe.send(("attached", 6))  # an older generation's confirmation does not count
    assert not returned.wait(0.3)
    fe.send(("attached", 7))
    assert returned.wait(5)
    for fd in fds:
        os.close(fd)


def test_a_front_end_asked_for_statistics_while_it_starts_still_starts():
    """A monitoring client polls gRPC ModelStatistics on the ports while front end 1 starts: its
    gRPC port is bound before its HTTP one, so its ("scrape", id) can reach the owner before its
    ("listening", pid). The owner must take that scrape and still see the start through (it used to
    call it a failed start, kill a healthy front end and, on a first start, exit)."""
    import socket

    import grpc

    from service.api.proto import grpc_predict_v2_pb2 as pb
    from service.api.proto import grpc_predict_v2_pb2_grpc as pb_grpc
    from service.config import Settings
    from service.fleet import Fleet
    from service.metrics import Metrics, Snapshot
    from tests.api.common import CFG
    from tests.serverproc import free_port

    http_port, grpc_port = free_port(), free_port()
    settings = Settings(host="127.0.0.1", slots=1, http_port=http_port, grpc_port=grpc_port)
    metrics = Metrics()
    fleet = Fleet(settings, CFG, 2, own_snapshot=lambda: Snapshot(list(metrics.registry.collect())),
                  on_failure=lambda *a: None)
    stop, answered = threading.Event(), []

    def poll():
        while not stop.is_set():
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", grpc_port)) != 0:
                    time.sleep(0.0005)
                    continue
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                try:
                    pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(), timeout=5)
                    answered.append(1)
                except grpc.RpcError:
                    pass

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        fleet.start(http_port, grpc_port)  # MoEError if the owner gave up on it
        assert fleet._members[1].listening
        deadline = time.monotonic() + 10
        while not answered:
            assert time.monotonic() < deadline, "no statistics answered by the front end"
            time.sleep(0.05)
    finally:
        stop.set()
        poller.join(10)
        fleet.stop()
    assert not fleet._members[1].proc.is_alive()


def test_a_stop_while_a_front_end_starts_leaves_no_process_behind():
    """SIGTERM (Fleet.stop) while a front end is being (re)started: it is registered only after its
    ("started", pid), after drain() looked; it must still be told to drain and exit, and stop()
    must wait for that start (before: it bound the server's ports after the stop and the owner's
    exit hung joining it)."""
    from service.config import Settings
    from service.fleet import Fleet
    from tests.api.common import CFG
    from tests.serverproc import free_port

    ports = free_port(), free_port()
    settings = Settings(host="127.0.0.1", slots=1, http_port=ports[0], grpc_port=ports[1])
    fleet = Fleet(settings, CFG, 2, own_snapshot=lambda: None, on_failure=lambda *a: None)
    fleet.http_port, fleet.grpc_port = ports
    spawner = threading.Thread(target=fleet._spawn, args=(1,), daemon=True)  # as _watch's restart does
    spawner.start()
    time.sleep(0.5)  # the front end is importing
    fleet.stop()
    spawner.join(30)
    assert not spawner.is_alive(), "the start did not end"
    deadline = time.monotonic() + 15
    while [p for p in mp.active_children() if p.name == "moe-frontend1"]:
        assert time.monotonic() < deadline, "the front end outlived the stop"
        time.sleep(0.1)


def test_a_failed_step_of_front_end_0_restarts_the_group_even_before_the_first_heartbeat():
    """With several front ends, front end 0's batcher reports a failed step with its SlotShare of
    the group; the supervisor must take it as the group's failure, also when it came before its
    watch loop cleared its wake-up (the failure was lost, and the failed group kept serving)."""
    import asyncio

    from service.fleet import SlotShare
    from service.server import Server

    group = types.SimpleNamespace(alive=True, slots=[], poll=lambda: True, heartbeat=lambda: None)
    server = Server.__new__(Server)  # only the supervision's state
    server.group, server._attached, server._failed, server._stopping = group, SlotShare(group, []), None, False

    async def main() -> bool:
        server._wake = asyncio.Event()
        server._on_step_failure(server._attached, RuntimeError("rank 0 raised"))
        try:
            await asyncio.wait_for(server._watch(group), 3)  # returns: the group failed
            return True
        except TimeoutError:
            return False  # it kept watching a group whose step failed

    assert asyncio.run(main()), "the failed step was not taken as the group's failure"


def test_a_front_end_runs_one_torch_thread_whatever_the_host():
    """Several step threads per front end copy and check rows at once; with more than one torch
    thread each gets a spinning OpenMP team (issue 11h: 4 front ends of 4 threads on an H200 host
    served under half the tokens/s of 4 front ends of 1)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        set_frontend_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_step_of_a_new_group_waits_behind_an_earlier_groups_step_on_the_same_connection():
    """Group A's step still waits on slot 0's connection when group B (the next group, the same connections)
    sends its own: B waits in a thread behind A instead of reading beside it, and each gets its own answer."""
    here, owner = mp.Pipe()
    slot = types.SimpleNamespace(index=0)
    sent, busy = [0], [threading.Lock()]  # kept by the replica across groups

    def serve():  # the owner: every step answered 0.2 s after it arrived, with its number
        for _ in range(2):
            _, gen, n, T = owner.recv()
            time.sleep(0.2)
            owner.send(("done", n, {"gen": gen, "n": n}))

    async def main():
        a = RemoteGroup(1, "fused", [slot], [here], sent, timeout_s=10.0, busy=busy)
        b = RemoteGroup(2, "fused", [slot], [here], sent, timeout_s=10.0, busy=busy)
        first = asyncio.create_task(a.run_async(slot, 8))
        await asyncio.sleep(0.05)  # A has sent and waits
        return await asyncio.gather(first, b.run_async(slot, 8))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert asyncio.run(main()) == [{"gen": 1, "n": 1}, {"gen": 2, "n": 2}]
    t.join(5)
