"""WorkerGroup.run_async: a step alone in flight is read on the event loop (readers on the ranks' pipes),
any other waits in a thread, and the answers keep their order and their steps whatever happens
between: steps beside it, a cancelled caller, a killed, stopped or closed group."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

from service.config import LayerConfig
from service.errors import GroupUnavailable, WorkerError
from service.worker import group as group_mod
from service.worker.group import WorkerGroup
from tests.helpers import routing

SMALL = LayerConfig(E=4, H=16, I=32, K=2, R=2, C=8, dtype=torch.float32)
T = 11


def _fill(slot, seed: int) -> torch.Tensor:
    """Fresh rows into the slot (its answer rows poisoned); the inputs, for a solo run of them."""
    gen = torch.Generator().manual_seed(seed)
    ids, w = routing(T, SMALL.E, SMALL.K, "balanced", gen)
    x = torch.randn(T, SMALL.H, generator=gen)
    slot.x[:T].copy_(x)
    slot.ids[:T].copy_(ids)
    slot.w[:T].copy_(w)
    slot.out[:T].fill_(float("nan"))
    return x, ids.to(torch.int32), w


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def group(monkeypatch):
    """A started group of 3 slots whose reads are recorded: (seq named, read on the main thread)."""
    g = WorkerGroup(SMALL, slots=3, step_timeout_s=60)
    g.start()
    reads: list[tuple[int, bool]] = []
    read_next = g._read_next

    def recorded(seq, *args):
        reads.append((seq, threading.current_thread() is threading.main_thread()))
        return read_next(seq, *args)

    monkeypatch.setattr(g, "_read_next", recorded)
    g.reads = reads
    try:
        yield g
    finally:
        g.close()


async def _reading(g: WorkerGroup, in_flight: int) -> None:
    """Until `in_flight` steps are sent and one holds the reader's role."""
    deadline = time.monotonic() + 10
    while not (g._reading and g._in_flight == in_flight):
        assert time.monotonic() < deadline, (g._reading, g._in_flight)
        await asyncio.sleep(0.005)


def test_a_step_alone_is_read_on_the_loop_and_answers_as_a_solo_run(group):
    g = group
    slot = g.acquire_slot()
    inputs = _fill(slot, 1)
    stats = asyncio.run(g.run_async(slot, T))
    assert stats.seq == g.seq and stats.tokens == T and stats.wall_s > 0
    assert abs(sum(stats.phases.values()) - stats.wall_s) < 1e-6
    assert g.reads == [(stats.seq, True)]  # read by the loop's own thread, no executor between
    got = slot.out[:T].clone()
    g.release(slot)
    assert torch.equal(got, g.forward(*inputs))
    assert g._in_flight == 0 and not g._answers and not g._reading and g.heartbeat() is True


def test_steps_beside_a_loop_step_wait_in_threads_and_keep_their_rows(group):
    """Rank 0 stopped: a loop step waits holding the reader's role; a thread's step and a second
    run_async (which finds a step in flight) are sent behind it. Rank 0 resumed: each slot holds its
    own answer, the first read on the loop, the others in threads."""
    g = group
    slots = [g.acquire_slot() for _ in range(3)]
    inputs = [_fill(s, 10 + i) for i, s in enumerate(slots)]

    async def main():
        loop = asyncio.get_running_loop()
        os.kill(g.pids[0], signal.SIGSTOP)
        try:
            first = asyncio.create_task(g.run_async(slots[0], T))
            await _reading(g, 1)
            second = loop.run_in_executor(None, g.run, slots[1], T)
            await _reading(g, 2)
            third = asyncio.create_task(g.run_async(slots[2], T))
            await _reading(g, 3)
            assert not (first.done() or second.done() or third.done())
        finally:
            os.kill(g.pids[0], signal.SIGCONT)
        return await asyncio.gather(first, second, third)

    stats = asyncio.run(main())
    assert [s.seq for s in stats] == [g.seq - 2, g.seq - 1, g.seq]
    # one read per step: the first on the loop; the others by whichever waiting thread came first
    assert g.reads[0] == (stats[0].seq, True) and len(g.reads) == 3
    assert all(not on_main and seq in (stats[1].seq, stats[2].seq) for seq, on_main in g.reads[1:])
    got = [s.out[:T].clone() for s in slots]
    for s in slots:
        g.release(s)
    for out, x in zip(got, inputs, strict=True):
        assert torch.equal(out, g.forward(*x))
    assert g._in_flight == 0 and not g._answers and g.heartbeat() is True


