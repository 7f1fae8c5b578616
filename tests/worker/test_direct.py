"""service.worker.direct and the rank's direct-row helpers, on the CPU: the plan of a rank's share of
a step's sources (rows relative to the rank, bytes in the objects, sources that fail), the DMA
helpers' row ranges (slot rows around the sources' rows, bytes of an odd offset), the device check's
flags, the cache's pruning of removed objects."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from service.worker import direct
from service.worker.rank import _check_cuda, _dma_in, _dma_out, _note_flags

H = 6
DTYPE = torch.bfloat16
ROW_BYTES = H * DTYPE.itemsize
_LIBC = ctypes.CDLL(None, use_errno=True)
MADV_POPULATE_WRITE = 23  # linux/mman.h: fault a range in as writes would (what page-locking does)


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


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister without CUDA: what a CUDA rank registered, and when."""

    def __init__(self):
        self.registered: list[int] = []    # sizes, in order
        self.unregistered: list[int] = []  # pointers
        self.syncs = 0
        self.pin_s = 0.0  # how long a registration takes (a 16 MiB region: milliseconds)

    def cudaHostRegister(self, ptr, size, flags):
        # what page-locking does to the mapping (get_user_pages for write): a write fault of every page
        # not yet mapped writable, the data untouched (on tmpfs a write fault moves the object's ctime)
        assert _LIBC.madvise(ctypes.c_void_p(ptr - ptr % mmap.PAGESIZE), ctypes.c_size_t(size + ptr % mmap.PAGESIZE),
                             MADV_POPULATE_WRITE) == 0, ctypes.get_errno()
        time.sleep(self.pin_s)
        self.registered.append(size)
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    """A CUDA rank's cache on the CPU: the mapping is real, registering it and the syncs are stubs,
    a "DMA" (the rank's _dma_in/_dma_out) a CPU copy through the mapping."""
    rt = FakeCudart()

    def sync(*_):
        rt.syncs += 1

    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    return rt


def region(o: Obj) -> tuple[int, int]:
    """A region of the whole object (as registered)."""
    return (0, os.stat(o.path).st_size)


def src(row, rows, o_in, at_in, o_out, at_out, r_in=None, r_out=None):
    """A source (direct.Source) whose regions are the whole objects unless given."""
    return (row, rows, o_in.key, o_in.ident, at_in, o_out.key, o_out.ident, at_out,
            r_in or region(o_in), r_out or region(o_out))


def test_a_ranks_moves_and_the_dma_helpers_rows(objs, cudart):
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
        src(3, 5, a_in, 0, a_out, 0),           # before the rank: not its
        src(10, 6, b_in, 101, b_out, 7),
        src(6, 4, c_in, 64, a_out, 512),
    ]
    cache = direct.Objects(cuda=True)
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


def test_a_failed_source_is_reported_and_its_rows_zeroed(objs, cudart):
    T = 10
    good_in, good_out, short = objs(4096), objs(4096), objs(4096)
    sources = [src(0, 3, good_in, 0, good_out, 0),
               src(3, 4, short, 0, good_out, 4 * ROW_BYTES),
               src(7, 3, good_in, 0, good_out, 0)]
    sources[2] = (*sources[2][:3], (1, 2), *sources[2][4:])  # an identity its key does not name
    os.truncate(short.path, ROW_BYTES)  # truncated after it was registered
    cache = direct.Objects(cuda=True)
    plan = direct.plan(sources, cache, ROW_BYTES, (0, T), (0, T))
    assert plan.report[1][:2] == ("in", "truncated") and plan.report[2][:2] == ("in", "replaced"), plan.report
    assert plan.zero == [(3, 7), (7, 10)] and [m.source for m in plan.reads] == [0]
    x = torch.full((T, H), float("nan"), dtype=DTYPE)
    _dma_in(x, torch.ones(T, H, dtype=DTYPE), plan, ROW_BYTES)
    assert bool(x[3:].eq(0).all()), "a failed source's rows reach the layer"
    assert [m.source for m in plan.writes] == [0]
    cache.close()


# ---- the cache of regions: one lookup per region and plan, the region's bytes only, stale pages ----


