"""service.worker.direct and the rank's direct-row helpers, on the CPU: the plan of a rank's share of
a step's sources (rows relative to the rank, bytes in the objects, sources that fail), the DMA
helpers' row ranges (slot rows around the sources' rows, bytes of an odd offset), the device check's
flags, the cache's pruning of removed objects."""

from __future__ import annotations

import mmap
import os
import uuid

import pytest
import torch

from service.worker import direct
from service.worker.rank import _check_cuda, _dma_in, _dma_out, _note_flags

H = 6
DTYPE = torch.bfloat16
ROW_BYTES = H * DTYPE.itemsize


class Obj:
    def __init__(self, size: int):
        self.key = f"/moe11z-test-{uuid.uuid4().hex[:12]}"
        self.path = f"{direct.SHM_ROOT}/{self.key[1:]}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        self.ident = direct.identity(fd)
        os.close(fd)

    def write(self, t: torch.Tensor, at: int) -> None:
        fd = os.open(self.path, os.O_RDWR)
        os.pwrite(fd, direct.memory(t.contiguous()), at)
        os.close(fd)

    def read(self, at: int, rows: int) -> torch.Tensor:
        t = torch.empty(rows, H, dtype=DTYPE)
        fd = os.open(self.path, os.O_RDONLY)
        os.preadv(fd, [direct.memory(t)], at)
        os.close(fd)
        return t


@pytest.fixture
def objs():
    made: list[Obj] = []

    def make(size: int) -> Obj:
        made.append(Obj(size))
        return made[-1]

    yield make
    for o in made:
        if os.path.exists(o.path):
            os.unlink(o.path)


class MappedObjects(direct.Objects):
    """The CUDA cache's entries (a mapping viewed as bytes) without CUDA: the DMA helpers' host side."""

    def __init__(self):
        super().__init__(cuda=False)

    def get(self, key, ident, need, keep):
        entry = super().get(key, ident, need, keep)
        if entry.base is None:
            entry.mm = mmap.mmap(entry.fd, os.fstat(entry.fd).st_size)
            entry.base = torch.frombuffer(entry.mm, dtype=torch.uint8)
        return entry

    def close(self) -> None:
        for entry in self._entries.values():
            entry.base = None  # (never registered with CUDA)
        super().close()


def test_a_ranks_moves_and_the_dma_helpers_rows(objs):
    """Two sources over a rank's rows [8, 20) of a step, one at an odd byte offset, one that starts
    before the rank: the rows come from the objects, the rest from the slot; the answer's source
    rows go into the output objects, the rest into the slot; a NaN row is flagged, zeroed, noted as
    the source's row."""
    gen = torch.Generator().manual_seed(1)
    T, start, n = 24, 8, 12
    slot_x = torch.randn(T, H, generator=gen).to(DTYPE)
    a_in, a_out, b_in, b_out = objs(4096), objs(4096), objs(4096), objs(4096)
    rows_a = torch.randn(5, H, generator=gen).to(DTYPE)   # slot rows 3..8: none of the rank's
    rows_b = torch.randn(6, H, generator=gen).to(DTYPE)   # slot rows 10..16
    rows_c = torch.randn(4, H, generator=gen).to(DTYPE)   # slot rows 6..10: starts before the rank
    rows_b[2, 1] = float("nan")
    a_in.write(rows_a, 0)
    b_in.write(rows_b, 101)  # an odd byte offset
    c_in = objs(4096)
    c_in.write(rows_c, 64)
    sources = [
        (3, 5, a_in.key, a_in.ident, 0, a_out.key, a_out.ident, 0),           # before the rank: not its
        (10, 6, b_in.key, b_in.ident, 101, b_out.key, b_out.ident, 7),
        (6, 4, c_in.key, c_in.ident, 64, a_out.key, a_out.ident, 512),
    ]
    cache = MappedObjects()
    plan = direct.plan(sources, cache, ROW_BYTES, (start, n), (start, n))
    assert {m.source for m in plan.reads} == {1, 2} and not plan.zero and not plan.report
    assert plan.span == (0, 8)
    x = torch.full((n, H), float("nan"), dtype=DTYPE)
    _dma_in(x, slot_x[start:start + n], plan, ROW_BYTES)
    want = slot_x[start:start + n].clone()
    want[0:2] = rows_c[2:4]   # slot rows 8, 9
    want[2:8] = rows_b        # slot rows 10..16
    assert torch.equal(x.view(torch.int16), want.view(torch.int16))
    flags = (torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool))
    _check_cuda(x, plan, flags)
    assert flags[1].nonzero().flatten().tolist() == [4] and bool(x[4].eq(0).all())
    _note_flags(plan, flags[1], sources, plan.rows_in)
    assert plan.report == {1: 2}  # the source's own row
    answer = torch.randn(n, H, generator=gen).to(DTYPE)
    slot_out = torch.full((n, H), float("nan"), dtype=DTYPE)
    _dma_out(answer, slot_out, plan, ROW_BYTES)
    assert torch.equal(b_out.read(7, 6).view(torch.int16), answer[2:8].view(torch.int16))
    assert torch.equal(a_out.read(512 + 2 * ROW_BYTES, 2).view(torch.int16), answer[0:2].view(torch.int16))
    assert slot_out[:8].isnan().all() and torch.equal(slot_out[8:].view(torch.int16), answer[8:].view(torch.int16))
    cache.close()


def test_a_failed_source_is_reported_and_its_rows_zeroed(objs):
    T = 10
    good_in, good_out, short = objs(4096), objs(4096), objs(ROW_BYTES)
    sources = [(0, 3, good_in.key, good_in.ident, 0, good_out.key, good_out.ident, 0),
               (3, 4, short.key, short.ident, 0, good_out.key, good_out.ident, 4 * ROW_BYTES),
               (7, 3, good_in.key, (1, 2), 0, good_out.key, good_out.ident, 0)]
    cache = MappedObjects()
    plan = direct.plan(sources, cache, ROW_BYTES, (0, T), (0, T))
    assert plan.report[1][:2] == ("in", "truncated") and plan.report[2][:2] == ("in", "replaced"), plan.report
    assert plan.zero == [(3, 7), (7, 10)] and [m.source for m in plan.reads] == [0]
    x = torch.full((T, H), float("nan"), dtype=DTYPE)
    _dma_in(x, torch.ones(T, H, dtype=DTYPE), plan, ROW_BYTES)
    assert bool(x[3:].eq(0).all()), "a failed source's rows reach the layer"
    assert [m.source for m in plan.writes] == [0]
    cache.close()


def test_the_cache_drops_removed_objects_when_pruned(objs):
    kept, removed = objs(4096), objs(4096)
    cache = direct.Objects(cuda=False)
    for o in (kept, removed):
        cache.get(o.key, o.ident, 16, keep=set())
    os.unlink(removed.path)
    cache.prune()
    assert len(cache) == 1 and kept.ident in cache._entries
    cache.close()
