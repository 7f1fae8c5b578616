"""--shm-direct: the ranks read a request's rows from its input region and write its answer into its
output region themselves (service.worker.direct), the front end copies neither.

Against a real CPU rank group (R=2: every rank reads every source, as the layer of one host reads
every row) behind the batcher, and a real server: answers equal the copy path's bit for bit (T=1, odd
T, a request split over two steps, direct pieces sharing steps with wire and fp32-region ones, which
keep the copies), and the front end never touched the direct requests' regions; a NaN row gets the
copy path's 400 naming its row while its batch-mates are answered; an object truncated after
registration, and a key that now names another object, get their errors; a deadline that passes
while a direct step runs is answered only after the step returned, and nothing lands in the region
after it; a non-owner front end's direct steps (--frontends 2).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from pydantic import ValidationError

from service.api import batcher as batcher_module
from service.api import regions
from service.api.batcher import Batcher
from service.api.regions import RegionRows
from service.config import LayerConfig, Settings
from service.errors import DeadlineExceeded, InvalidInput
from service.fleet import direct_regions
from service.metrics import Metrics
from service.worker import direct
from service.worker.group import WorkerGroup
from tests.api.common import inputs
from tests.api.test_frontends import holders
from tests.api.test_shared_memory import (
    CLIENTS,
    NAN,
    PROTOCOLS,
    client,
    descriptors,
    infer,
    infer_in_regions,
    nbytes,
    register_inputs,
)
from tests.api.test_shared_memory import objects as objects  # noqa: F401, PLC0414  (the fixture)
from tests.helpers import routing
from tests.serverproc import ServerProcess

CFG = LayerConfig(E=7, H=40, I=32, K=3, R=2, C=13, dtype=torch.bfloat16)  # budget R*C = 26 tokens
BUDGET = CFG.tokens_per_step
SLOW_S = 1.0  # the slow group's wait before each step (the deadline case)


@pytest.fixture(scope="module")
def group():
    with WorkerGroup(CFG, seed=3, slots=2, direct_regions=True) as g:
        yield g


def rows_of(T: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, CFG.H, generator=gen).to(dtype)
    ids, w = routing(T, CFG.E, CFG.K, "balanced", gen)
    return x, ids.to(torch.int32), w


class Client:
    """A client's regions for the batcher tests: an input object and an output object per request,
    registered in one table as the front end sees them."""

    def __init__(self, make):
        self.make = make
        self.table = regions.RegionTable.create()
        self.regions = regions.Regions(self.table)
        self.n = 0

    def put(self, x: torch.Tensor) -> tuple[RegionRows, RegionRows, object, object]:
        """x in a fresh input region, a fresh output region poisoned with NaN: (x's rows, out's rows, objects)."""
        self.n += 1
        obj_in, obj_out = self.make(nbytes(x)), self.make(nbytes(x) + 64)
        obj_in.write(x)
        obj_out.write(torch.full((obj_out.size // 4,), NAN))
        self.regions.register(f"in{self.n}", obj_in.key, 0, nbytes(x))
        self.regions.register(f"out{self.n}", obj_out.key, 0, obj_out.size)
        rows_in = self.regions.rows(f"in{self.n}", 0, nbytes(x), x.dtype, list(x.shape), "input 'hidden_states'")
        rows_out = self.regions.rows(f"out{self.n}", 0, nbytes(x), x.dtype, list(x.shape), "output 'output'",
                                     output=True)
        return rows_in, rows_out, obj_in, obj_out


async def batcher(group, **kw) -> Batcher:
    kw = {"budget": BUDGET, "delay_s": 0.05, "queue_tokens": 10_000, "slots": 2, "metrics": Metrics(), **kw}
    b = Batcher(**kw)
    b.start()
    b.attach(group)
    return b


@pytest.fixture
def front_end_copies(monkeypatch):
    """The dtypes of the regions the front end read rows from or wrote an answer into."""
    seen: list[tuple[str, torch.dtype]] = []
    read, write = RegionRows.read_into, RegionRows.write_from
    monkeypatch.setattr(RegionRows, "read_into", lambda self, dst: (seen.append(("read", self.dtype)),
                                                                     read(self, dst))[1])
    monkeypatch.setattr(RegionRows, "write_from", lambda self, src: (seen.append(("write", self.dtype)),
                                                                      write(self, src))[1])
    return seen


def serve(group, jobs, *, on: bool, timeout_s: float = 30.0):
    """Submit every job at once (so they share steps) with group.direct_regions = on: each one's
    answer (its output region's rows, or the wire answer) or its error."""
    group.direct_regions = on

    async def main():
        b = await batcher(group)
        try:
            return await asyncio.gather(*(b.submit(x, ids, w, timeout_s, out=out) for x, ids, w, out in jobs),
                                        return_exceptions=True)
        finally:
            await b.close(timeout_s=10)

    try:
        got = asyncio.run(main())
    finally:
        group.direct_regions = True
    return [g if isinstance(g, BaseException) else g.read() if isinstance(g, RegionRows) else g.clone() for g in got]


def mixed_jobs(client_, seeds_T, nan_at=None):
    """Jobs: bf16 rows in regions (direct), a wire request, an fp32 region request (copied). nan_at:
    (job index, row) to poison."""
    jobs, objs = [], []
    for i, (seed, T) in enumerate(seeds_T):
        x, ids, w = rows_of(T, seed)
        if nan_at is not None and nan_at[0] == i:
            x[nan_at[1], 3] = NAN
        rows_in, rows_out, oi, oo = client_.put(x)
        jobs.append((rows_in, ids, w, rows_out))
        objs.append((oi, oo))
    x, ids, w = rows_of(5, 900)
    jobs.append((x, ids, w, None))  # the wire's
    x, ids, w = rows_of(3, 901, torch.float32)
    rows_in, rows_out, oi, oo = client_.put(x)
    jobs.append((rows_in, ids, w, rows_out))  # an fp32 region: converted, so copied
    return jobs, objs


SIZES = ((11, 1), (12, 7), (13, BUDGET + 19), (14, 2))  # (seed, T): T=1, odd, two steps


def test_answers_equal_the_copy_paths_and_the_front_end_copies_none(group, objects, front_end_copies):
    """Direct pieces among wire and fp32-region ones in the same steps: every answer equals the copy
    path's bit for bit, the bytes past each output are untouched, and the front end read and wrote
    only the fp32 regions."""
    c = Client(objects)
    jobs, objs = mixed_jobs(c, SIZES)
    copied = serve(group, jobs, on=False)
    assert ("read", torch.bfloat16) in front_end_copies  # (the copy path: it reads them itself)
    front_end_copies.clear()
    for _, oo in objs:
        oo.write(torch.full((oo.size // 4,), NAN))
    got = serve(group, jobs, on=True)
    assert set(front_end_copies) == {("read", torch.float32), ("write", torch.float32)}, front_end_copies
    for i, (a, b) in enumerate(zip(got, copied, strict=True)):
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (i, a, b)
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b), i
    for (_, oo), (_, T) in zip(objs, SIZES, strict=True):
        assert oo.read(torch.float32, (16,), offset=T * CFG.H * 2).isnan().all(), "bytes past the answer written"
    c.table.close()


@pytest.mark.parametrize("where", ["first step", "second step"])
def test_a_nan_row_gets_its_400_and_its_batch_mates_are_answered(group, objects, where, front_end_copies):
    row = 4 if where == "first step" else BUDGET + 3
    c = Client(objects)
    jobs, _ = mixed_jobs(c, SIZES, nan_at=(2, row))
    copied = serve(group, jobs, on=False)
    front_end_copies.clear()
    got = serve(group, jobs, on=True)
    assert torch.bfloat16 not in {d for _, d in front_end_copies}, "the ranks did not read the direct rows"
    assert isinstance(got[2], InvalidInput) and isinstance(copied[2], InvalidInput)
    assert str(got[2]) == str(copied[2]) == f"hidden_states contains NaN or infinity (row {row})"
    for i, (a, b) in enumerate(zip(got, copied, strict=True)):
        if i != 2:
            assert torch.equal(a.float(), b.float()), i
    c.table.close()


@pytest.mark.parametrize("side", ["input", "output"])
def test_an_object_truncated_after_registration_gets_its_error(group, objects, side, front_end_copies):
    """The copy path's 400 (naming the object's size and the bytes the region needs); the others answered."""
    c = Client(objects)
    jobs, objs = mixed_jobs(c, SIZES)
    obj = objs[1][0 if side == "input" else 1]
    os.truncate(f"{regions.SHM_ROOT}/{obj.key[1:]}", 8)
    copied = serve(group, jobs, on=False)
    front_end_copies.clear()
    got = serve(group, jobs, on=True)
    assert torch.bfloat16 not in {d for _, d in front_end_copies}, "the ranks did not read the direct rows"
    assert isinstance(got[1], InvalidInput) and isinstance(copied[1], InvalidInput), (got[1], copied[1])
    assert str(got[1]) == str(copied[1]) and "truncated after it was registered" in str(got[1])
    for i, (a, b) in enumerate(zip(got, copied, strict=True)):
        if i != 1:
            assert torch.equal(a.float(), b.float()), i
    c.table.close()


def test_a_key_that_now_names_another_object_is_refused(group, objects):
    """The key is unlinked and made again with other rows: the front end still holds the registered
    object (the copy path reads it), a rank opens the key and finds another object: refused."""
    c = Client(objects)
    x, ids, w = rows_of(6, 31)
    rows_in, rows_out, obj_in, _ = c.put(x)
    path = f"{regions.SHM_ROOT}/{obj_in.key[1:]}"
    os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, regions._memory(torch.zeros_like(x)), 0)
    finally:
        os.close(fd)
    (copied,) = serve(group, [(rows_in, ids, w, rows_out)], on=False)
    (got,) = serve(group, [(rows_in, ids, w, rows_out)], on=True)
    assert not isinstance(copied, BaseException), copied
    assert isinstance(got, InvalidInput) and "is no longer the object that was registered" in str(got), got
    c.table.close()


def test_a_region_past_direct_max_bytes_is_copied(group, objects, front_end_copies, monkeypatch):
    """A region larger than DIRECT_MAX_BYTES is never mapped by a rank: the front end copies its rows
    (the same answer), the others stay direct."""
    c = Client(objects)
    x_big, ids_big, w_big = rows_of(9, 41)
    x, ids, w = rows_of(5, 42)
    big_in, big_out, _, _ = c.put(x_big)
    small_in, small_out, _, _ = c.put(x)
    jobs = [(big_in, ids_big, w_big, big_out), (small_in, ids, w, small_out)]
    copied = serve(group, jobs, on=False)
    monkeypatch.setattr(batcher_module, "DIRECT_MAX_BYTES", nbytes(x_big) - 1)
    front_end_copies.clear()
    got = serve(group, jobs, on=True)
    assert sorted(front_end_copies) == [("read", torch.bfloat16), ("write", torch.bfloat16)], front_end_copies
    for a, b in zip(got, copied, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    c.table.close()


def test_a_source_naming_a_slot_of_the_ranks_is_refused(group, objects):
    """A source whose identity is one of the server's own slots (a name of the client's that led to
    it, a hard link made while the slot had its name): the ranks refuse it by that identity before
    they open any name (not "replaced": the key's object is not even looked at)."""
    st = os.fstat(group._slots[0].owner_fd)
    other = objects(4096)
    slot = group.acquire_slot(timeout=60)
    try:
        slot.ids[:2].zero_()
        slot.w[:2].fill_(1 / CFG.K)
        ident = (st.st_dev, st.st_ino)
        stats = group.run(slot, 2, [(0, 2, other.key, ident, 0, other.key, ident, 0, (0, 4096), (0, 4096))])
    finally:
        group.release(slot)
    assert stats.sources[0][:2] == ("in", "error") and "own shared memory" in stats.sources[0][2], stats.sources


class RawObject:
    """A client's object made with plain file calls (the client may remove it itself)."""

    def __init__(self, size: int):
        self.key = f"/moe11z-test-{os.urandom(6).hex()}"
        self.path, self.size = f"{regions.SHM_ROOT}/{self.key[1:]}", size
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)

    def write(self, t: torch.Tensor, offset: int = 0) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, regions._memory(t.contiguous()), offset)
        finally:
            os.close(fd)


def test_removed_objects_are_let_go_under_load(group):
    """Steps keep coming (no ping between them): PRUNE_S after the client removed its objects, the
    ranks hold them no more."""
    made: list[RawObject] = []
    c = Client(lambda size: made.append(RawObject(size)) or made[-1])
    x, ids, w = rows_of(4, 43)
    first = c.put(x)
    (got,) = serve(group, [(first[0], ids, w, first[1])], on=True)
    paths = {f"{regions.SHM_ROOT}/{o.key[1:]}" for o in first[2:]}
    assert set(p for ps in descriptors(group.pids, paths).values() for p in ps) == paths
    for path in paths:
        os.unlink(path)  # the client removed its objects (their regions stay registered)
    time.sleep(direct.PRUNE_S + 0.2)
    second = c.put(x)
    (again,) = serve(group, [(second[0], ids, w, second[1])], on=True)
    assert torch.equal(got.view(torch.int16), again.view(torch.int16))
    held = {p for ps in descriptors(group.pids, paths).values() for p in ps}
    assert not held, f"the ranks still hold {held}"
    c.table.close()
    for o in made[2:]:
        os.unlink(o.path)


class SlowGroup:
    """The group, each step run SLOW_S late (its direct rows are written at the end of the real run)."""

    def __init__(self, group):
        self.group, self.direct_regions = group, True
        self.returned: list[float] = []

    def acquire_slot(self, timeout=None):
        return self.group.acquire_slot(timeout)

    def release(self, slot) -> None:
        self.group.release(slot)

    def run(self, slot, T, sources=()):
        time.sleep(SLOW_S)
        try:
            return self.group.run(slot, T, sources)
        finally:
            self.returned.append(time.monotonic())


def test_a_deadline_in_a_direct_step_is_answered_after_the_step_returned(group, objects, front_end_copies):
    """The deadline passes while the request's direct step runs: its error comes only once the step
    has returned (the ranks have written the region), and a write into the region right after the
    error stays."""
    c = Client(objects)
    x, ids, w = rows_of(9, 41)
    rows_in, rows_out, _, obj_out = c.put(x)
    slow = SlowGroup(group)

    async def main():
        b = await batcher(slow, delay_s=0.0)
        try:
            with pytest.raises(DeadlineExceeded):
                await b.submit(rows_in, ids, w, SLOW_S / 4, out=rows_out)
            failed = time.monotonic()
            reuse = torch.randn(obj_out.size // 4)  # the client's next use of its region, at once
            obj_out.write(reuse)
            await b.close(timeout_s=10 * SLOW_S)
            return failed, reuse
        finally:
            await b.close(timeout_s=10 * SLOW_S)

    failed, reuse = asyncio.run(main())
    assert not front_end_copies, "the ranks did not read and write the rows"
    assert slow.returned and slow.returned[0] <= failed, "the error came before the step returned"
    assert torch.equal(obj_out.read(torch.float32, reuse.shape), reuse), "the region was written after the error"
    c.table.close()


def test_a_cancel_in_a_direct_step_returns_after_the_step(group, objects):
    """A cancel (a disconnect, a gRPC cancel) while the request's direct step runs: the cancelled
    submit returns only once the step returned, and nothing lands in the region after it (the
    client reuses its region at once). (After the reviewer's reproduction.)"""
    c = Client(objects)
    x, ids, w = rows_of(9, 44)
    rows_in, rows_out, _, obj_out = c.put(x)
    slow = SlowGroup(group)

    async def main():
        b = await batcher(slow, delay_s=0.0)
        try:
            task = asyncio.create_task(b.submit(rows_in, ids, w, 30.0, out=rows_out))
            await asyncio.sleep(SLOW_S / 4)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled = time.monotonic()
            reuse = torch.randn(obj_out.size // 4)
            obj_out.write(reuse)
            return cancelled, reuse
        finally:
            await b.close(timeout_s=10 * SLOW_S)

    cancelled, reuse = asyncio.run(main())
    assert slow.returned and slow.returned[0] <= cancelled, "the cancel came back before the step returned"
    assert torch.equal(obj_out.read(torch.float32, reuse.shape), reuse), "the region was written after the cancel"
    c.table.close()


# ---- the rank's cache of objects -----------------------------------------------------------------


def test_the_objects_cache_is_bounded_and_keeps_the_steps_own(objects):
    """At most max_objects regions kept, least recently used evicted but never one of the step's; a
    region past the object's end is "truncated", an identity the key does not name "replaced"."""
    made = [objects(4096) for _ in range(4)]
    idents = []
    for o in made:
        fd = os.open(f"{regions.SHM_ROOT}/{o.key[1:]}", os.O_RDONLY)
        idents.append(direct.identity(fd))
        os.close(fd)
    cache = direct.Objects(cuda=False, max_objects=2)
    first = direct.entry_key(idents[0], (0, 4096))
    for o, ident in zip(made[:3], idents, strict=False):
        cache.get(o.key, ident, (0, 4096), keep={first})
    assert len(cache) == 2 and first in cache._entries and direct.entry_key(idents[1], (0, 4096)) not in cache._entries
    with pytest.raises(direct.SourceError) as info:
        cache.get(made[3].key, idents[3], (1, 4096), keep=set())
    assert info.value.code == "truncated"
    with pytest.raises(direct.SourceError) as info:
        cache.get(made[3].key, (idents[3][0], idents[3][1] + 1), (0, 16), keep=set())
    assert info.value.code == "replaced"
    cache.close()
    assert len(cache) == 0


def test_reports_merge_errors_first_then_the_first_row():
    assert direct.merge([{0: 5, 1: 2}, {0: 3, 1: ("in", "truncated", "t")}, {2: 7}]) == {
        0: 3, 1: ("in", "truncated", "t"), 2: 7}


# ---- a real server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def direct_server(tmp_path_factory):
    with ServerProcess.serving(tmp_path_factory.mktemp("shmd") / "server.log", "--shared-memory", "system",
                               "--shm-direct", "true") as proc:
        yield proc


def ranks_of(server) -> set[int]:
    """The owner's child processes that are not front ends (the ranks, the spawn machinery)."""
    kids = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            if ppid == server.pid:
                kids.add(int(pid))
    return kids - set(server.frontend_pids())


def test_served_answers_equal_the_wire_and_the_ranks_hold_the_objects(direct_server, objects):
    """T=1, odd T, T past one step (512), fp32 (the preset's dtype: direct) over HTTP and gRPC: the
    answer in the output region equals the wire's bit for bit; the rank processes hold the objects."""
    server = direct_server
    for T in (1, 37, 700):
        x, ids, w = inputs(T, seed=T + 70)
        wire, _ = infer(client(server, "http"), "http", x, ids, w)
        for protocol in PROTOCOLS:
            c = client(server, protocol)
            *_, obj_in, obj_out = infer_in_regions(c, protocol, objects, x, ids, w, f"{protocol}-{T}")
            assert torch.equal(obj_out.read(torch.float32, x.shape), wire), (protocol, T)
            assert obj_out.read(torch.float32, (16,), offset=nbytes(x)).isnan().all()
            paths = {f"/dev/shm/{o.key[1:]}" for o in (obj_in, obj_out)}
            held = {p for ps in descriptors(ranks_of(server), paths).values() for p in ps}
            assert held == paths, f"the ranks hold {held} of {paths}"


def test_a_served_nan_row_names_its_row(direct_server, objects):
    server = direct_server
    x, ids, w = inputs(21, seed=90)
    x[13, 7] = NAN
    c = client(server, "http")
    obj_in, obj_out = objects(nbytes(x) + nbytes(ids.to(torch.int32)) + nbytes(w)), objects(nbytes(x))
    spec = register_inputs(c, obj_in, x, ids, w, "nan-in")
    c.register_system_shared_memory("nan-out", obj_out.key, obj_out.size)
    with pytest.raises(Exception) as info:
        infer(c, "http", x, ids, w, inputs_in=spec, output_in=("nan-out", obj_out.size, 0))
    assert "hidden_states contains NaN or infinity (row 13)" in str(info.value)
    assert str(info.value.status()) == "400"


@pytest.fixture(scope="module")
def two_direct_frontends(tmp_path_factory):
    with ServerProcess.serving(tmp_path_factory.mktemp("shmd2") / "server.log", "--shared-memory", "system",
                               "--shm-direct", "true", "--frontends", "2") as proc:
        yield proc


def test_a_non_owner_front_ends_direct_steps(two_direct_frontends, objects):
    """gRPC connections spread over both front ends (each keeps its connection): every one's direct
    request is answered in its region, equal to the wire's, and the ranks read and wrote its objects."""
    server = two_direct_frontends
    x, ids, w = inputs(17, seed=95)
    wire, _ = infer(client(server, "grpc"), "grpc", x, ids, w)
    clients = [client(server, "grpc") for _ in range(CLIENTS)]
    try:
        deadline = time.monotonic() + 60
        while True:
            for c in clients:
                assert c.is_server_ready()
            processes = {server.pid, *server.frontend_pids()}
            if set(holders(server.grpc_port)) == processes:
                break
            assert time.monotonic() < deadline, "the connections do not reach both front ends"
            time.sleep(0.5)
        for i, c in enumerate(clients):
            obj_in, obj_out = objects(nbytes(x) + nbytes(ids.to(torch.int32)) + nbytes(w)), objects(nbytes(x))
            spec = register_inputs(c, obj_in, x, ids, w, f"in{i}")
            c.register_system_shared_memory(f"out{i}", obj_out.key, nbytes(x))
            obj_out.write(torch.full(x.shape, NAN))
            infer(c, "grpc", x, ids, w, inputs_in=spec, output_in=(f"out{i}", nbytes(x), 0))
            assert torch.equal(obj_out.read(torch.float32, x.shape), wire), i
            paths = {f"/dev/shm/{o.key[1:]}" for o in (obj_in, obj_out)}
            held = {p for ps in descriptors(ranks_of(server), paths).values() for p in ps}
            assert held == paths, f"request {i}: the ranks read and wrote {held} of {paths}"
            c.unregister_system_shared_memory()
    finally:
        for c in clients:
            c.close()


def test_shm_direct_needs_shared_memory():
    """The setting without the extension would be a flag that does nothing: refused, naming what it needs."""
    with pytest.raises(ValidationError, match="needs shared_memory: system"):
        Settings(shm_direct=True)
    assert Settings(shm_direct=True, shared_memory="system").shm_direct
    assert Settings(shm_direct=False).shm_direct is False  # (false needs nothing)


@pytest.mark.parametrize(("value", "device", "on"), [
    (None, "cuda", True), (None, "cpu", False),     # unset: on where the ranks are CUDA
    (True, "cuda", True), (True, "cpu", True),      # forced
    (False, "cuda", False), (False, "cpu", False),
])
def test_shm_direct_unset_is_on_for_cuda_ranks_only(value, device, on):
    kw = {} if value is None else {"shm_direct": value}
    got, why = direct_regions(Settings(shared_memory="system", **kw), device)
    assert got is on and ("unset" in why) == (value is None), why
    assert direct_regions(Settings(**({} if value is None else {"shm_direct": False})), device)[0] is False
