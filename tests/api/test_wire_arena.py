"""The wire arena (service.api.arena, --wire-arena-mib): v2 binary bodies received into shared memory
that the ranks read, and answers the ranks write where the response sends them from.

The arena's blocks (the lead byte aligned, first fit, never overlapping a block some view still holds,
frees from any thread), where a tensor lies (`place`), its name refused to clients and its file swept
once its front end is gone, its object's ctime left alone by writes through its blocks (a moved ctime
makes a rank register its mapping again); a rank keeping an idle arena but not an unlinked one;
DirectBody receiving a v2 binary body there and no other body; the batcher handing arena pieces to a
real CPU rank group (R=2, bf16) as sources: answers equal the copy path's bit for bit, the front end
copies nothing for them, a NaN row gets its 400 (also where a front end i >= 1 runs such a step on its
event loop), a rank that cannot open the arena fails that request
with 503 and the arena's pieces take the copies from then on; a real server with a small arena:
answers right over concurrent clients, what does not fit counted and served by the copies.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import gzip
import json
import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

from service.api import arena as arena_module
from service.api import batcher as batcher_module
from service.api import regions
from service.api.arena import ALIGN, PAGE, WireArena
from service.api.batcher import Batcher
from service.api.connections import bounded_protocol
from service.config import LayerConfig, Settings
from service.errors import ConfigError, GroupUnavailable, InvalidInput
from service.fleet import WIRE_ARENA_DEFAULT_MIB, wire_arena_mib
from service.metrics import Metrics
from service.worker import direct
from service.worker.group import WorkerGroup
from service.worker.shm import ARENA_PREFIX, SlotPool, create_slots, remove_slots, remove_stale_slots
from tests.api.common import check, check_like_solo, inputs, uvicorn_serving
from tests.api.common import http_answers as answers
from tests.api.test_shm_direct import BUDGET, CFG, SIZES, rows_of  # the same layer and requests as --shm-direct's
from tests.helpers import routing
from tests.serverproc import ServerProcess

KIB = 1 << 10


@pytest.fixture
def arena():
    a = WireArena(64 * PAGE)
    yield a
    a.close()


# ---- blocks ------------------------------------------------------------------------------------


def test_blocks_are_aligned_disjoint_and_reused_only_when_no_view_is_left(arena):
    lead = 13
    a = arena.buffer(3 * PAGE + 5, lead=lead)
    b = arena.buffer(PAGE)
    place_a = arena.place(torch.frombuffer(a[lead:lead + 64], dtype=torch.uint8))
    assert place_a is not None and place_a[2] % ALIGN == 0, place_a
    assert place_a[:2] == (arena.key, arena.identity) and place_a[3] == (0, arena.size)
    a[:] = b"\x11" * len(a)
    b[:] = b"\x22" * len(b)
    # a's block stays held by a tensor made from a slice of it, and by a numpy view of that tensor
    held = torch.frombuffer(a[PAGE:2 * PAGE], dtype=torch.int16)
    view = memoryview(held.numpy()).cast("B")[10:20]
    del a, held
    assert arena.in_use() == 5 * PAGE  # 4 pages (the pad and 5 bytes spill over) + 1
    others = [arena.buffer(PAGE) for _ in range(59)]  # every page left
    assert all(o is not None for o in others) and arena.buffer(1) is None
    for other in others:
        other[:] = b"\x33" * len(other)
    del other
    assert bytes(view) == b"\x11" * 10 and bytes(b) == b"\x22" * PAGE, "a held block was handed out again"
    del view, others
    assert arena.in_use() == PAGE  # b's
    del b
    assert arena.in_use() == 0 and arena._free == [(0, arena.size)], arena._free  # merged back into one
    assert arena.buffer(arena.size) is not None


def test_frees_from_other_threads_all_come_back(arena):
    def churn(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            v = arena.buffer(int(rng.integers(1, 3 * PAGE)))
            if v is not None:
                v[:1] = b"x"
            del v

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert arena.in_use() == 0 and arena._free == [(0, arena.size)]


def test_place_is_only_for_contiguous_rows_in_the_arena(arena):
    rows = arena.rows(4, 8, torch.bfloat16)
    at = arena.place(rows)[2]
    assert arena.place(rows[1:3])[2] == at + 8 * 2
    assert arena.place(rows[:, :4]) is None  # not contiguous
    assert arena.place(torch.zeros(4, 8)) is None  # not in the arena
    assert arena.rows(1, 64 * PAGE, torch.float32) is None  # no room


def test_writes_through_blocks_leave_the_objects_size_and_ctime(arena):
    """A rank takes a moved (st_size, st_ctime_ns) for a changed object and registers it again, so the
    arena's pages are faulted in when it is made and no later write through a block moves either."""
    def stamp():
        st = os.stat(arena.path)
        return st.st_size, st.st_ctime_ns

    before = stamp()
    time.sleep(0.02)
    for _ in range(3):
        v = arena.buffer(20 * PAGE)
        v[:] = os.urandom(len(v))
        del v
    assert stamp() == before


