"""A rank's direct access to its clients' shared-memory objects (`--shm-direct`).

T tokens of a step, H hidden, n a rank's rows (service.worker.rank).

With system shared memory on (service.api.regions) a request's hidden_states may lie in a client's
POSIX shared-memory object and its answer go into another. Without shm_direct the front end copies
those rows into the step's slot and the answer out of it (two host copies of T x H each). With it,
the batcher sends a *source* per such piece with the step (WorkerGroup.run(slot, T, sources)), and
each rank moves the rows of the source that fall in its range itself:

    (slot row, rows, in key, in identity, in byte offset, out key, out identity, out byte offset)

where a key is the object's POSIX name ("/name") and an identity its (st_dev, st_ino) as the front
end recorded it when the region was registered. The rank opens the object by its key like the front
end does (`open_object`: O_NOFOLLOW, O_NONBLOCK, a regular file, never one of the server's own
names), refuses it when fstat's identity is not the source's (the key now names another object),
and keeps it in a small cache keyed by identity (`Objects`: at most MAX_OBJECTS objects and
MAX_BYTES bytes, least recently used evicted, and those no name leads to any more dropped when the
idle rank is pinged; an open descriptor keeps the inode, so an identity in the cache always names
the object it was opened as). An object the client removed while its region stays registered is
not found by a rank that does not hold it (the request's 400; the copy path still reads it through
the front end's descriptor).

- A CUDA rank maps the object (MAP_SHARED), registers the mapping with CUDA once (page-locked,
  as the slots: service.worker.rank.pin_slot) and DMAs rows between it and the device; the CPU
  never touches the mapping (a client that truncates its object would turn that into a SIGBUS): the
  object's size is checked against the source's bytes before any DMA is enqueued.
- A CPU rank maps nothing: it preadv's the rows into the rows the layer reads and pwritev's the
  answer, what the front end does on the copy path.

Each rank reports, per source it touched, its first row whose values are not all finite (those
rows are zeroed before the layer reads them), or why the source could not be used (`report`), in
its "done" stats; the group merges them (`merge`) and the batcher turns them into the request's 400.

The helpers that name and open a client's object live here, below service.api (imports point from
api to worker): service.api.regions uses the same ones.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import mmap
import os
import stat

import torch

from service.errors import InvalidInput

SHM_ROOT = "/dev/shm"  # where shm_open's names live on Linux
OWN_PREFIX = "moe-"    # names of the server's own files there (service.worker.shm.PREFIX among them)
MAX_NAME = 255         # characters of a key (NAME_MAX)
MAX_OBJECTS = 64       # objects a rank keeps open (and, on CUDA, mapped and page-locked) at most
MAX_BYTES = 4 << 30    # ... and their bytes: page-locked memory is the host's; one larger object is kept alone

# A source, as the batcher builds it and the step message carries it (a plain tuple: it is pickled
# for every step, and the ranks' protocol has no classes)
Source = tuple[int, int, str, tuple[int, int], int, str, tuple[int, int], int]
# What a rank reports for a source: the first row (of the source) that is not finite, or
# (side "in" | "out", code "truncated" | "replaced" | "error", text)
Report = int | tuple[str, str, str]


def identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def key_path(key) -> str:
    """The file behind a POSIX shared-memory name ("/name")."""
    if not isinstance(key, str):
        raise InvalidInput(f"'key' must be a string, got {key!r}")
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name or len(name) > MAX_NAME:
        raise InvalidInput(f"key {key!r} is not a POSIX shared-memory name ('/name', without any other '/', "
                           f"not '.' or '..', at most {MAX_NAME} characters)")
    if name.startswith(OWN_PREFIX):
        raise InvalidInput(f"key {key!r}: names starting with '/{OWN_PREFIX}' are this server's own shared memory")
    return os.path.join(SHM_ROOT, name)


def open_object(path: str, key: str) -> int:
    """A descriptor of the regular file at `path` (the object behind `key`), never following a link."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidInput(f"no shared-memory object {key} exists on this host") from None
    except OSError as e:
        raise InvalidInput(f"cannot open the shared-memory object {key}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidInput(f"{key} is not a shared-memory object (not a regular file)")
    return fd


def memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, whatever its dtype (bf16 has no numpy twin)."""
    assert t.is_contiguous() and t.device.type == "cpu", (t.is_contiguous(), t.device)
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class SourceError(Exception):
    """A source that cannot be used: `code` "truncated", "replaced" or "error" (with its text)."""

    def __init__(self, code: str, text: str):
        super().__init__(text)
        self.code = code


@dataclasses.dataclass(eq=False)
class _Entry:
    """One object the rank holds: its descriptor, and on CUDA its page-locked mapping."""

    fd: int
    size: int
    mm: mmap.mmap | None = None
    base: torch.Tensor | None = None  # [size] uint8 over the mapping (CUDA): DMA only, never read by the CPU

    def view(self, at: int, rows: int, row_bytes: int) -> torch.Tensor:
        """[rows, row_bytes] uint8 of the mapping from byte `at` (a DMA's host side)."""
        assert self.base is not None
        return self.base[at:at + rows * row_bytes].view(rows, row_bytes)


class Objects:
    """The objects a rank has opened for sources, by identity (see the module docstring)."""

    def __init__(self, *, cuda: bool, reserved: set[tuple[int, int]] | None = None,
                 max_objects: int = MAX_OBJECTS, max_bytes: int = MAX_BYTES):
        self.cuda = cuda
        self.reserved = set(reserved or ())  # the rank's own files (its slots): never a source's
        self.max_objects, self.max_bytes = max_objects, max_bytes
        self._entries: collections.OrderedDict[tuple[int, int], _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    def get(self, key: str, ident: tuple[int, int], need: int, keep: set[tuple[int, int]]) -> _Entry:
        """The object `ident` behind `key`, at least `need` bytes long now (SourceError otherwise);
        evicts the least recently used objects past the bounds, never those in `keep` (the step's)."""
        ident = (ident[0], ident[1])  # (hashable whatever sequence it came as)
        entry = self._entries.get(ident)
        if entry is not None:
            size = os.fstat(entry.fd).st_size
            if size < need:
                raise SourceError("truncated", f"{key} is {size} bytes, the rows need {need}")
            if self.cuda and size != entry.size:  # grown or shrunk: map it again at its new size
                _unmap(entry)
                entry.size = size
                try:
                    _map(entry)
                except SourceError:
                    self._drop(ident)
                    raise
                self._evict(keep | {ident})
            self._entries.move_to_end(ident)
            return entry
        if ident in self.reserved:
            raise SourceError("error", f"{key} is this server's own shared memory")
        try:
            fd = open_object(key_path(key), key)
        except InvalidInput as err:
            raise SourceError("error", str(err)) from None
        try:
            if identity(fd) != ident:
                raise SourceError("replaced", f"{key} is no longer the object that was registered")
            size = os.fstat(fd).st_size
            if size < need:
                raise SourceError("truncated", f"{key} is {size} bytes, the rows need {need}")
            entry = _Entry(fd, size)
            if self.cuda:
                _map(entry)
        except BaseException:
            os.close(fd)
            raise
        self._entries[ident] = entry
        self._evict(keep | {ident})
        return entry

    def prune(self) -> None:
        """Drop the objects that no name leads to any more (the client removed them): their pages
        would otherwise stay pinned until evicted. (A rank prunes when pinged: an idle group.)"""
        for ident, entry in list(self._entries.items()):
            if os.fstat(entry.fd).st_nlink == 0:
                self._drop(ident)

    def close(self) -> None:
        for ident in list(self._entries):
            self._drop(ident)

    def _evict(self, keep: set[tuple[int, int]]) -> None:
        synced = False
        for ident in list(self._entries):  # least recently used first
            if len(self._entries) <= self.max_objects and self.bytes <= self.max_bytes:
                return
            if ident in keep:
                continue
            if self.cuda and not synced:  # a step still in flight may DMA from or into it
                torch.cuda.synchronize()
                synced = True
            self._drop(ident)

    def _drop(self, ident: tuple[int, int]) -> None:
        entry = self._entries.pop(ident)
        _unmap(entry)
        os.close(entry.fd)


def _unmap(entry: _Entry) -> None:
    """Unregister and unmap the object's mapping (CUDA), once no DMA of it can be pending."""
    if entry.base is not None:
        torch.cuda.synchronize()  # (cheap when _evict did it already) a step in flight may DMA from or into it
        torch.cuda.cudart().cudaHostUnregister(entry.base.data_ptr())
        entry.base = None
    if entry.mm is not None:
        with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with it
            entry.mm.close()
        entry.mm = None


def _map(entry: _Entry) -> None:
    """Map the object and register the mapping with CUDA (page-locked: DMA, no staged copy)."""
    try:
        mm = mmap.mmap(entry.fd, entry.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:  # (ENOMEM: too many mappings) the request's error, not the step's
        raise SourceError("error", f"cannot map the object ({entry.size} bytes): {e.strerror}") from None
    base = torch.frombuffer(mm, dtype=torch.uint8)  # no page is touched: only DMA ever reads or writes it
    err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), entry.size, 0)
    if int(err) != 0:
        del base
        mm.close()
        raise SourceError("error", f"cudaHostRegister of the object ({entry.size} bytes) failed: error {int(err)}")
    entry.mm, entry.base = mm, base


@dataclasses.dataclass
class Move:
    """Rows [a, b) of a rank's rows (or of the slot, CPU ranks of one host) to or from an object at byte `at`."""

    a: int
    b: int
    entry: _Entry
    at: int
    source: int  # the source's index in the step's list


@dataclasses.dataclass
class Plan:
    """A rank's share of one step's sources: what to read, check and write, and what failed already."""

    reads: list[Move]
    writes: list[Move]
    zero: list[tuple[int, int]]  # rows of a source that failed: zeroed, never read
    report: dict[int, Report]
    rows_in: tuple[int, int]  # (start, n): the slot rows the reads' rows are relative to

    @property
    def span(self) -> tuple[int, int] | None:
        """The rows from the first read's to the last's: one check covers them (the other rows were
        checked by the front end)."""
        if not self.reads:
            return None
        return min(m.a for m in self.reads), max(m.b for m in self.reads)


def plan(sources, objects: Objects, row_bytes: int, rows_in: tuple[int, int],
         rows_out: tuple[int, int]) -> Plan:
    """The moves of `sources` for a rank that reads the slot rows rows_in = (start, n) (relative
    to start) and answers rows_out = (start, n) (relative to rows_out's own start). Each source's
    objects are resolved and their size checked against the whole source (every rank reports the
    same error for it)."""
    reads: list[Move] = []
    writes: list[Move] = []
    zero: list[tuple[int, int]] = []
    report: dict[int, Report] = {}
    keep = {tuple(s[3]) for s in sources} | {tuple(s[6]) for s in sources}
    for i, (row, rows, in_key, in_id, in_at, out_key, out_id, out_at) in enumerate(sources):
        a_in, b_in = _overlap(row, rows, rows_in)
        a_out, b_out = _overlap(row, rows, rows_out)
        if a_in >= b_in and a_out >= b_out:
            continue
        nbytes = rows * row_bytes
        side = "in"
        try:
            src = objects.get(in_key, in_id, in_at + nbytes, keep)
            side = "out"
            dst = objects.get(out_key, out_id, out_at + nbytes, keep)
        except SourceError as err:
            report[i] = (side, err.code, str(err))
            if a_in < b_in:
                zero.append((a_in, b_in))
            continue
        if a_in < b_in:
            reads.append(Move(a_in, b_in, src, in_at + (rows_in[0] + a_in - row) * row_bytes, i))
        if a_out < b_out:
            writes.append(Move(a_out, b_out, dst, out_at + (rows_out[0] + a_out - row) * row_bytes, i))
    return Plan(reads, writes, zero, report, rows_in)


def _overlap(row: int, rows: int, span: tuple[int, int]) -> tuple[int, int]:
    """Slot rows [row, row + rows) within span = (start, n), relative to start (empty: a >= b)."""
    start, n = span
    return max(row, start) - start, min(row + rows, start + n) - start


def note_bad(report: dict[int, Report], move: Move, source_row: int, bad: int) -> None:
    """Row `bad` of `move` (the source's row `source_row` + bad) is not finite: keep the source's first."""
    row = source_row + bad
    have = report.get(move.source)
    if have is None or (isinstance(have, int) and row < have):
        report[move.source] = row


def check_rows(x: torch.Tensor, move: Move, source_row: int, report: dict[int, Report]) -> None:
    """CPU: the rows `move` read into x[move.a:move.b]: zero those that are not all finite, note the first."""
    rows = x[move.a:move.b]  # [r, H]
    if torch.isfinite(rows.sum()):  # a finite sum proves every element finite (an overflowing one decides exactly)
        return
    bad = ~torch.isfinite(rows).all(dim=1)  # [r]
    if bool(bad.any()):
        note_bad(report, move, source_row, int(bad.nonzero()[0]))
        rows[bad] = 0


def read_rows(move: Move, dst: torch.Tensor) -> None:
    """CPU: preadv the move's rows into dst (contiguous, the slot's dtype)."""
    buf, done = memory(dst), 0
    while done < len(buf):
        n = _io(os.preadv, move, buf[done:], move.at + done)
        if n == 0:
            raise SourceError("truncated", "the object ends before the rows")
        done += n


def write_rows(move: Move, src: torch.Tensor) -> None:
    """CPU: pwritev src (contiguous) into the object at the move's byte, never past its end."""
    buf, done = memory(src), 0
    if os.fstat(move.entry.fd).st_size < move.at + len(buf):  # pwrite would grow the object, not fail
        raise SourceError("truncated", "the object ends before the answer's rows")
    while done < len(buf):
        done += _io(os.pwritev, move, buf[done:], move.at + done)


def _io(call, move: Move, buf: memoryview, at: int) -> int:
    """One preadv / pwritev; an error of the client's object (EIO, ENOSPC) is its source's alone."""
    try:
        return call(move.entry.fd, [buf], at)
    except OSError as e:
        raise SourceError("error", f"at byte {at}: {e.strerror}") from None


def merge(reports: list[dict[int, Report]]) -> dict[int, Report]:
    """The ranks' reports of one step as one: a source's error wins over a bad row (a source that
    failed is not read), else its first bad row over all ranks."""
    merged: dict[int, Report] = {}
    for report in reports:
        for i, r in report.items():
            have = merged.get(i)
            if have is None or (isinstance(have, int) and (not isinstance(r, int) or r < have)):
                merged[i] = r
    return merged
