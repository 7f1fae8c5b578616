"""A rank's direct access to its clients' shared-memory objects (`--shm-direct`).

T tokens of a step, H hidden, n a rank's rows (service.worker.rank).

With system shared memory on (service.api.regions) a request's hidden_states may lie in a client's
POSIX shared-memory object and its answer go into another. Without shm_direct the front end copies
those rows into the step's slot and the answer out of it (two host copies of T x H each). With it,
the batcher sends a *source* per such piece with the step (WorkerGroup.run(slot, T, sources)), and
each rank moves the rows of the source that fall in its range itself:

    (slot row, rows, in key, in identity, in byte offset, out key, out identity, out byte offset,
     in region, out region)

where a key is the object's POSIX name ("/name"), an identity its (st_dev, st_ino) as the front end
recorded it when the region was registered, and a region (offset, byte_size) as registered. The
rank opens the object by its key like the front end does (`open_object`: O_NOFOLLOW, O_NONBLOCK, a
regular file, never one of the server's own names nor, by identity, its own slots), refuses it when
fstat's identity is not the source's (the key now names another object), and keeps the *region* in
a small cache keyed by (identity, byte range) (`Objects`; an open descriptor keeps the inode, so an
identity in the cache always names the object it was opened as):

- A plan looks each region up once (`plan`: a source whose input and output share a region, two
  sources in one: one lookup), so nothing a step holds is mapped again or dropped while it plans;
  whatever a lookup raises is its sources' error (the request's 400), never the step's.
- A CUDA rank maps only the region's bytes, from the page its offset is in (`span`), never the
  object, and page-locks them (cudaHostRegister populates what it registers: a one-row region of a
  sparse 8 GiB object would otherwise fill 8 GiB of the host's memory). A region larger than
  DIRECT_MAX_BYTES (1 GiB) is never direct, and the batcher keeps a step's regions within
  MAX_OBJECTS (64) and MAX_BYTES (4 GiB), taking the copy path for a piece past them, so those are
  real bounds of what a rank holds: the least recently used regions are dropped (after a device
  sync) to make room, never the step's own.
- Stale pages: page-locked pages are the ones the object had when they were registered; a client
  that truncates its object and grows it back, or punches a hole, leaves the mapping on orphaned
  pages (a DMA would read old rows and write the answer where nobody reads it). So at each use the
  object's (st_size, st_ctime_ns) is compared with what it was when the region was registered (read
  after registering; the pages are faulted in by read before they are page-locked, since a write
  fault of a tmpfs page moves ctime and would make every other registration of the object, its
  other regions' and the other ranks', look stale at each step); if either moved the region is unregistered
  (after a sync: a step in flight may still DMA it) and registered again; a region past the
  object's end is "truncated" (and let go). A truncate, a regrow, a hole punched and a write() or
  pwrite() all change ctime (checked on Linux 6.18 tmpfs, which keeps fine-grained ctimes; a
  kernel with coarse timestamps could miss a change within one clock tick of the last check); a
  write through an existing mapping of the client's does not, once its pages are faulted in
  (tritonclient's shared-memory utilities and the bench write that way). The residual: a client
  that writes its rows with write()/pwrite() each request, or maps its object afresh for each
  request (its first write to each page of a new mapping is a write fault), has its region
  registered again each step (correct, slower); and a change made while the rank registers the region (between its
  mapping and the fstat after it) is not seen until the object changes again.
- Every PRUNE_S (1 s) of steps, and whenever an idle rank is pinged, a rank lets go of the regions
  of objects no name leads to any more (the client removed them) and of those no step used for
  IDLE_S (30 s), so an unregistered region's pages are not pinned for good under load either.
  An object the client removed while its region stays registered is not found by a rank that does
  not hold it (the request's 400; the copy path still reads it through the front end's descriptor).
- A CUDA rank DMAs rows between the mapping and the device; the CPU never touches the mapping (a
  client that truncates its object would turn that into a SIGBUS).
- A CPU rank maps nothing: it preadv's the rows into the rows the layer reads and pwritev's the
  answer, what the front end does on the copy path (shm_direct is off on CPU ranks unless asked
  for: there it moves the front end's reads into every rank, service.fleet.direct_regions).

Each rank reports, per source it touched, its first row whose values are not all finite (those
rows are zeroed before the layer reads them), or why the source could not be used (`report`), in
its "done" stats; the group merges them (`merge`) and the batcher turns them into the request's 400.

A source's object may also be a front end's wire arena (service.api.arena, `--wire-arena-mib`): a
v2 binary request's body received into shared memory, and its answer's block beside it. The rank
treats it as any region (the whole arena is the region: mapped and page-locked once), opens it by
its own name (`source_path`: names starting with ARENA_PREFIX, which `key_path` refuses to clients),
and keeps it however long it stays unused, while it is named.

The helpers that name and open a client's object live here, below service.api (imports point from
api to worker): service.api.regions uses the same ones.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import mmap
import os
import stat
import time

import torch

from service.errors import InvalidInput
from service.worker.shm import ARENA_PREFIX

SHM_ROOT = "/dev/shm"  # where shm_open's names live on Linux
OWN_PREFIX = "moe-"    # names of the server's own files there (service.worker.shm.PREFIX among them)
MAX_NAME = 255         # characters of a key after its '/' (NAME_MAX, a file name's bytes: a longer UTF-8 name
                       # fails to open, with its error) and of a region's name (service.api.regions)
DIRECT_MAX_BYTES = 1 << 30  # a region larger than this is never direct (the batcher copies its rows)
MAX_OBJECTS = 64       # regions a rank keeps open (and, on CUDA, mapped and page-locked) at most
MAX_BYTES = 4 << 30    # ... and their mapped bytes (page-locked memory is the host's): a real bound, as
                       # the batcher never puts more than this (nor more regions) in one step's sources
PRUNE_S = 1.0          # how often (seconds of steps) a rank looks for regions to let go of:
IDLE_S = 30.0          # ... those no step used for this long, and those of objects no name leads to

# A source, as the batcher builds it and the step message carries it (a plain tuple: it is pickled
# for every step, and the ranks' protocol has no classes): slot row, rows, then for its input and its
# output the object's key, identity and the rows' byte; then the input's and the output's region as
# registered, (offset, byte_size): what a rank maps
Source = tuple[int, int, str, tuple[int, int], int, str, tuple[int, int], int, tuple[int, int], tuple[int, int]]
# What a rank reports for a source: the first row (of the source) that is not finite, or
# (side "in" | "out", code "truncated" | "replaced" | "error", text)
Report = int | tuple[str, str, str]


def span(offset: int, byte_size: int) -> tuple[int, int]:
    """The bytes [lo, hi) of its object a rank maps for a region (offset, byte_size): from the page
    its first byte is in to its last byte (mmap's offsets are whole pages)."""
    return offset - offset % mmap.ALLOCATIONGRANULARITY, offset + byte_size


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


def source_path(key: str) -> str:
    """The file behind a source's key: a front end's wire arena (service.api.arena: the server's own
    name, which no client can register, since `key_path` refuses it there), else a client's object
    with `key_path`'s checks."""
    name = key[1:] if isinstance(key, str) and key.startswith("/") else None
    if name is not None and name.startswith(ARENA_PREFIX) and "/" not in name and len(name) <= MAX_NAME:
        return os.path.join(SHM_ROOT, name)
    return key_path(key)


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
    """One region the rank holds: a descriptor of its object, the bytes [lo, hi) it covers, the
    object's (st_size, st_ctime_ns) when they were last registered, and on CUDA its page-locked
    mapping of those bytes."""

    fd: int
    lo: int
    hi: int
    stamp: tuple[int, int] = (-1, -1)
    used: float = 0.0  # time.monotonic() of its last step
    arena: bool = False  # a front end's wire arena: kept while named, however long unused (`prune`)
    mm: mmap.mmap | None = None
    base: torch.Tensor | None = None  # [hi - lo] uint8 over the mapping (CUDA): DMA only, never read by the CPU

    def view(self, at: int, rows: int, row_bytes: int) -> torch.Tensor:
        """[rows, row_bytes] uint8 of the mapping from the object's byte `at` (a DMA's host side)."""
        assert self.base is not None and self.lo <= at and at + rows * row_bytes <= self.hi, (self.lo, at, self.hi)
        return self.base[at - self.lo:at - self.lo + rows * row_bytes].view(rows, row_bytes)


EntryKey = tuple[int, int, int, int]  # (st_dev, st_ino, lo, hi): a region of an object


class Objects:
    """The regions a rank has opened for sources, by object identity and byte range (see the module
    docstring)."""

    def __init__(self, *, cuda: bool, reserved: set[tuple[int, int]] | None = None,
                 max_objects: int = MAX_OBJECTS, max_bytes: int = MAX_BYTES):
        self.cuda = cuda
        self.reserved = set(reserved or ())  # the rank's own files (its slots): never a source's
        self.max_objects, self.max_bytes = max_objects, max_bytes
        self._entries: collections.OrderedDict[EntryKey, _Entry] = collections.OrderedDict()
        self._pruned = time.monotonic()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """The bytes mapped (and page-locked) now."""
        return sum(e.hi - e.lo for e in self._entries.values() if e.base is not None)

    def get(self, key: str, ident: tuple[int, int], region: tuple[int, int], keep: set[EntryKey]) -> _Entry:
        """Region `region` = (offset, byte_size) of the object `ident` behind `key`, registered for its
        object's current pages (SourceError otherwise); evicts the least recently used regions past
        the bounds, never those in `keep` (the step's)."""
        lo, hi = span(*region)
        k = (ident[0], ident[1], lo, hi)
        entry = self._entries.get(k)
        if entry is None:
            entry = self._open(key, k, keep)
        else:
            st = os.fstat(entry.fd)
            if (st.st_size, st.st_ctime_ns) != entry.stamp:  # truncated, grown, a hole punched: new pages
                _unmap(entry)  # (after a sync: a step in flight may still DMA the old ones)
                try:
                    self._register(entry)
                except BaseException:
                    self._drop(k)
                    raise
        entry.used = time.monotonic()
        self._entries.move_to_end(k)
        return entry

    def _open(self, key: str, k: EntryKey, keep: set[EntryKey]) -> _Entry:
        if k[:2] in self.reserved:
            raise SourceError("error", f"{key} is this server's own shared memory")
        try:
            path = source_path(key)
            fd = open_object(path, key)
        except InvalidInput as err:
            raise SourceError("error", str(err)) from None
        entry = _Entry(fd, k[2], k[3], arena=os.path.basename(path).startswith(ARENA_PREFIX))
        try:
            if identity(fd) != k[:2]:
                raise SourceError("replaced", f"{key} is no longer the object that was registered")
            if self.cuda:  # room for its mapping first: the bound holds at every moment
                self._evict(keep | {k}, room=entry.hi - entry.lo)
            self._register(entry)
        except BaseException:
            os.close(fd)
            raise
        self._entries[k] = entry
        self._evict(keep | {k})
        return entry

    def _register(self, entry: _Entry) -> None:
        """(Re)map the entry's bytes (CUDA) for the object as it is now, and stamp it."""
        size = os.fstat(entry.fd).st_size
        if size < entry.hi:
            raise SourceError("truncated", f"the object is {size} bytes, the region needs {entry.hi}")
        if self.cuda:
            _map(entry)
        st = os.fstat(entry.fd)  # after the mapping: page-locking it faults its pages in (a ctime of its own)
        entry.stamp = (st.st_size, st.st_ctime_ns)

    def prune(self, force: bool = False) -> None:
        """Every PRUNE_S (or now, `force`: an idle rank) drop the regions that no step used for
        IDLE_S (but a front end's wire arena, kept while it is named: page-locking its hundreds of
        MiB again would cost the next request tens of ms), and those whose object no name leads to
        any more (the client removed it, the front end exited: its pages would otherwise stay pinned
        until evicted)."""
        now = time.monotonic()
        if not force and now - self._pruned < PRUNE_S:
            return
        self._pruned = now
        for k, entry in list(self._entries.items()):
            if (now - entry.used > IDLE_S and not entry.arena) or os.fstat(entry.fd).st_nlink == 0:
                self._drop(k)

    def close(self) -> None:
        for k in list(self._entries):
            self._drop(k)

    def _evict(self, keep: set[EntryKey], room: int = 0) -> None:
        """Least recently used first, drop regions until at most max_objects are held (one more to
        come when `room`) and `room` more bytes fit under max_bytes; never those in `keep` (the
        step's: the batcher keeps a step's regions within both bounds)."""
        extra = 1 if room else 0
        for k in list(self._entries):  # least recently used first
            if len(self._entries) + extra <= self.max_objects and self.bytes + room <= self.max_bytes:
                return
            if k not in keep:
                self._drop(k)  # (_unmap syncs first: a step in flight may still DMA it)
        if room and self.bytes + room > self.max_bytes:
            raise SourceError("error", f"the rank's page-locked bytes for regions are all in use by this step "
                                       f"({self.bytes} of {self.max_bytes}; the region needs {room})")

    def _drop(self, k: EntryKey) -> None:
        entry = self._entries.pop(k)
        _unmap(entry)
        os.close(entry.fd)


def _unmap(entry: _Entry) -> None:
    """Unregister and unmap the entry's mapping (CUDA), once no DMA of it can be pending."""
    if entry.base is not None:
        torch.cuda.synchronize()  # a step in flight may DMA from or into it (cheap when nothing is)
        torch.cuda.cudart().cudaHostUnregister(entry.base.data_ptr())
        entry.base = None
    if entry.mm is not None:
        with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with it
            entry.mm.close()
        entry.mm = None


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                   ctypes.c_ulong]
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t
MADV_POPULATE_READ = 22  # linux/mman.h (5.14+): fault the range in as reads would, without reading it
IOV_MAX = 1024  # pages faulted per process_vm_readv call (the kernel's UIO_MAXIOV)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def fault_in_by_read(ptr: int, n: int) -> None:
    """Fault the pages of [ptr, ptr + n) in as reads would, touching no byte from Python: see `_map`
    for why. MADV_POPULATE_READ where the kernel has it (5.14+); before it (EINVAL: RHEL 8's 4.18,
    Ubuntu 20.04's 5.4) the same read faults through process_vm_readv of this process's own pages,
    one byte of each into a scratch buffer, which like the madvise takes a page past the object's end
    as EFAULT (the call stops there), never a SIGBUS. Best effort: what is not faulted in here, the
    page-locking faults in itself."""
    if _LIBC.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(n), MADV_POPULATE_READ) == 0 \
            or ctypes.get_errno() != errno.EINVAL:  # done, or stopped past the object's end (EFAULT)
        return
    page = mmap.PAGESIZE
    pages = range(ptr - ptr % page, ptr + n, page)
    scratch = ctypes.create_string_buffer(IOV_MAX)
    local = _Iovec(ctypes.addressof(scratch), IOV_MAX)
    for i in range(0, len(pages), IOV_MAX):
        chunk = pages[i:i + IOV_MAX]
        remote = (_Iovec * len(chunk))(*(_Iovec(max(a, ptr), 1) for a in chunk))
        if _LIBC.process_vm_readv(os.getpid(), ctypes.byref(local), 1, remote, len(chunk), 0) < len(chunk):
            return  # past the object's end (EFAULT) or not allowed (EPERM under a seccomp profile)