def test_clients_cannot_name_the_arena_and_the_ranks_can(arena):
    with pytest.raises(InvalidInput, match="this server's own"):
        direct.key_path(arena.key)
    table = regions.RegionTable.create()
    try:
        with pytest.raises(InvalidInput, match="this server's own"):
            regions.Regions(table).register("a", arena.key, 0, PAGE)
    finally:
        table.close()
    assert direct.source_path(arena.key) == arena.path
    assert direct.source_path("/client-object") == os.path.join(direct.SHM_ROOT, "client-object")
    with pytest.raises(InvalidInput):
        direct.source_path(f"/{ARENA_PREFIX}x/../y")


def _arena_of_a_dying_process(conn) -> None:
    conn.send(WireArena(PAGE).path)  # (a pipe's send is done when it returns: nothing left to flush)
    os._exit(0)  # no close(): the file stays, unlocked


def test_a_gone_front_ends_arena_is_swept_and_a_live_ones_is_kept(arena):
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_arena_of_a_dying_process, args=(there,))
    proc.start()
    assert here.poll(60)
    stale = here.recv()
    proc.join(60)
    assert os.path.exists(stale)
    remove_stale_slots()
    assert not os.path.exists(stale) and os.path.exists(arena.path)


def test_a_rank_keeps_an_idle_arena_and_lets_an_unlinked_one_go(arena, monkeypatch):
    objects = direct.Objects(cuda=False)
    objects.get(arena.key, arena.identity, (0, arena.size), set())
    later = time.monotonic() + direct.IDLE_S + 1
    monkeypatch.setattr(direct.time, "monotonic", lambda: later)
    objects.prune(force=True)
    assert len(objects) == 1, "an idle arena was let go"
    arena.close()
    objects.prune(force=True)
    assert len(objects) == 0, "an unlinked arena is still held"


def test_a_full_dev_shm_leaves_the_server_without_an_arena(monkeypatch, caplog):
    """Its pages are reserved before they are written (a write past a full tmpfs is a SIGBUS): ENOSPC
    there is a warning, no arena (the copies serve), and no file left behind."""
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    before = set(os.listdir(direct.SHM_ROOT))
    monkeypatch.setattr(arena_module.os, "posix_fallocate", full)
    assert arena_module.make_arena(4) is None
    assert "No space left on device" in caplog.text and "copies" in caplog.text
    assert set(os.listdir(direct.SHM_ROOT)) - before == set()


def test_the_arena_is_on_where_the_ranks_are_cuda_and_bounded():
    assert wire_arena_mib(Settings(), "cuda", 4)[0] == WIRE_ARENA_DEFAULT_MIB
    assert wire_arena_mib(Settings(), "cpu", 1)[0] == 0
    assert wire_arena_mib(Settings(wire_arena_mib=0), "cuda", 4)[0] == 0
    assert wire_arena_mib(Settings(wire_arena_mib=8), "cpu", 1) == (8, "wire_arena_mib=8 was asked for")
    assert wire_arena_mib(Settings(frontends=16), "cuda", 16)[0] == 128  # their share of the bound
    with pytest.raises(ConfigError, match="at most 2048 MiB"):
        wire_arena_mib(Settings(wire_arena_mib=1024, frontends=4), "cuda", 4)


