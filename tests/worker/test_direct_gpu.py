"""A CUDA rank's direct rows (--shm-direct, service.worker.direct): rows DMA'd from a client's object
through its page-locked mapping and the answer DMA'd into another, with and without copy streams,
for the fused and the serial backend. Answers equal the slot path's bit for bit (the same rows in
the same step, one source at a client's odd byte offset among slot rows); a NaN row is reported as
the source's row and zeroed before the layer reads it (its batch-mates unchanged); an object
truncated below its source's bytes is reported "truncated" and nothing is written; the object
cache maps each object once over many steps, and again when it grew."""

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


def direct_path(group, x, ids, w, obj_in: ShmObject, obj_out: ShmObject):
    """The step with SOURCE's rows in obj_in (at OFFSET) and their answer into obj_out (at OFFSET):
    (the answer's rows, the step's stats)."""
    row, rows = SOURCE
    slot = group.acquire_slot(timeout=60)
    try:
        slot.x[:T].copy_(x)
        slot.x[row:row + rows].fill_(float("nan"))  # never read: the rows come from the object
        slot.ids[:T].copy_(ids)
        slot.w[:T].copy_(w)
        slot.out.fill_(float("nan"))
        obj_in.write(x[row:row + rows], OFFSET)
        obj_out.write(torch.full((rows, CFG.H), float("nan"), dtype=CFG.dtype), OFFSET)
        source = (row, rows, obj_in.key, obj_in.ident, OFFSET, obj_out.key, obj_out.ident, OFFSET)
        stats = group.run(slot, T, [source])
        answer = slot.out[:T].clone()
        assert answer[row:row + rows].isnan().all(), "the source's answer went into the slot"
        answer[row:row + rows] = obj_out.read(OFFSET, rows)
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
        source = (row, rows, obj_in.key, obj_in.ident, OFFSET, obj_out.key, obj_out.ident, OFFSET)
        stats = group.run(slot, T, [source])
        report = stats.sources[0]
        assert report[:2] == (("in", "out")[side], "truncated"), report
        want = slot_path(group, x, ids, w)
        got = slot.out[:T]
    finally:
        group.release(slot)
    keep = torch.ones(T, dtype=torch.bool)
    keep[row:row + rows] = False
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16)), "the batch-mates changed"