def test_one_lookup_per_region_per_plan_and_a_resize_meanwhile_drops_nothing(objs, cudart, monkeypatch):
    """A source whose input and output lie in one region and a second source in it: the plan looks
    the region up once; the client grows its object after that lookup: the step still holds its
    mapping (the DMA reads it), and the next step maps the object's new pages."""
    T = 6
    o = objs(8192)
    rows = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(DTYPE)
    o.write(rows, 0)
    sources = [src(0, 4, o, 0, o, 4096), src(4, 2, o, 4 * ROW_BYTES, o, 4096 + 4 * ROW_BYTES)]
    cache = direct.Objects(cuda=True)
    direct.plan(sources, cache, ROW_BYTES, (0, T), (0, T))  # a first step maps it
    real, calls = direct.Objects.get, []

    def racing(self, *args):
        entry = real(self, *args)
        calls.append(args)
        os.truncate(o.path, 16384)  # the client grows its object meanwhile
        return entry

    monkeypatch.setattr(direct.Objects, "get", racing)
    plan = direct.plan(sources, cache, ROW_BYTES, (0, T), (0, T))
    assert len(calls) == 1, f"{len(calls)} lookups of one region in one plan"
    assert plan.report == {} and len(plan.reads) == 2, plan.report
    x = _dma_in(torch.full((T, H), float("nan"), dtype=DTYPE), torch.zeros(T, H, dtype=DTYPE), plan, ROW_BYTES)
    assert torch.equal(x.view(torch.int16), rows.view(torch.int16))
    assert len(cudart.registered) == 1
    monkeypatch.setattr(direct.Objects, "get", real)
    direct.plan(sources, cache, ROW_BYTES, (0, T), (0, T))  # the next step: the new pages
    assert len(cudart.registered) == 2 and len(cudart.unregistered) == 1 and cudart.syncs >= 1
    cache.close()


def test_whatever_a_lookup_raises_is_its_sources_error(objs, cudart, monkeypatch):
    """An exception nobody foresaw in one region's lookup (here a TypeError) fails its source alone."""
    T = 4
    bad, good_in, good_out = objs(4096), objs(4096), objs(4096)
    real = direct.Objects.get

    def get(self, key, *args):
        if key == bad.key:
            raise TypeError("surprise")
        return real(self, key, *args)

    monkeypatch.setattr(direct.Objects, "get", get)
    sources = [src(0, 2, bad, 0, good_out, 0), src(2, 2, good_in, 0, good_out, 2 * ROW_BYTES)]
    plan = direct.plan(sources, direct.Objects(cuda=True), ROW_BYTES, (0, T), (0, T))
    assert plan.report == {0: ("in", "error", "TypeError: surprise")}, plan.report
    assert [m.source for m in plan.reads] == [1] and plan.zero == [(0, 2)]


def test_only_the_regions_bytes_are_mapped_and_the_byte_bound_holds(objs, cudart):
    """A small region at an odd offset of a 1 GiB (sparse) object: its page-aligned bytes are
    registered, not the object; regions past max_bytes evict the least recently used (never the
    step's own), and one that cannot fit beside the step's own is its source's error."""
    big = objs(1 << 30)
    reg = (3 * 4096 + 100, 50 * ROW_BYTES)  # offset, byte_size
    sources = [src(0, 4, big, reg[0] + 8, big, reg[0] + 8 + 4 * ROW_BYTES, reg, reg)]
    cache = direct.Objects(cuda=True)
    plan = direct.plan(sources, cache, ROW_BYTES, (0, 4), (0, 4))
    assert plan.report == {} and cudart.registered == [100 + 50 * ROW_BYTES], cudart.registered
    assert os.stat(big.path).st_blocks * 512 < 1 << 20, "the rank populated the object"
    cache.close()
    a, b, c = objs(3 * 4096), objs(3 * 4096), objs(3 * 4096)
    small = direct.Objects(cuda=True, max_bytes=2 * 3 * 4096)
    for o in (a, b, c):  # a third region: the least recently used (a's) goes
        assert direct.plan([src(0, 1, o, 0, o, 4096)], small, ROW_BYTES, (0, 1), (0, 1)).report == {}
    assert small.bytes == 2 * 3 * 4096 and len(small) == 2
    assert {k[:2] for k in small._entries} == {b.ident, c.ident}
    both = [src(0, 1, a, 0, a, 4096), src(1, 1, b, 0, b, 4096), src(2, 1, c, 0, c, 4096)]
    plan = direct.plan(both, small, ROW_BYTES, (0, 3), (0, 3))  # three regions of one step: one cannot fit
    assert list(plan.report) == [0] and plan.report[0][1] == "error", plan.report
    assert small.bytes <= small.max_bytes
    small.close()