# ---- the body's receive (service.api.connections.DirectBody) -----------------------------------

SEEN: list[bool] = []  # per request the app answered: whether its body lay in the arena
APP_ARENA: list[WireArena] = []


async def where_app(scope, receive, send) -> None:
    """Answers 200 once the body is read; notes whether it arrived as one view in the arena."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if not message.get("more_body", False):
            break
    body = messages[0]["body"]
    SEEN.append(len(messages) == 1 and len(body) > 0
                and APP_ARENA[0].place(torch.frombuffer(body, dtype=torch.uint8)) is not None)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def test_a_v2_binary_body_lands_in_the_arena_and_other_bodies_do_not():
    arena = WireArena(64 * PAGE)
    full: list[int] = []
    APP_ARENA[:] = [arena]
    protocol = functools.partial(bounded_protocol("httptools", 8 << 20, arena=arena,
                                                  on_arena_full=lambda: full.append(1)),
                                 idle_timeout_s=30, max_connections=8)
    header = b'{"inputs": []}'
    big = os.urandom(100 * KIB)

    def post(path: str, data: bytes, extra: str = "") -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n{extra}\r\n".encode() + data)
            assert answers(s, 1)[0][0] == 200

    try:
        with uvicorn_serving(where_app, protocol) as port:
            binary = f"Inference-Header-Content-Length: {len(header)}\r\n"
            post("/v2/models/moe/infer", header + big, binary)
            post("/v2/models/moe/infer", header + big)                     # JSON (no header length): not
            post("/echo", header + big, binary)                            # not an infer route
            post("/v2/models/moe/infer", gzip.compress(header + big), binary + "Content-Encoding: gzip\r\n")
            post("/v2/models/moe/infer", header + os.urandom(70 * PAGE), binary)  # does not fit: counted
            post("/v2/models/moe/infer", header + big, binary)              # after a refusal: in again
    finally:
        arena.close()
    assert SEEN == [True, False, False, False, False, True], SEEN
    assert full == [1]
    assert arena.in_use() == 0


# ---- the batcher and a real rank group ---------------------------------------------------------

NAN = float("nan")


@pytest.fixture(scope="module")
def group():
    with WorkerGroup(CFG, seed=3, slots=2) as g:  # (direct_regions off: the arena needs no flag)
        yield g


def in_arena(arena: WireArena, x: torch.Tensor) -> torch.Tensor:
    """x's rows copied into a block of the arena (as a body's would be received), at an odd lead."""
    n = x.numel() * x.element_size()
    view = arena.buffer(n + 7, lead=7)
    rows = torch.frombuffer(view[7:], dtype=x.dtype).view(x.shape)
    rows.copy_(x)
    return rows


def jobs_of(arena: WireArena, sizes, nan_at=None):
    """(x, ids, w, out) per request: bf16 rows and answers in the arena, then a wire request (not in the
    arena) and an fp32 one in the arena (another dtype: copied)."""
    jobs = []
    for i, (seed, T) in enumerate(sizes):
        x, ids, w = rows_of(T, seed)
        if nan_at is not None and nan_at[0] == i:
            x[nan_at[1], 5] = NAN
        out = arena.rows(T, CFG.H, torch.bfloat16)
        out.fill_(NAN)
        jobs.append((in_arena(arena, x), ids, w, out))
    x, ids, w = rows_of(5, 900)
    jobs.append((x, ids, w, None))
    x, ids, w = rows_of(3, 901, torch.float32)
    jobs.append((in_arena(arena, x), ids, w, arena.rows(3, CFG.H, torch.float32)))
    return jobs


@pytest.fixture
def copies(monkeypatch):
    """The dtypes of the rows the front end copied into a slot or out of one."""
    seen: list[tuple[str, torch.dtype]] = []
    copy_in, copy_out = batcher_module._copy_in, batcher_module._copy_out
    monkeypatch.setattr(batcher_module, "_copy_in", lambda dst, src, *a: (seen.append(("in", src.dtype)),
                                                                           copy_in(dst, src, *a))[1])
    monkeypatch.setattr(batcher_module, "_copy_out", lambda dst, src, *a: (seen.append(("out", dst.dtype)),
                                                                            copy_out(dst, src, *a))[1])
    return seen


def serve(group, jobs, arena: WireArena | None, timeout_s: float = 30.0, batchers: list | None = None):
    """Submit every job at once (so they share steps) to a batcher using `arena` (None: the copies):
    each one's answer (a copy) or its error."""
    async def main():
        b = Batcher(budget=BUDGET, delay_s=0.05, queue_tokens=10_000, slots=2, metrics=Metrics())
        b.arena = arena
        b.start()
        b.attach(group)
        if batchers is not None:
            batchers.append(b)
        try:
            return await asyncio.gather(*(b.submit(x, ids, w, timeout_s, out=out) for x, ids, w, out in jobs),
                                        return_exceptions=True)
        finally:
            await b.close(timeout_s=10)

    got = asyncio.run(main())
    return [g if isinstance(g, BaseException) else g.clone() for g in got]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                       b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def test_arena_answers_equal_the_copy_paths_and_the_front_end_copies_none(group, arena, copies):
    jobs = jobs_of(arena, SIZES)
    copied = serve(group, jobs, None)
    assert ("in", torch.bfloat16) in copies  # (without the arena the front end copies them itself)
    copies.clear()
    for _, _, _, out in jobs:
        if out is not None:
            out.fill_(NAN)
    got = serve(group, jobs, arena)
    # the ranks read and wrote the bf16 arena pieces; the front end copied the wire one and the fp32 one
    assert set(copies) == {("in", torch.bfloat16), ("in", torch.float32), ("out", torch.bfloat16),
                           ("out", torch.float32)}, copies
    assert copies.count(("in", torch.bfloat16)) == 1, "an arena piece was copied in by the front end"
    for i, (a, b) in enumerate(zip(got, copied, strict=True)):
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (i, a, b)
        assert same(a, b), i