def test_a_cancelled_loop_step_leaves_its_answer_to_a_thread(group):
    """Its caller gone, the step still runs: a thread takes its answer when it comes, so the next
    steps get theirs (not its) and the idle group answers its heartbeat (nothing left in flight)."""
    g = group
    slot = g.acquire_slot()
    _fill(slot, 20)

    async def cancelled():
        os.kill(g.pids[0], signal.SIGSTOP)
        try:
            step = asyncio.create_task(g.run_async(slot, T))
            await _reading(g, 1)
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
        finally:
            os.kill(g.pids[0], signal.SIGCONT)

    asyncio.run(cancelled())
    deadline = time.monotonic() + 10
    while g._in_flight:
        assert time.monotonic() < deadline, "the cancelled step's answer was never taken"
        time.sleep(0.01)
    assert not g._answers and g.alive and g.heartbeat() is True
    inputs = _fill(slot, 21)
    asyncio.run(g.run_async(slot, T))
    got = slot.out[:T].clone()
    g.release(slot)
    assert torch.equal(got, g.forward(*inputs))


def test_a_rank_killed_mid_loop_step_fails_it_at_once_and_is_named(group):
    g = group
    fds = _open_fds()
    slot = g.acquire_slot()
    _fill(slot, 30)

    async def main():
        os.kill(g.pids[1], signal.SIGSTOP)
        step = asyncio.create_task(g.run_async(slot, T))
        await _reading(g, 1)
        t0 = time.monotonic()
        os.kill(g.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="rank 1 died \\(killed by signal 9, SIGKILL\\)"):
            await step
        return time.monotonic() - t0

    assert asyncio.run(main()) < 10
    assert not g.alive and [on_main for _, on_main in g.reads] == [False]  # the failing read: a thread's
    with pytest.raises((WorkerError, GroupUnavailable)):
        asyncio.run(g.run_async(slot, T))
    g.close()
    assert _open_fds() <= fds  # no copy of a pipe or a sentinel left open


def test_a_stopped_rank_fails_the_loop_step_at_its_deadline():
    with WorkerGroup(SMALL, step_timeout_s=1) as g:
        slot = g.acquire_slot()
        _fill(slot, 40)
        os.kill(g.pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1 is stopped .* did not answer within 1 s"):
            asyncio.run(g.run_async(slot, T))
        assert time.monotonic() - t0 < 10 and not g.alive


def test_closing_the_group_under_a_waiting_loop_step_ends_it(group, monkeypatch):
    """close() in another thread (the server's supervisor) closes the pipes the loop waits on: the step
    ends with the group's failure, and the loop keeps no reader on a descriptor that was closed."""
    g = group
    monkeypatch.setattr(group_mod, "STOP_GRACE_S", 0.5)  # a stopped rank never exits politely
    fds = _open_fds()
    slot = g.acquire_slot()
    _fill(slot, 50)

    async def main():
        loop = asyncio.get_running_loop()
        os.kill(g.pids[0], signal.SIGSTOP)
        step = asyncio.create_task(g.run_async(slot, T))
        await _reading(g, 1)
        watched = set(loop._selector.get_map())  # the pipes' and sentinels' copies
        assert len(watched) >= 2 * SMALL.R
        closing = loop.run_in_executor(None, g.close)
        with pytest.raises((WorkerError, GroupUnavailable)):
            await asyncio.wait_for(step, 30)
        await closing
        return watched - set(loop._selector.get_map())

    assert len(asyncio.run(main())) >= 2 * SMALL.R  # every copy unregistered
    assert _open_fds() <= fds


def test_a_step_cancelled_while_its_failing_read_runs_leaves_nothing_waiting():
    """Past the deadline (a rank stopped) the read goes to a thread of its own, not to the loop's default
    executor: with that executor busy, a cancel used to remove the queued read, and the reader's role stayed
    taken for good (every later step and the heartbeat waited). Now the read runs, fails the group, and a
    step after it is refused at once."""
    import concurrent.futures

    with WorkerGroup(SMALL, step_timeout_s=1) as g:
        slot = g.acquire_slot()
        _fill(slot, 60)
        busy = threading.Event()

        async def main():
            loop = asyncio.get_running_loop()
            loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
            blocker = loop.run_in_executor(None, busy.wait, 30)  # the default executor's one worker, taken
            os.kill(g.pids[1], signal.SIGSTOP)
            step = asyncio.create_task(g.run_async(slot, T))
            await _reading(g, 1)
            await asyncio.sleep(1.3)  # past the deadline: the read is under way in a thread
            step.cancel()
            with pytest.raises((asyncio.CancelledError, WorkerError)):
                await step
            busy.set()
            await blocker

        t0 = time.monotonic()
        asyncio.run(main())
        while g._reading or g.alive:
            assert time.monotonic() - t0 < 15, (g._reading, g.alive)
            time.sleep(0.01)
        assert isinstance(g._failure, WorkerError) and "rank 1 is stopped" in str(g._failure)
        with pytest.raises(WorkerError):
            g.run(slot, T)


def test_a_failing_loop_step_does_not_wait_for_a_full_executor():
    """Steps sent behind a loop step wait for the reader's role in threads of the executor they are given;
    when those fill it, the loop step's failing read (in a thread of its own) still runs: both steps fail at
    the deadline instead of waiting on each other for ever."""
    import concurrent.futures

    with WorkerGroup(SMALL, slots=2, step_timeout_s=1) as g:
        first, second = g.acquire_slot(), g.acquire_slot()
        _fill(first, 70)
        _fill(second, 71)
        pool = concurrent.futures.ThreadPoolExecutor(1)

        async def main():
            asyncio.get_running_loop().set_default_executor(pool)  # (the old read's executor: the same one)
            os.kill(g.pids[0], signal.SIGSTOP)
            a = asyncio.create_task(g.run_async(first, T, (), pool))
            await _reading(g, 1)
            b = asyncio.create_task(g.run_async(second, T, (), pool))  # in flight behind a: pool's one thread
            await _reading(g, 2)
            return await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), 20)

        results = asyncio.run(main())
        pool.shutdown()
        assert all(isinstance(r, WorkerError) for r in results), results
        assert not g.alive