@pytest.mark.parametrize("change", ["truncate and regrow", "punch a hole"])
def test_a_changed_object_is_registered_again(objs, cudart, change):
    """The object's (st_size, st_ctime_ns) moved since its region was registered (a truncate and a
    regrow to the same size, a hole punched): the region is unregistered (after a sync) and
    registered again at its next use; a step that finds it unchanged registers nothing."""
    o = objs(16384)
    sources = [src(0, 2, o, 0, o, 8192)]
    cache = direct.Objects(cuda=True)
    for _ in range(3):
        assert direct.plan(sources, cache, ROW_BYTES, (0, 2), (0, 2)).report == {}
    assert len(cudart.registered) == 1
    if change == "truncate and regrow":
        os.truncate(o.path, 0)
        os.truncate(o.path, 16384)
    else:
        punch_hole(o.path, 0, 4096)
    syncs = cudart.syncs
    assert direct.plan(sources, cache, ROW_BYTES, (0, 2), (0, 2)).report == {}
    assert len(cudart.registered) == 2 and len(cudart.unregistered) == 1 and cudart.syncs > syncs
    os.truncate(o.path, 4096)  # now too short for the region: its error, and the region is let go
    plan = direct.plan(sources, cache, ROW_BYTES, (0, 2), (0, 2))
    assert plan.report[0][:2] == ("in", "truncated") and len(cache) == 0, plan.report
    cache.close()


def test_writes_through_a_clients_mapping_register_nothing_again(objs, cudart):
    """A client that writes its rows through its own mapping (tritonclient's utilities, the bench)
    does not move the object's ctime once its pages are mapped: the region stays registered."""
    o = objs(16384)
    fd = os.open(o.path, os.O_RDWR)
    client = mmap.mmap(fd, 16384)
    os.close(fd)
    client[:] = b"\1" * 16384  # its first writes (page faults of its mapping)
    cache = direct.Objects(cuda=True)
    sources = [src(0, 2, o, 0, o, 8192)]
    assert direct.plan(sources, cache, ROW_BYTES, (0, 2), (0, 2)).report == {}
    for i in range(5):
        client[: 2 * ROW_BYTES] = bytes([i]) * (2 * ROW_BYTES)  # the next request's rows
        assert direct.plan(sources, cache, ROW_BYTES, (0, 2), (0, 2)).report == {}
    assert len(cudart.registered) == 1, cudart.registered
    client.close()
    cache.close()


@pytest.mark.parametrize("kernel", ["5.14+", "older"])
@pytest.mark.parametrize("pin_s", [0.0, 0.005])
def test_other_registrations_of_an_object_are_not_made_stale_by_page_locking(objs, cudart, pin_s, kernel,
                                                                            monkeypatch):
    """Page-locking write-faults the pages it maps, and on tmpfs that moves the object's ctime: every
    other registration of the object (its other regions, another rank's) then looked stale and was
    registered again at each step, each moving ctime anew (reviewer RZ2). Input and output regions
    of one object, two requests' regions of one object used in turn, and two ranks of one region:
    each region registered once over the steps. "older": a kernel without MADV_POPULATE_READ
    (EINVAL), where the pages are read-faulted through process_vm_readv (before, not at all: every
    step registered every region again on RHEL 8 or Ubuntu 20.04 kernels)."""
    if kernel == "older":
        monkeypatch.setattr(direct, "MADV_POPULATE_READ", -1)  # an advice no kernel knows: EINVAL
    cudart.pin_s = pin_s  # a registration of milliseconds lets the clock move on (a 16 MiB region)
    one = objs(4 * 4096)
    first = [src(0, 2, one, 0, one, 4096, (0, 4096), (4096, 4096))]
    second = [src(0, 2, one, 8192, one, 12288, (8192, 4096), (12288, 4096))]
    cache = direct.Objects(cuda=True)
    for step in range(8):  # steps a few ms apart, as served
        time.sleep(0.003)
        assert direct.plan(first if step % 2 == 0 else second, cache, ROW_BYTES, (0, 2), (0, 2)).report == {}
    cache.close()
    assert len(cudart.registered) == 4, f"{len(cudart.registered)} registrations of 4 regions over 8 steps"
    i, out = objs(4096), objs(4096)
    sources = [src(0, 4, i, 0, out, 0)]
    ranks = [direct.Objects(cuda=True), direct.Objects(cuda=True)]  # R=2: each rank its own mappings
    for _ in range(6):
        for r, rank_cache in enumerate(ranks):
            time.sleep(0.002)
            assert direct.plan(sources, rank_cache, ROW_BYTES, (2 * r, 2), (2 * r, 2)).report == {}
    for rank_cache in ranks:
        rank_cache.close()
    assert len(cudart.registered) == 4 + 4, f"{len(cudart.registered) - 4} registrations of 2 regions x 2 ranks"


