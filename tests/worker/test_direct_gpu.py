"""A CUDA rank's direct rows (--shm-direct, service.worker.direct): rows DMA'd from a client's region
through its page-locked mapping and the answer DMA'd into another, with and without copy streams,
for the fused and the serial backend (R=1). Answers equal the slot path's bit for bit (the same rows
in the same step, one source at a client's odd byte offset among slot rows); a NaN row is reported as
the source's row and zeroed before the layer reads it (its batch-mates unchanged); an object
truncated below its region is reported "truncated" and nothing is written; objects grown, or
truncated and grown back to their size, give the new rows and get the answer (the region registered
again); a region in a 512 TiB sparse object is mapped alone (only its pages populated) and a region
past the ranks' byte bound is its source's error, the step's others answered; an object grown
between a step's two lookups of it (in this process) keeps what the step holds. A front end's wire
arena (service.api.arena) as the source's object: answers equal the slot path's over steps whose rows
and answers take fresh blocks, and the arena is registered once however often the front end writes it."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from service.config import LayerConfig
from service.worker import direct
from service.worker.group import WorkerGroup
from tests.helpers import routing

pytestmark = pytest.mark.gpu

CFG = LayerConfig(E=16, H=512, I=384, K=4, R=1, C=256, dtype=torch.bfloat16)
SEED = 4
T = 201
SOURCE = (37, 100)  # slot rows [37, 137) come from an object
OFFSET = 4096 + 6   # their first byte there (not a multiple of the row's bytes, nor of the page)
ROW_BYTES = CFG.H * CFG.dtype.itemsize


class ShmObject:
    def __init__(self, size: int):
        self.key = f"/moe11z-gpu-{uuid.uuid4().hex[:12]}"
        self.path = f"{direct.SHM_ROOT}/{self.key[1:]}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.ident = direct.identity(fd)
        finally:
            os.close(fd)

    def write(self, t: torch.Tensor, at: int) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, direct.memory(t.contiguous()), at)
        finally:
            os.close(fd)

    def read(self, at: int, rows: int) -> torch.Tensor:
        t = torch.empty(rows, CFG.H, dtype=CFG.dtype)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.preadv(fd, [direct.memory(t)], at)
        finally:
            os.close(fd)
        return t

    def remove(self) -> None:
        os.unlink(self.path)


def step_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, CFG.H, generator=gen).to(CFG.dtype)
    ids, w = routing(T, CFG.E, CFG.K, "balanced", gen)
    return x, ids.to(torch.int32), w


def slot_path(group, x, ids, w) -> torch.Tensor:
    slot = group.acquire_slot(timeout=60)
    try:
        slot.x[:T].copy_(x)
        slot.ids[:T].copy_(ids)
        slot.w[:T].copy_(w)
        group.run(slot, T)
        return slot.out[:T].clone()
    finally:
        group.release(slot)


def source(obj_in: ShmObject, obj_out: ShmObject, at: int = OFFSET, region=None) -> tuple:
    """SOURCE's rows at byte `at` of obj_in, their answer at `at` of obj_out; each object's region
    (as registered: what a rank maps) starts at the page before `at` and ends after the rows."""
    row, rows = SOURCE
    region = region or (at - at % 4096, at % 4096 + rows * ROW_BYTES)
    return (row, rows, obj_in.key, obj_in.ident, at, obj_out.key, obj_out.ident, at, region, region)


def direct_path(group, x, ids, w, obj_in: ShmObject, obj_out: ShmObject):
    """The step with SOURCE's rows in obj_in (at OFFSET) and their answer into obj_out (at OFFSET):
    (the answer's rows, the step's stats)."""
    row, rows = SOURCE
    obj_in.write(x[row:row + rows], OFFSET)
    obj_out.write(torch.full((rows, CFG.H), float("nan"), dtype=CFG.dtype), OFFSET)
    return step_with_source(group, x, ids, w, source(obj_in, obj_out), lambda: obj_out.read(OFFSET, rows))


def step_with_source(group, x, ids, w, src: tuple, answered):
    """One step of x, ids, w whose SOURCE rows come from `src` (their slot rows poisoned: never read):
    (the answer, with the source's rows from `answered()`, and the step's stats)."""
    row, rows = SOURCE
    slot = group.acquire_slot(timeout=60)
    try:
        slot.x[:T].copy_(x)
        slot.x[row:row + rows].fill_(float("nan"))
        slot.ids[:T].copy_(ids)
        slot.w[:T].copy_(w)
        slot.out.fill_(float("nan"))
        stats = group.run(slot, T, [src])
        answer = slot.out[:T].clone()
        assert answer[row:row + rows].isnan().all(), "the source's answer went into the slot"
        answer[row:row + rows] = answered()
        return answer, stats
    finally:
        group.release(slot)


GROUPS = [(backend, streams) for backend in ("fused", "serial") for streams in (False, True)]


@pytest.fixture(scope="module", params=GROUPS, ids=lambda p: f"{p[0]}-{'streams' if p[1] else 'one-stream'}")
def group(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    backend, streams = request.param
    with WorkerGroup(CFG, device="cuda", seed=SEED, backend=backend, copy_streams=streams,
                     direct_regions=True, start_timeout_s=600) as g:
        assert g.backend == backend and g.copy_streams == streams
        yield g


@pytest.fixture
def objects():
    size = OFFSET + SOURCE[1] * ROW_BYTES
    made = [ShmObject(size), ShmObject(size)]
    yield made
    for o in made:
        o.remove()


def test_direct_rows_equal_the_slot_paths(group, objects):
    """The same objects every step: mapped once, and again after they grew (before the third)."""
    for seed in range(3):
        if seed == 2:
            for o in objects:
                os.truncate(o.path, os.stat(o.path).st_size + (1 << 20))
        x, ids, w = step_inputs(seed)
        want = slot_path(group, x, ids, w)
        got, stats = direct_path(group, x, ids, w, *objects)
        assert stats.sources == {}, stats.sources
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), seed


def test_a_nan_row_is_reported_and_zeroed(group, objects):
    x, ids, w = step_inputs(7)
    row, _ = SOURCE
    bad = 11
    x_nan = x.clone()
    x_nan[row + bad, 5] = float("nan")
    got, stats = direct_path(group, x_nan, ids, w, *objects)
    assert stats.sources == {0: bad}, stats.sources
    zeroed = x.clone()
    zeroed[row + bad] = 0
    want = slot_path(group, zeroed, ids, w)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("side", [0, 1])
def test_a_truncated_object_is_reported_and_not_written(group, objects, side):
    """Truncated after a step used it (mapped, page-locked): the size check before the DMA refuses it."""
    x, ids, w = step_inputs(8)
    obj_in, obj_out = objects
    row, rows = SOURCE
    _, stats = direct_path(group, x, ids, w, obj_in, obj_out)
    assert stats.sources == {}, stats.sources
    slot = group.acquire_slot(timeout=60)
    try:
        slot.x[:T].copy_(x)
        slot.ids[:T].copy_(ids)
        slot.w[:T].copy_(w)
        os.truncate(objects[side].path, OFFSET)
        stats = group.run(slot, T, [source(obj_in, obj_out)])
        report = stats.sources[0]
        assert report[:2] == (("in", "out")[side], "truncated"), report
        want = slot_path(group, x, ids, w)
        got = slot.out[:T]
    finally:
        group.release(slot)
    keep = torch.ones(T, dtype=torch.bool)
    keep[row:row + rows] = False
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16)), "the batch-mates changed"


def test_truncated_and_grown_back_objects_give_the_new_rows_and_get_the_answer(group, objects):
    """After a step used them (registered), the client truncates its objects to nothing and grows them
    back to their size (same inode, same size: the registered pages are orphaned): the next step reads
    the new rows and its answer lands in the file (the ranks register the regions again)."""
    x, ids, w = step_inputs(20)
    _, stats = direct_path(group, x, ids, w, *objects)
    assert stats.sources == {}, stats.sources
    for o in objects:
        size = os.stat(o.path).st_size
        os.truncate(o.path, 0)
        os.truncate(o.path, size)
    x, ids, w = step_inputs(21)
    want = slot_path(group, x, ids, w)
    got, stats = direct_path(group, x, ids, w, *objects)  # (its answer's rows read back from the file)
    assert stats.sources == {}, stats.sources
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_huge_sparse_object_maps_its_region_alone_and_a_region_past_the_bound_fails_alone(group):
    """A region near the middle of a 512 TiB sparse object: its rows are answered, and only its pages
    are populated; in the same step, a source whose region claims more than the ranks' byte bound
    (the batcher never sends one) is that source's error, not the step's."""
    huge = ShmObject(512 << 40)
    small_in, small_out = ShmObject(OFFSET + SOURCE[1] * ROW_BYTES), ShmObject(OFFSET + SOURCE[1] * ROW_BYTES)
    try:
        x, ids, w = step_inputs(22)
        want = slot_path(group, x, ids, w)
        row, rows = SOURCE
        at = (256 << 40) + 6
        huge.write(x[row:row + rows], at)
        slot = group.acquire_slot(timeout=60)
        try:
            slot.x[:T].copy_(x)
            slot.ids[:T].copy_(ids)
            slot.w[:T].copy_(w)
            slot.out.fill_(float("nan"))
            first = source(huge, huge, at)  # input and output in one region: one mapping
            first = (row, 60, *first[2:4], at, *first[5:7], at + rows * ROW_BYTES,
                     (at - 6, 6 + 2 * rows * ROW_BYTES), (at - 6, 6 + 2 * rows * ROW_BYTES))
            past = (row + 60, rows - 60, small_in.key, small_in.ident, OFFSET, small_out.key, small_out.ident,
                    OFFSET, (0, direct.MAX_BYTES + 1), (0, OFFSET + rows * ROW_BYTES))
            stats = group.run(slot, T, [first, past])
            out = slot.out[:T].clone()
        finally:
            group.release(slot)
        assert stats.sources.get(0) is None and stats.sources[1][:2] == ("in", "error"), stats.sources
        fd = os.open(huge.path, os.O_RDONLY)
        try:
            answer = torch.empty(60, CFG.H, dtype=CFG.dtype)
            os.preadv(fd, [direct.memory(answer)], at + rows * ROW_BYTES)
        finally:
            os.close(fd)
        assert torch.equal(answer.view(torch.int16), want[row:row + 60].view(torch.int16))
        assert out[row:row + 60].isnan().all(), "the huge object's answer went into the slot"
        keep = torch.ones(T, dtype=torch.bool)
        keep[row:row + rows] = False
        assert torch.equal(out[keep].view(torch.int16), want[keep].view(torch.int16)), "the batch-mates changed"
        assert os.stat(huge.path).st_blocks * 512 < 64 << 20, "the ranks populated more than the region"
    finally:
        for o in (huge, small_in, small_out):
            o.remove()


def test_an_object_grown_between_a_steps_two_lookups_of_it_in_process(monkeypatch):
    """In this process, real CUDA: a source's input and output in one region, and a second source in
    another region of the same object; the client grows the object after the plan's first lookup:
    the step keeps what it holds (the rows DMA'd in are the object's, the answer lands in it), and
    the next plan registers the grown object's region again."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from service.worker.rank import _dma_in, _dma_out

    n = 16
    o = ShmObject(1 << 20)
    try:
        rows = torch.randn(2 * n, CFG.H).to(CFG.dtype)
        o.write(rows[:n], 0)
        o.write(rows[n:], 1 << 19)
        first, second = (0, 1 << 18), (1 << 19, 1 << 18)
        sources = [(0, n, o.key, o.ident, 0, o.key, o.ident, n * ROW_BYTES, first, first),
                   (n, n, o.key, o.ident, 1 << 19, o.key, o.ident, (1 << 19) + n * ROW_BYTES, second, second)]
        cache = direct.Objects(cuda=True)
        direct.plan(sources, cache, ROW_BYTES, (0, 2 * n), (0, 2 * n))
        real, calls = direct.Objects.get, []

        def racing(self, *args):
            entry = real(self, *args)
            calls.append(args)
            if len(calls) == 1:
                os.truncate(o.path, 2 << 20)  # the client grows its object meanwhile
            return entry

        monkeypatch.setattr(direct.Objects, "get", racing)
        plan = direct.plan(sources, cache, ROW_BYTES, (0, 2 * n), (0, 2 * n))
        monkeypatch.setattr(direct.Objects, "get", real)
        assert plan.report == {} and len(calls) == 2, (plan.report, calls)
        dev = torch.full((2 * n, CFG.H), float("nan"), dtype=CFG.dtype, device="cuda")
        _dma_in(dev, torch.zeros(2 * n, CFG.H, dtype=CFG.dtype), plan, ROW_BYTES)
        answer = dev * 2
        _dma_out(answer, torch.empty(2 * n, CFG.H, dtype=CFG.dtype), plan, ROW_BYTES)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu().view(torch.int16), rows.view(torch.int16))
        assert torch.equal(o.read(n * ROW_BYTES, n).view(torch.int16), answer[:n].cpu().view(torch.int16))
        assert torch.equal(o.read((1 << 19) + n * ROW_BYTES, n).view(torch.int16), answer[n:].cpu().view(torch.int16))
        assert direct.plan(sources, cache, ROW_BYTES, (0, 2 * n), (0, 2 * n)).report == {}
        cache.close()
    finally:
        o.remove()