@pytest.mark.parametrize("where", ["first step", "second step"])
def test_a_nan_row_in_the_arena_gets_its_400_and_its_batch_mates_are_answered(group, arena, where):
    row = 4 if where == "first step" else BUDGET + 3
    jobs = jobs_of(arena, SIZES, nan_at=(2, row))
    copied = serve(group, jobs, None)
    got = serve(group, jobs, arena)
    assert isinstance(got[2], InvalidInput) and isinstance(copied[2], InvalidInput)
    assert str(got[2]) == str(copied[2]) == f"hidden_states contains NaN or infinity (row {row})"
    for i, (a, b) in enumerate(zip(got, copied, strict=True)):
        if i != 2:
            assert same(a, b), i


def test_an_arena_the_ranks_cannot_open_fails_its_request_with_503_then_takes_the_copies(group, caplog):
    """Its name removed under the server (a rank opens it by name when a source first names it): that
    request gets 503, the error is logged once, and the same batcher's later arena requests are served
    by the front end's copies, right."""
    arena = WireArena(64 * PAGE)
    os.unlink(arena.path)  # (the rank group has never opened this arena)
    try:
        jobs = jobs_of(arena, ((21, 3),))[:1]
        batchers: list[Batcher] = []

        async def main():
            b = Batcher(budget=BUDGET, delay_s=0.0, queue_tokens=10_000, slots=2, metrics=Metrics())
            b.arena = arena
            b.start()
            b.attach(group)
            batchers.append(b)
            try:
                first = await asyncio.gather(*(b.submit(x, ids, w, 30.0, out=out) for x, ids, w, out in jobs),
                                             return_exceptions=True)
                second = await asyncio.gather(*(b.submit(x, ids, w, 30.0, out=out) for x, ids, w, out in jobs),
                                              return_exceptions=True)
                return first, second
            finally:
                await b.close(timeout_s=10)

        first, second = asyncio.run(main())
        assert isinstance(first[0], GroupUnavailable) and "wire arena" in str(first[0]), first
        assert not isinstance(second[0], BaseException), second
        assert same(second[0], serve(group, jobs, None)[0])
        assert sum("could not use the wire arena" in r.message for r in caplog.records) == 1
    finally:
        arena.close()