def _map(entry: _Entry) -> None:
    """Map the entry's bytes of its object and register them with CUDA (page-locked: DMA, no staged
    copy); whatever fails is the source's error."""
    n = entry.hi - entry.lo
    try:
        mm = mmap.mmap(entry.fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=entry.lo)
    except (OSError, ValueError, OverflowError) as e:  # (ENOMEM: too many mappings) the request's error
        raise SourceError("error", f"cannot map bytes {entry.lo}..{entry.hi - 1} of the object: "
                                   f"{getattr(e, 'strerror', None) or e}") from None
    base = torch.frombuffer(mm, dtype=torch.uint8)  # no page is touched: only DMA ever reads or writes it
    # Fault the pages in by read first: page-locking a writable mapping write-faults every page it has
    # not mapped yet, and on tmpfs a write fault moves the object's ctime, which would make every other
    # registration of the object (the other ranks', its other regions') look stale and be registered
    # again at each step, each time moving ctime anew. A read fault of a shared writable tmpfs mapping
    # maps the page writable, so the locking takes no write fault. (The kernel faults; past the
    # object's end it is EFAULT, no SIGBUS.)
    fault_in_by_read(base.data_ptr(), n)
    err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), n, 0)
    if int(err) != 0:
        del base
        mm.close()
        raise SourceError("error", f"cudaHostRegister of bytes {entry.lo}..{entry.hi - 1} of the object failed: "
                                   f"error {int(err)}")
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