def test_a_rank_error_read_on_the_loop_kills_the_ranks_from_a_thread(monkeypatch):
    """R = 1: a rank that raises sends its traceback, then exits; the loop may read that message itself (every
    pipe readable). The kill (a join per rank) must not run on the event loop."""
    cfg = LayerConfig(E=4, H=16, I=32, K=2, R=1, C=16, dtype=torch.float32)
    with WorkerGroup(cfg, slots=1, step_timeout_s=30) as g:
        slot = g.acquire_slot()
        slot.x[:T].normal_()
        slot.ids[:T] = 1_000_000  # the rank itself must fail
        slot.w[:T] = 0.5
        kills: list[bool] = []
        kill = g._kill

        def recorded():
            kills.append(threading.current_thread() is threading.main_thread())
            kill()

        monkeypatch.setattr(g, "_kill", recorded)
        with pytest.raises(WorkerError) as info:
            asyncio.run(g.run_async(slot, T))
        assert info.value.traceback and "Traceback" in info.value.traceback
        deadline = time.monotonic() + 10
        while not kills:
            assert time.monotonic() < deadline, "the ranks were never killed"
            time.sleep(0.01)
        assert kills[0] is False and not g.alive


def test_a_loop_stalled_past_the_deadline_still_takes_answers_that_came_in_time(group):
    """The loop blocked (a long request's work) while healthy ranks answered: its readers and the deadline
    fire together. The answers in the pipes are read, not declared missing (before: the group was killed
    as "did not answer within 1 s")."""
    g = group
    g.step_timeout_s = 1.0  # no step measured yet: the deadline is step_timeout_s
    slot = g.acquire_slot()
    inputs = _fill(slot, 80)

    async def main():
        step = asyncio.create_task(g.run_async(slot, T))
        # One turn: the step is sent and waits on the loop. (Not _reading(): healthy ranks may answer before
        # it looks, and the loop would then read the answer at once.)
        await asyncio.sleep(0)
        assert g._reading and g._in_flight == 1
        time.sleep(1.5)  # the loop itself stalls, past the deadline
        return await step

    stats = asyncio.run(main())
    assert stats.seq == g.seq and g.alive
    got = slot.out[:T].clone()
    g.release(slot)
    assert torch.equal(got, g.forward(*inputs))


def test_a_step_while_the_send_lock_is_held_waits_in_a_thread(group):
    """A heartbeat holds the send lock for a ping's round trip: the loop never waits on it; the step goes to
    a thread, which sends once the lock is free."""
    g = group
    slot = g.acquire_slot()
    inputs = _fill(slot, 90)
    held, in_thread = threading.Event(), threading.Event()
    run = g.run

    def run_in_thread(*args, **kwargs):
        in_thread.set()
        return run(*args, **kwargs)

    def hold():  # until the step has gone to a thread (a fixed hold lost the race on a stalled machine)
        with g._send_lock:
            held.set()
            in_thread.wait(10)

    g.run = run_in_thread
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        asyncio.run(g.run_async(slot, T))
    finally:
        del g.run
        holder.join()
    assert in_thread.is_set()
    assert [on_main for _, on_main in g.reads] == [False]
    got = slot.out[:T].clone()
    g.release(slot)
    assert torch.equal(got, g.forward(*inputs))