class _OnLoop:
    """`group` as a front end i >= 1 sees its owner's (service.replica.RemoteGroup): it also has `run_async`,
    whose steps the batcher runs on the event loop when every piece is direct. Counts which way each step
    went (the owner's run itself happens in a thread here, as the owner's thread would)."""

    def __init__(self, group):
        self.group = group
        self.direct_regions = group.direct_regions
        self.ways: list[str] = []

    def acquire_slot(self, timeout=None):
        return self.group.acquire_slot(timeout)

    def release(self, slot) -> None:
        self.group.release(slot)

    def run(self, slot, T, sources=()):
        self.ways.append("thread")
        return self.group.run(slot, T, sources)

    async def run_async(self, slot, T, sources=(), executor=None):
        assert threading.current_thread() is threading.main_thread(), "run_async off the event loop"
        self.ways.append("loop")
        return await asyncio.to_thread(self.group.run, slot, T, sources)


def test_steps_of_arena_pieces_run_on_the_loop_and_answer_as_the_copies_do(group, arena, copies):
    """A group with run_async: a step whose pieces all lie in the arena runs on the event loop (no step
    thread, no copy), others in a step thread; every answer equals the copy path's, bit for bit."""
    solo = jobs_of(arena, ((41, 6),))[:1]  # one arena request alone: its step is all direct
    mixed = jobs_of(arena, SIZES)          # arena requests with a wire one and an fp32 one: copies too
    want = serve(group, solo + mixed, None)
    for _, _, _, out in solo + mixed:
        if out is not None:
            out.fill_(NAN)
    copies.clear()
    loop_group = _OnLoop(group)
    got = serve(loop_group, solo, arena) + serve(loop_group, mixed, arena)
    assert loop_group.ways[0] == "loop" and "thread" in loop_group.ways, loop_group.ways
    assert copies.count(("in", torch.bfloat16)) == 1, "an arena piece was copied in by the front end"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (i, a, b)
        assert same(a, b), i


def test_a_nan_row_in_a_step_on_the_loop_gets_its_400_and_its_batch_mates_are_answered(group, arena):
    sizes = ((51, 7), (52, 5), (53, 9))
    jobs = jobs_of(arena, sizes, nan_at=(1, 3))[:len(sizes)]  # arena requests only: every step on the loop
    want = serve(group, jobs, None)
    loop_group = _OnLoop(group)
    got = serve(loop_group, jobs, arena)
    assert set(loop_group.ways) == {"loop"}, loop_group.ways
    assert isinstance(got[1], InvalidInput) and str(got[1]) == str(want[1]) == \
        "hidden_states contains NaN or infinity (row 3)"
    for i in (0, 2):
        assert same(got[i], want[i]), i


class _GatedOnLoop(_OnLoop):
    """_OnLoop whose steps on the loop wait for `gate` before the owner runs them (`entered`: one waits)."""

    def __init__(self, group):
        super().__init__(group)
        self.entered, self.gate = asyncio.Event(), asyncio.Event()

    async def run_async(self, slot, T, sources=(), executor=None):
        self.entered.set()
        await self.gate.wait()
        return await super().run_async(slot, T, sources, executor)