def entry_key(ident, region: tuple[int, int]) -> EntryKey:
    """The cache's key of a source's region: its object's identity and the bytes a rank maps."""
    return (ident[0], ident[1], *span(*region))


def plan(sources, objects: Objects, row_bytes: int, rows_in: tuple[int, int],
         rows_out: tuple[int, int]) -> Plan:
    """The moves of `sources` for a rank that reads the slot rows rows_in = (start, n) (relative
    to start) and answers rows_out = (start, n) (relative to rows_out's own start). Each region the
    rank's sources name is looked up once (a source's input and output in one region, two sources in
    one: one lookup, so nothing the step holds is mapped again or dropped while it plans), and each
    source's rows are checked against its regions (every rank reports the same error for it).
    Whatever a lookup raises is its sources' error, never the step's."""
    reads: list[Move] = []
    writes: list[Move] = []
    zero: list[tuple[int, int]] = []
    report: dict[int, Report] = {}
    keep = {entry_key(s[3], s[8]) for s in sources} | {entry_key(s[6], s[9]) for s in sources}
    found: dict[EntryKey, _Entry | SourceError] = {}

    def lookup(key, ident, region, at: int, nbytes: int) -> _Entry:
        k = entry_key(ident, region)
        if k not in found:
            try:
                found[k] = objects.get(key, ident, region, keep)
            except SourceError as err:
                found[k] = err
            except Exception as err:  # noqa: BLE001  (a bug or an errno nobody foresaw) the source's alone
                found[k] = SourceError("error", f"{type(err).__name__}: {err}")
        got = found[k]
        if isinstance(got, SourceError):
            raise got
        if not (region[0] <= at and at + nbytes <= region[0] + region[1]):
            raise SourceError("error", f"bytes {at}..{at + nbytes - 1} are not in the region "
                                       f"({region[0]}..{region[0] + region[1] - 1})")
        return got

    for i, (row, rows, in_key, in_id, in_at, out_key, out_id, out_at, in_region, out_region) in enumerate(sources):
        a_in, b_in = _overlap(row, rows, rows_in)
        a_out, b_out = _overlap(row, rows, rows_out)
        if a_in >= b_in and a_out >= b_out:
            continue
        nbytes = rows * row_bytes
        side = "in"
        try:
            src = lookup(in_key, in_id, in_region, in_at, nbytes)
            side = "out"
            dst = lookup(out_key, out_id, out_region, out_at, nbytes)
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