def registrations(monkeypatch) -> list[tuple[int, int]]:
    """The (lo, hi) of every region registration `direct.Objects` makes from now on."""
    real, seen = direct.Objects._register, []

    def counting(self, entry):
        seen.append((entry.lo, entry.hi))
        return real(self, entry)

    monkeypatch.setattr(direct.Objects, "_register", counting)
    return seen


def round_trip(sources, cache: direct.Objects, n: int) -> None:
    """One step's moves of `sources` (n rows) as a CUDA rank makes them: plan, DMA in, the answer (the
    rows doubled) DMA'd out, synchronized."""
    from service.worker.rank import _dma_in, _dma_out

    plan = direct.plan(sources, cache, ROW_BYTES, (0, n), (0, n))
    assert plan.report == {}, plan.report
    dev = torch.empty(n, CFG.H, dtype=CFG.dtype, device="cuda")
    _dma_in(dev, torch.zeros(n, CFG.H, dtype=CFG.dtype), plan, ROW_BYTES)
    _dma_out(dev * 2, torch.empty(n, CFG.H, dtype=CFG.dtype), plan, ROW_BYTES)
    torch.cuda.synchronize()


def test_an_objects_two_regions_are_registered_once_each_over_steps(monkeypatch):
    """In this process, real CUDA: a client's input region and output region in one object (the
    usual layout of tritonclient's utilities), five steps of plan, DMA in and DMA out: each region
    is registered once. (Page-locking write-faults a tmpfs page unless it was faulted in by read
    first, and a write fault moves the object's ctime: without the read pre-fault each region's
    registration made the other look stale, and both were registered again at every step.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    n = 32
    o = ShmObject(4 << 20)
    try:
        rows = torch.randn(n, CFG.H).to(CFG.dtype)
        o.write(rows, 0)
        src, dst = (0, 1 << 20), (2 << 20, 1 << 20)  # separate pages: two entries of one object
        sources = [(0, n, o.key, o.ident, 0, o.key, o.ident, 2 << 20, src, dst)]
        cache = direct.Objects(cuda=True)
        registered = registrations(monkeypatch)
        for _ in range(5):
            round_trip(sources, cache, n)
        assert sorted(registered) == [(0, 1 << 20), (2 << 20, 3 << 20)], registered
        assert torch.equal(o.read(2 << 20, n).view(torch.int16), (rows * 2).view(torch.int16))
        cache.close()
    finally:
        o.remove()


def arena_path(group, arena, x, ids, w):
    """The step with SOURCE's rows in a fresh block of the wire arena (a body's hidden_states after an
    odd-length JSON header) and their answer into another block, as a front end hands them over."""
    from service.api.arena import WireArena

    assert isinstance(arena, WireArena)
    row, rows = SOURCE
    lead = 1237  # the header's bytes before the rows
    body = arena.buffer(lead + rows * ROW_BYTES, lead=lead)
    x_rows = torch.frombuffer(body[lead:], dtype=CFG.dtype).view(rows, CFG.H)
    x_rows.copy_(x[row:row + rows])
    out_rows = arena.rows(rows, CFG.H, CFG.dtype)
    out_rows.fill_(float("nan"))
    src, dst = arena.place(x_rows), arena.place(out_rows)
    return step_with_source(group, x, ids, w, (row, rows, *src[:3], *dst[:3], src[3], dst[3]), lambda: out_rows)


def test_wire_arena_rows_equal_the_slot_paths(group):
    from service.api.arena import WireArena

    arena = WireArena(16 << 20)
    try:
        for seed in range(4):
            x, ids, w = step_inputs(100 + seed)
            want = slot_path(group, x, ids, w)
            got, stats = arena_path(group, arena, x, ids, w)
            assert stats.sources == {}, stats.sources
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), seed
    finally:
        arena.close()


def test_the_wire_arena_is_registered_once_while_the_front_end_writes_it(monkeypatch):
    """In this process, real CUDA: five steps whose rows the front end writes into fresh blocks of its
    arena (as bodies arrive) and whose answers the DMA writes into others: one registration, of the
    whole arena (its pages were faulted in when it was made: no write of the front end's moves its
    ctime), and every answer right."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from service.api.arena import WireArena

    n = 32
    arena = WireArena(8 << 20)
    try:
        cache = direct.Objects(cuda=True)
        registered = registrations(monkeypatch)
        for step in range(5):
            rows = arena.rows(n, CFG.H, CFG.dtype)
            rows.copy_(torch.randn(n, CFG.H).to(CFG.dtype))
            out = arena.rows(n, CFG.H, CFG.dtype)
            (key, ident, at_in, region), (_, _, at_out, _) = arena.place(rows), arena.place(out)
            round_trip([(0, n, key, ident, at_in, key, ident, at_out, region, region)], cache, n)
            assert torch.equal(out.view(torch.int16), (rows * 2).view(torch.int16)), step
        assert registered == [(0, arena.size)], registered
        cache.close()
    finally:
        arena.close()