def test_a_cancelled_step_on_the_loop_keeps_its_slot_until_the_owner_has_answered(group, arena):
    """As a step thread keeps its slot when its caller is cancelled: the slot comes back, and the request gets
    its error, only once the step itself has returned, never while the owner may still run it."""
    jobs = jobs_of(arena, ((61, 4),))[:1]

    async def main():
        gated = _GatedOnLoop(group)
        b = Batcher(budget=BUDGET, delay_s=0.0, queue_tokens=10_000, slots=2, metrics=Metrics())
        b.arena = arena
        b.start()
        b.attach(gated)
        free = group._free._free.qsize()
        try:
            request = asyncio.ensure_future(b.submit(*jobs[0][:3], 30.0, out=jobs[0][3]))
            await asyncio.wait_for(gated.entered.wait(), 10)
            outer = [t for t in b._steps if t.get_coro().__name__ == "_step"]
            assert len(outer) == 1
            outer[0].cancel()
            await asyncio.sleep(0.2)
            assert group._free._free.qsize() == free - 1, "the slot came back while its step may still run"
            assert not request.done(), "the request's error went out while the ranks may still write its answer"
            gated.gate.set()
            with pytest.raises(GroupUnavailable):
                await asyncio.wait_for(request, 10)
            for _ in range(200):
                if group._free._free.qsize() == free:
                    break
                await asyncio.sleep(0.05)
            assert group._free._free.qsize() == free, "the slot never came back"
            assert gated.ways == ["loop"]
        finally:
            gated.gate.set()
            await b.close(timeout_s=10)

    asyncio.run(main())


class _LateGroup:
    """A group whose step fails after its sources were sent (a front end i >= 1 giving up on the owner),
    as if a rank could still write them later; `run_async` too, as a front end i >= 1's group has."""

    direct_regions = False

    def __init__(self):
        self.slots = create_slots(CFG, 1)
        self._free = SlotPool(self.slots)
        self.sources: list = []
        self.ways: list[str] = []

    def acquire_slot(self, timeout=None):
        return self._free.get(timeout)

    def release(self, slot) -> None:
        self._free.put(slot)

    def run(self, slot, T, sources=()):
        self.sources.extend(sources)
        raise GroupUnavailable("the owner process did not answer step within 70 s")

    async def run_async(self, slot, T, sources=(), executor=None):
        self.ways.append("loop")
        return self.run(slot, T, sources)


class _LateThreadGroup(_LateGroup):
    run_async = None  # (a group without run_async: every step in a step thread)


@pytest.mark.parametrize("late_group", [_LateThreadGroup, _LateGroup], ids=["step thread", "event loop"])
def test_a_failed_steps_arena_blocks_are_not_handed_out_again_while_its_group_lives(arena, caplog, late_group):
    late = late_group()
    jobs = jobs_of(arena, ((31, 4),))[:1]
    batchers: list[Batcher] = []  # (a front end's batcher lives as long as its arena)
    try:
        got = serve(late, jobs, arena, batchers=batchers)
    finally:
        remove_slots(late.slots)
    assert isinstance(got[0], GroupUnavailable) and len(late.sources) == 1
    assert late.ways == (["loop"] if late_group is _LateGroup else []), late.ways
    held = arena.in_use()
    del jobs, got
    gc.collect()
    assert arena.in_use() == held > 0, "a failed step's blocks came back"
    assert "kept from reuse until the next rank group" in caplog.text


def test_a_new_group_gives_a_failed_steps_blocks_back(arena, group):
    """A group is attached only once the one before it is closed: the blocks come back then."""
    late = _LateThreadGroup()
    jobs = jobs_of(arena, ((32, 4),))[:1]
    batchers: list[Batcher] = []
    try:
        assert isinstance(serve(late, jobs, arena, batchers=batchers)[0], GroupUnavailable)
    finally:
        remove_slots(late.slots)
    del jobs
    assert arena.in_use() > 0
    batchers[0].attach(group)
    assert arena.in_use() == 0


# ---- nothing of a request waits for the cyclic collector ---------------------------------------

RIG_CFG = LayerConfig(E=8, H=256, I=64, K=2, R=1, C=256, dtype=torch.float32)