def test_faulting_in_past_the_objects_end_is_no_sigbus(tmp_path):
    """A region whose object a client truncated meanwhile: both ways of faulting its pages in stop at
    the end (EFAULT) where touching them would raise SIGBUS, and the pages before it are faulted in.
    In a child, so that a SIGBUS fails the test instead of killing the run."""
    code = f"""if True:
        import ctypes, mmap, os
        from service.worker import direct
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open({str(tmp_path / "obj")!r}, os.O_CREAT | os.O_RDWR, 0o600)
        fallback = direct._LIBC.process_vm_readv
        for advice in (direct.MADV_POPULATE_READ, -1):  # 5.14+, and the older kernels' path (EINVAL)
            direct.MADV_POPULATE_READ = advice
            # each way alone: on 5.14+ the madvise's EFAULT at the end must not fall back
            direct._LIBC.process_vm_readv = fallback if advice == -1 else None
            os.ftruncate(fd, 0)  # no page of the object exists
            os.ftruncate(fd, 4 * mmap.PAGESIZE)
            mm = mmap.mmap(fd, 4 * mmap.PAGESIZE)
            os.ftruncate(fd, mmap.PAGESIZE + 1)  # two pages left of the four mapped
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            direct.fault_in_by_read(ptr, 4 * mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * 2)()  # which of the two pages left are in memory now
            assert libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(2 * mmap.PAGESIZE), vec) == 0
            print(sum(v & 1 for v in vec))
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7: SIGBUS
    assert out.stdout.split() == ["2", "2", "ok"], out.stdout  # both pages faulted in, each way


def punch_hole(path: str, at: int, n: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, at, n) != 0:
            raise OSError(ctypes.get_errno(), "fallocate")
    finally:
        os.close(fd)


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def test_the_cache_lets_go_of_removed_and_idle_regions_every_prune_s(objs, monkeypatch):
    """Under load (prune() before each step, not only when pinged): every PRUNE_S the regions of
    objects no name leads to, and those no step used for IDLE_S, are dropped; in between, nothing."""
    clock = [1000.0]
    monkeypatch.setattr(direct.time, "monotonic", lambda: clock[0])
    kept, removed, idle = objs(4096), objs(4096), objs(4096)
    cache = direct.Objects(cuda=False)
    for o in (kept, removed, idle):
        cache.get(o.key, o.ident, region(o), keep=set())
    os.unlink(removed.path)
    clock[0] += direct.PRUNE_S / 2
    cache.prune()
    assert len(cache) == 3, "pruned before PRUNE_S"
    clock[0] += direct.PRUNE_S
    cache.prune()
    assert {k[:2] for k in cache._entries} == {kept.ident, idle.ident}
    clock[0] += direct.IDLE_S - direct.PRUNE_S
    cache.get(kept.key, kept.ident, region(kept), keep=set())
    clock[0] += 2 * direct.PRUNE_S
    cache.prune()
    assert {k[:2] for k in cache._entries} == {kept.ident}
    cache.close()