class ObjectIOError(Exception):
    """A preadv / pwritev of a client's object failed (EIO, ENOSPC in a full /dev/shm): at byte `at`."""

    def __init__(self, at: int, strerror: str):
        super().__init__(f"at byte {at}: {strerror}")
        self.at, self.strerror = at, strerror


def pread_all(fd: int, buf: memoryview, at: int) -> None:
    """Fill buf from byte `at` of the object: EOFError when it ends first, ObjectIOError when a read
    fails (the front end's copy in, service.api.regions, and a CPU rank's alike)."""
    done = 0
    while done < len(buf):
        n = _io(os.preadv, fd, buf[done:], at + done)
        if n == 0:
            raise EOFError
        done += n


def pwrite_all(fd: int, buf: memoryview, at: int) -> None:
    """Write buf at byte `at` of the object, never past its end (pwrite would grow it, not fail):
    EOFError when it is shorter, ObjectIOError when a write fails."""
    if os.fstat(fd).st_size < at + len(buf):
        raise EOFError
    done = 0
    while done < len(buf):
        done += _io(os.pwritev, fd, buf[done:], at + done)


def _io(call, fd: int, buf: memoryview, at: int) -> int:
    try:
        return call(fd, [buf], at)
    except OSError as e:
        raise ObjectIOError(at, e.strerror or str(e)) from None


def read_rows(move: Move, dst: torch.Tensor) -> None:
    """CPU: preadv the move's rows into dst (contiguous, the slot's dtype)."""
    try:
        pread_all(move.entry.fd, memory(dst), move.at)
    except EOFError:
        raise SourceError("truncated", "the object ends before the rows") from None
    except ObjectIOError as e:  # an error of the client's object is its source's alone
        raise SourceError("error", str(e)) from None


def write_rows(move: Move, src: torch.Tensor) -> None:
    """CPU: pwritev src (contiguous) into the object at the move's byte, never past its end."""
    try:
        pwrite_all(move.entry.fd, memory(src), move.at)
    except EOFError:
        raise SourceError("truncated", "the object ends before the answer's rows") from None
    except ObjectIOError as e:
        raise SourceError("error", str(e)) from None


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