class _FrontEnd:
    """One front end in this process (batcher, Frontend, the HTTP app on uvicorn with the arena) before
    a real CPU rank group."""

    def __init__(self, arena: WireArena):
        from service.api.frontend import Frontend
        from service.api.http import create_app

        self.group = WorkerGroup(RIG_CFG, seed=1, slots=2)
        self.group.start()
        metrics = Metrics()
        self.batcher = Batcher(budget=RIG_CFG.tokens_per_step, delay_s=0.001, queue_tokens=100_000, slots=2,
                               metrics=metrics)
        self.fe = Frontend(Settings(), RIG_CFG, metrics, self.batcher)
        self.fe.arena = self.batcher.arena = arena
        self.app = create_app(self.fe)
        self.protocol = functools.partial(bounded_protocol("httptools", 64 << 20, 0, arena, metrics.arena_full.inc),
                                          idle_timeout_s=30, max_connections=16)

        async def app_(scope, receive, send):
            if self.batcher.group is None:  # (first call: on uvicorn's loop)
                self.batcher.start()
                self.batcher.attach(self.group)
                self.fe.set_ready(True)  # (and the arena's warm-up row)
            await self.app(scope, receive, send)

        self.app_ = app_


def rig_body(T: int, seed: int, nan_row: int | None = None) -> tuple[bytes, int]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, RIG_CFG.H, generator=gen)
    if nan_row is not None:
        x[nan_row, 0] = NAN
    ids, w = routing(T, RIG_CFG.E, RIG_CFG.K, "balanced", gen)
    tensors = (("hidden_states", "FP32", x), ("topk_ids", "INT32", ids.to(torch.int32)), ("topk_weights", "FP32", w))
    header = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": list(t.shape),
                                     "parameters": {"binary_data_size": t.numel() * 4}} for n, d, t in tensors],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    return header + b"".join(t.contiguous().numpy().tobytes() for _, _, t in tensors), len(header)


def test_no_request_leaves_its_blocks_to_the_cyclic_collector():
    """With the collector off: an answer, a NaN row's 400, a body cut off by a client that leaves, a
    client that leaves after its body and a deadline's 504 all give their blocks back at once (a
    traceback or the body's closure in a reference cycle held them until a collection)."""
    arena = WireArena(4096 * PAGE)
    front = _FrontEnd(arena)

    def send(data: bytes, header: int, extra: str = "", cut: int | None = None, read: bool = True):
        head = (f"POST /v2/models/moe/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                f"Inference-Header-Content-Length: {header}\r\n{extra}\r\n").encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(head + data[:cut])
            if read:
                return answers(s, 1)[0][0]
            time.sleep(0.3)
        return None

    def settled() -> int:
        deadline = time.monotonic() + 5
        while arena.in_use() and time.monotonic() < deadline:
            time.sleep(0.05)
        return arena.in_use()

    gc.disable()
    try:
        with uvicorn_serving(front.app_, front.protocol) as port:
            assert send(*rig_body(100, 1)) == 200
            assert settled() == 0
            assert send(*rig_body(100, 2, nan_row=7)) == 400
            assert settled() == 0, "a 400's blocks wait for the collector"
            data, header = rig_body(200, 3)
            send(data, header, cut=len(data) // 2, read=False)
            assert settled() == 0, "a body cut off waits for the collector"
            send(data, header, read=False)
            assert settled() == 0, "a client gone after its body: its blocks wait for the collector"
            assert send(data, header, extra="X-Request-Timeout: 0.000001\r\n") == 504
            assert settled() == 0
    finally:
        gc.enable()
        front.group.close()
        arena.close()


# ---- a real server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess.serving(tmp_path_factory.mktemp("arena") / "server.log", "--wire-arena-mib", "1") as proc:
        yield proc


def v2_binary(url: str, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[int, torch.Tensor | str]:
    """One v2 binary request over a connection of its own: (status, answer or error text)."""
    import httpx

    tensors = (("hidden_states", "FP32", x), ("topk_ids", "INT32", ids.to(torch.int32)), ("topk_weights", "FP32", w))
    header = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": list(t.shape),
                                     "parameters": {"binary_data_size": t.numel() * 4}} for n, d, t in tensors],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    body = header + b"".join(t.contiguous().numpy().tobytes() for _, _, t in tensors)
    r = httpx.post(f"{url}/v2/models/moe/infer", content=body, timeout=60,
                   headers={"Inference-Header-Content-Length": str(len(header))})
    if r.status_code != 200:
        return r.status_code, r.json()["error"]
    n = int(r.headers["inference-header-content-length"])
    return 200, torch.frombuffer(bytearray(r.content[n:]), dtype=torch.float32).view(x.shape)


def metric_value(url: str, name: str) -> float:
    """The server's unlabelled metric `name` from /metrics."""
    import httpx

    text = httpx.get(f"{url}/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name)))


def full_count(url: str) -> float:
    return metric_value(url, "moe_wire_arena_full_total")


def test_a_server_with_a_small_arena_answers_every_client_right(server):
    """A 1 MiB arena (the cpu preset: fp32, H=256, 1 KiB a row): concurrent requests of T=100 fit
    (body and answer ~200 KiB), some of them find it full and take the copies; T=600 never fits (its
    body alone is 600 KiB, its answer too). Each answer equals its solo answer and the reference; a
    NaN row gets its 400 naming the row."""
    assert "wire arena: 1 MiB" in server.log()
    deadline = time.monotonic() + 30
    while "the ranks opened the wire arena" not in server.log():  # its warm-up row, once the group served
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.1)
    url = server.url
    before = full_count(url)
    work = [inputs(100, 500 + i) for i in range(6)] + [inputs(600, 600)]
    results: list = [None] * len(work)

    def run(i: int) -> None:
        results[i] = v2_binary(url, *work[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (status, out) in enumerate(results):
        assert status == 200, (i, out)
        check(out, *work[i])
        solo = v2_binary(url, *work[i])[1]
        check_like_solo(out, solo, what=i)  # (the cpu preset's fp32, as check())
    assert full_count(url) >= before + 1  # T=600 at least
    x, ids, w = inputs(100, 700)
    x[37, 3] = NAN
    assert v2_binary(url, x, ids, w) == (400, "hidden_states contains NaN or infinity (row 37)")


def test_the_arenas_names_are_among_the_servers_own():
    """What keeps a client from registering an arena (key_path refuses the server's own prefix)."""
    assert arena_module.ARENA_PREFIX.startswith(direct.OWN_PREFIX)


def test_a_killed_front_ends_arena_is_removed_and_its_successor_warms_its_own(tmp_path):
    """--frontends 2: each front end makes an arena and warms it up; front end 1 killed, its arena's
    file is removed (a rank would otherwise keep it open, page-locked on CUDA, until the next group) and
    the restarted one warms its new arena up, though it learnt of the group before it served."""
    import re
    import signal

    with ServerProcess.serving(tmp_path / "server.log", "--frontends", "2", "--wire-arena-mib", "1") as proc:
        def arenas() -> list[str]:
            return re.findall(r"wire arena: 1 MiB at (\S+)", proc.log())

        def wait(what, timeout: float = 90) -> None:
            deadline = time.monotonic() + timeout
            while not what():
                assert time.monotonic() < deadline, proc.log()[-3000:]
                time.sleep(0.2)

        wait(lambda: len(arenas()) == 2 and proc.log().count("the ranks opened the wire arena") == 2)
        (fe1,) = proc.frontend_pids()
        theirs = [a for a in arenas() if os.path.exists(a)]
        assert len(theirs) == 2
        os.kill(fe1, signal.SIGKILL)
        wait(lambda: len(arenas()) == 3 and proc.log().count("the ranks opened the wire arena") == 3)
        gone = [a for a in theirs if not os.path.exists(a)]
        assert len(gone) == 1, (theirs, gone)
        assert os.path.exists(arenas()[2])
        x, ids, w = inputs(100, 800)
        status, out = v2_binary(proc.url, x, ids, w)
        assert status == 200
        check(out, x, ids, w)
