"""Triton's system shared-memory extension: the regions clients registered, shared by every front end.

T tokens, H hidden (see service.config).

A client on this host creates a POSIX shared-memory object (shm_open: /dev/shm/<key>), registers a
part of it as a named region (key, offset, byte_size), and names the region in a tensor's
parameters (shared_memory_region, shared_memory_byte_size, shared_memory_offset) instead of sending
the tensor's bytes. hidden_states' rows are read from the object straight into the step's slot (the
one copy in, `copy_rows`, in the batcher's step thread, before the check of their values there) and
the answer is written from the slot straight into the client's output region (the one copy out;
rows whose dtype is not the slot's go through a scratch of CONVERT_BYTES a chunk at a time);
topk_ids and topk_weights ([T, K], small) are read when the request is decoded, since `validate`
checks their values (only once every input's shape has passed `codecs.check_shapes`). Nothing is
written into an output region once its request has its answer or its error (service.api.batcher).

With `--shm-direct` (Settings.shm_direct) the front end copies neither: for rows of the slot's
dtype in and out, the batcher hands the ranks the region's key, the object's identity and the byte
offset and the region as registered (`RegionRows.place`), and each rank opens the object itself,
checks that identity, and reads and writes its rows there (service.worker.direct: on a GPU it maps
and page-locks the region's bytes alone, never the object, and DMAs them; a region larger than
DIRECT_MAX_BYTES keeps the copies here). What fails there comes back as the same errors as here
(`truncated`, `replaced`). A request that fails (a bad row, its deadline, a gRPC client's own
deadline) may then have had its output region written (Triton leaves outputs unspecified on
error); nothing is written into it once its answer or error was sent.

Several front-end processes serve one server's ports (service.fleet), and a region registered
through one connection must be usable on any of them as soon as the register call has returned,
and refused by all to new requests once unregister returns. So the registry is one small file that
every front end holds (`RegionTable`; unnamed, in /dev/shm; the owner creates it and hands its
descriptor to each front end before the group's state, service.fleet): the table as JSON behind a
version counter, written under an exclusive flock and read under a shared one, reparsed only when
the version moved (a lookup is otherwise one flock and one 8-byte pread). A flock belongs to an
open file description, and a descriptor passed over SCM_RIGHTS shares the sender's: so each
process opens the file again (/proc/self/fd/N) for a description of its own, or every LOCK_EX would
succeed at once and any LOCK_UN drop them all (lost updates, one name registered twice).

Each process opens an object itself when a request first names its region and keeps the descriptor
while the region stays registered; the object's (device, inode) recorded at register time must
still be the one behind the key, so a name that now points to another object is refused, never
read. The descriptors of unregistered regions are dropped at the next lookup and, on a front end
without traffic, by `Regions.keep_pruned` (every PRUNE_PERIOD_S): an idle front end never pins an
unlinked object's pages. A request that named a region before it was unregistered keeps its own
descriptor and still reads and writes the object until it is answered (Triton defers the
unregister instead).

Reads and writes are pread / pwrite on that descriptor, not a mapping: a client that truncates its
object would turn a read of a mapped page past the new end into a SIGBUS that kills the front end;
pread returns short instead, an error for that request alone. (Measured on the dev VM: pread of
4 MiB from tmpfs costs about what a memcpy of a mapped region does, 0.3-0.5 ms.)

Safety (the server reads and writes memory that a client names):
- off unless `--shared-memory system` (Settings.shared_memory): every call is refused, naming it;
- a key is one POSIX shm name ("/name": no other "/", not "." or ".."), opened with O_NOFOLLOW and
  O_NONBLOCK and required to be a regular file; names starting with OWN_PREFIX are the server's
  own, and its own files (the slots, this table) are refused by inode too (a hard link under
  another name would otherwise let one client read another's rows);
- offset + byte_size lie within the object when registered and within the region when used; an
  input's byte size equals its shape x dtype; an output region smaller than the answer is an error
  before the step runs, never a short write;
- at most MAX_REGIONS regions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import struct
import threading
import typing
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch

from service.api.error_map import (
    CudaSharedMemoryUnsupported,
    RegionExists,
    RegionNotFound,
    SharedMemoryOff,
    TooManyRegions,
)
from service.api.json_codec import below_2_64, echoed
from service.errors import InvalidInput
from service.worker.direct import (  # OWN_PREFIX and SHM_ROOT re-exported (tests, bench)
    MAX_NAME,
    OWN_PREFIX,  # noqa: F401
    SHM_ROOT,  # noqa: F401
    ObjectIOError,
    pread_all,
    pwrite_all,
)
from service.worker.direct import identity as _identity
from service.worker.direct import key_path as _key_path
from service.worker.direct import memory as _memory
from service.worker.direct import open_object as _open
from service.worker.shm import shm_dir

log = logging.getLogger(__name__)

MAX_REGIONS = 64       # registered regions per server (each front end may hold a descriptor of each)
PRUNE_PERIOD_S = 1.0   # how often an idle front end drops the descriptors of unregistered regions
# (the names, the key's checks and the object's opening are the ranks' too, --shm-direct: service.worker.direct)
OFF = ("system shared memory is off on this server; start it with --shared-memory system "
       "(MOE_SHARED_MEMORY=system) to register regions")

_VERSION = struct.Struct("<Q")  # the table file: version, then the table's JSON
CONVERT_BYTES = 1 << 20  # rows converted between a region's dtype and the slot's per chunk (stays in cache)


@dataclasses.dataclass(frozen=True)
class Region:
    """A registered region: bytes [offset, offset + byte_size) of the object behind `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    dev: int     # the object's device and inode when it was registered
    ino: int
    serial: int  # numbers registrations: a name registered again is a new region

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclasses.dataclass
class _State:
    """One version of the table (never changed once loaded or stored: `update` changes a copy)."""

    regions: dict[str, Region]
    reserved: set[tuple[int, int]]  # (device, inode) of the server's own files
    serial: int                     # the last registration's
    version: int                    # the table file's version this state was read at or written as

    def copy(self) -> _State:
        return _State(dict(self.regions), set(self.reserved), self.serial, self.version)


class RegionTable:
    """The registry file every front end of one server shares (see the module docstring).

    Takes over `fd` (the table file: the owner's, or one received from it over SCM_RIGHTS): it
    opens the file again for an open file description of this object's own, whose flock excludes
    every other process's, and closes `fd`."""

    def __init__(self, fd: int):
        try:
            self.fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise RuntimeError(f"the shared-memory registry opens its file again through /proc/self/fd, which "
                               f"failed ({e.strerror}): --shared-memory system needs /proc") from None
        finally:
            os.close(fd)
        self._state = _State({}, set(), 0, -1)
        self._lock = threading.Lock()  # the cached state, among this process's threads

    @classmethod
    def create(cls) -> RegionTable:
        """A new, empty table in an unnamed file (O_TMPFILE): nothing to remove, nothing to open by name."""
        directory = shm_dir()
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except (AttributeError, OSError):  # no O_TMPFILE here: a named file, unlinked at once
            path = os.path.join(directory, f"{OWN_PREFIX}regions-{os.urandom(16).hex()}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            os.unlink(path)
        table = cls(fd)
        table.update(lambda state: state.reserved.add(_identity(table.fd)))
        return table

    def close(self) -> None:
        os.close(self.fd)

    def reserve(self, fds: Iterable[int]) -> None:
        """Refuse the files behind `fds` (the server's own: a rank group's slots) as regions."""
        own = {_identity(fd) for fd in fds}
        self.update(lambda state: state.reserved.update(own))

    def state(self) -> _State:
        """The current table (reparsed only when another process changed it)."""
        with self._lock, self._flocked(fcntl.LOCK_SH):
            return self._load()

    def update(self, change: Callable[[_State], object]):
        """Apply `change` to a copy of the current table and store it as the next version, all
        under the exclusive lock; `change`'s result."""
        with self._lock, self._flocked(fcntl.LOCK_EX):
            state = self._load().copy()
            result = change(state)
            doc = {"regions": [dataclasses.asdict(r) for r in state.regions.values()],
                   "reserved": sorted(state.reserved), "serial": state.serial}
            data = json.dumps(doc).encode()
            version = state.version + 1
            os.ftruncate(self.fd, _VERSION.size + len(data))
            os.pwrite(self.fd, data, _VERSION.size)
            os.pwrite(self.fd, _VERSION.pack(version), 0)
            state.version = version
            self._state = state
            return result

    @contextlib.contextmanager
    def _flocked(self, how: int) -> Iterator[None]:
        fcntl.flock(self.fd, how)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _load(self) -> _State:
        head = os.pread(self.fd, _VERSION.size, 0)
        if len(head) < _VERSION.size:  # a new file: nothing written yet
            self._state = _State({}, set(), 0, 0)
            return self._state
        (version,) = _VERSION.unpack(head)
        if version != self._state.version:
            size = os.fstat(self.fd).st_size - _VERSION.size
            doc = json.loads(os.pread(self.fd, size, _VERSION.size))
            regions = {r["name"]: Region(**r) for r in doc["regions"]}
            self._state = _State(regions, {tuple(x) for x in doc["reserved"]}, doc["serial"], version)
        return self._state


class _Object:
    """This process's descriptor of one registered region's object (closed when nothing holds it)."""

    def __init__(self, region: Region, fd: int):
        self.region, self.fd = region, fd
        weakref.finalize(self, os.close, fd)

    def read_into(self, buf: memoryview, at: int) -> None:
        """buf <- the object from byte `at`; a short or failed read is this request's InvalidInput
        (an error of the client's object, ENOSPC in a full /dev/shm or EIO, never fails the step its
        batch-mates share)."""
        try:
            pread_all(self.fd, buf, at)
        except EOFError:
            raise self._truncated() from None
        except ObjectIOError as e:
            raise self._failed(e) from None

    def write(self, buf: memoryview, at: int) -> None:
        try:
            pwrite_all(self.fd, buf, at)
        except EOFError:
            raise self._truncated() from None
        except ObjectIOError as e:
            raise self._failed(e) from None

    def _truncated(self) -> InvalidInput:
        """The error of an access past the object's end: its size now against the bytes the region
        was registered with (what the data needs, whichever part of it was being read or written:
        the same error however a request's rows are split)."""
        r = self.region
        return InvalidInput(f"shared-memory region '{r.name}': its object {r.key} is now {os.fstat(self.fd).st_size} "
                            f"bytes; the region needs {r.offset + r.byte_size} (bytes {r.offset}.."
                            f"{r.offset + r.byte_size - 1}): it was truncated after it was registered")

    def _failed(self, e: ObjectIOError) -> InvalidInput:
        return InvalidInput(f"shared-memory region '{self.region.name}': {self.region.key} at byte {e.at}: "
                            f"{e.strerror}")


class RegionRows:
    """Rows [T, H] of `dtype` in a region, from byte `at` of its object: what a request's tensor is
    when it travels in shared memory (Decoded.x, the answer's destination)."""

    def __init__(self, obj: _Object, at: int, dtype: torch.dtype, shape: Iterable[int]):
        self.obj, self.at, self.dtype = obj, at, dtype
        self.shape = torch.Size(shape)
        self.row_bytes = self.shape[1] * dtype.itemsize if len(self.shape) == 2 else 0

    def dim(self) -> int:
        return len(self.shape)

    def place(self) -> tuple[str, tuple[int, int], int, tuple[int, int]]:
        """Where the rows lie, for a rank that opens the object itself (--shm-direct): the region's
        key, the object's (device, inode) when it was registered, the rows' first byte there, and the
        region as registered (offset, byte_size): what the rank maps."""
        r = self.obj.region
        return r.key, (r.dev, r.ino), self.at, (r.offset, r.byte_size)

    def truncated(self) -> InvalidInput:
        """The error of rows the object no longer holds (the same as a read or write of them here)."""
        return self.obj._truncated()

    def replaced(self) -> InvalidInput:
        """The error of rows whose key now names another object than the one registered."""
        return replaced(self.obj.region)

    def refused(self, text: str) -> InvalidInput:
        """Another error of the region's object (as a rank found it), naming the region."""
        return InvalidInput(f"shared-memory region '{self.obj.region.name}': {text}")

    def __getitem__(self, rows: slice) -> RegionRows:
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, rows
        return RegionRows(self.obj, self.at + start * self.row_bytes, self.dtype, (stop - start, *self.shape[1:]))

    def read(self) -> torch.Tensor:
        """The rows as a new tensor."""
        t = torch.empty(self.shape, dtype=self.dtype)
        self.obj.read_into(_memory(t), self.at)
        return t

    def read_into(self, dst: torch.Tensor) -> None:
        """Copy the rows into `dst` (same shape, contiguous), converting to its dtype: straight
        from the object into dst's memory when the dtypes agree, else a chunk of rows at a time
        through a scratch of CONVERT_BYTES (no intermediate of the whole: one of 32 MiB, an fp32
        request of 2048 rows, was a fresh mapping and 8,192 page faults per request)."""
        assert dst.shape == self.shape and dst.is_contiguous(), (dst.shape, self.shape)
        if dst.dtype == self.dtype:
            self.obj.read_into(_memory(dst), self.at)
            return
        for lo, hi, scratch in self._chunks():
            self.obj.read_into(_memory(scratch), self.at + lo * self.row_bytes)
            dst[lo:hi].copy_(scratch)

    def write_from(self, src: torch.Tensor) -> None:
        """Write `src` (same shape) into the region, converted to the region's dtype (a chunk of rows
        at a time, as `read_into`, when it must be converted or is not contiguous)."""
        assert src.shape == self.shape, (src.shape, self.shape)
        if src.dtype == self.dtype and src.is_contiguous():
            self.obj.write(_memory(src), self.at)
            return
        for lo, hi, scratch in self._chunks():
            scratch.copy_(src[lo:hi])
            self.obj.write(_memory(scratch), self.at + lo * self.row_bytes)

    def _chunks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, scratch rows of this dtype for rows lo..hi) over the rows, CONVERT_BYTES at a time."""
        assert len(self.shape) == 2, self.shape  # (rows of hidden_states or of the answer: [T, H])
        n = self.shape[0]
        step = max(1, CONVERT_BYTES // self.row_bytes)
        scratch = torch.empty(min(step, n), *self.shape[1:], dtype=self.dtype)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            yield lo, hi, scratch[:hi - lo]


Rows = torch.Tensor | RegionRows


def copy_rows(dst: torch.Tensor, src: Rows) -> None:
    """dst <- src, a tensor or rows in a region (the batcher's copy in; its copy out writes a
    region under the request's lock, `RegionRows.write_from`)."""
    if isinstance(src, RegionRows):
        src.read_into(dst)
    else:
        dst.copy_(src)


def sent_row(rows: Rows, i: int) -> torch.Tensor:
    """Row i of `rows` as a tensor (read from the region for RegionRows)."""
    return rows[i:i + 1].read()[0] if isinstance(rows, RegionRows) else rows[i]


class Regions:
    """One front-end process's side of the registry: register, unregister, status, and a request's
    tensors in regions."""

    def __init__(self, table: RegionTable):
        self.table = table
        self._objects: dict[str, _Object] = {}
        self._seen = -1  # the table version the descriptors were last pruned at
        self._lock = threading.Lock()

    # ---- the extension's calls -------------------------------------------------------------

    def register(self, name, key, offset, byte_size) -> None:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise InvalidInput(f"a region name must be a string of 1 to {MAX_NAME} characters, got {name!r}")
        path = _key_path(key)
        offset = _count(offset, "offset", 0)
        byte_size = _count(byte_size, "byte_size", 1)
        fd = _open(path, key)
        try:
            st = os.fstat(fd)
            if offset + byte_size > st.st_size:
                raise InvalidInput(f"shared-memory region '{name}': offset {offset} + byte_size {byte_size} runs past "
                                   f"the end of {key} ({st.st_size} bytes)")

            def add(state: _State) -> Region:
                if (st.st_dev, st.st_ino) in state.reserved:
                    raise InvalidInput(f"{key} is this server's own shared memory; it cannot be registered")
                if name in state.regions:
                    raise RegionExists(f"a shared-memory region named '{name}' is registered already; "
                                       f"unregister it first")
                if len(state.regions) >= MAX_REGIONS:
                    raise TooManyRegions(f"{MAX_REGIONS} shared-memory regions are registered, the most this server "
                                         f"keeps; unregister one first")
                state.serial += 1
                region = Region(name, key, offset, byte_size, st.st_dev, st.st_ino, state.serial)
                state.regions[name] = region
                stored.append(state)  # (its version is set once it is stored)
                return region

            stored: list[_State] = []
            region = self.table.update(add)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._objects[name] = _Object(region, fd)
            # A prune of a later version (another front end unregistered the name at once, a
            # decode thread here read that) may have run between the update and this insert: the
            # next prune (a lookup, or keep_pruned within a second) looks at every descriptor again.
            self._seen = min(self._seen, stored[0].version - 1)

    def unregister(self, name: str) -> None:
        """Unregister `name`, or every region when it is empty; a name not registered is no error
        (as Triton's: clients unregister twice). New requests refuse the region at once; one that
        named it before keeps reading and writing its object until it is answered."""
        def remove(state: _State) -> None:
            if name:
                state.regions.pop(name, None)
            else:
                state.regions.clear()

        self.table.update(remove)
        self.refresh()

    def refresh(self) -> None:
        """Drop the descriptors of regions unregistered since (one flock and one 8-byte pread when
        the table has not changed)."""
        self._prune(self.table.state())

    async def keep_pruned(self, period_s: float = PRUNE_PERIOD_S) -> None:
        """`refresh` every `period_s` until cancelled (each front end's loop runs it: a front end
        without traffic would otherwise pin the pages of an unregistered, unlinked object)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                self.refresh()
            except Exception:  # noqa: BLE001  a failed check is retried at the next one; say it
                log.exception("checking the shared-memory registry for unregistered regions failed")

    def status(self, name: str) -> list[dict]:
        """The status of `name`, or of every region when it is empty."""
        regions = self.table.state().regions
        if not name:
            return [r.status() for r in regions.values()]
        if name not in regions:
            raise RegionNotFound(f"no shared-memory region named '{name}' is registered")
        return [regions[name].status()]

    # ---- a request's tensors ---------------------------------------------------------------

    def rows(self, name: str, offset: int, byte_size: int, dtype: torch.dtype, shape: list[int],
             what: str, output: bool = False) -> RegionRows:
        """`what`'s rows of `shape` and `dtype` in region `name` at `offset`: an input's byte size
        must be exactly its shape's, an output's at least that."""
        need = shape[0] * shape[1] * dtype.itemsize if len(shape) == 2 else 0
        if output and byte_size < need:
            raise InvalidInput(f"{what} needs {need} bytes; its shared_memory_byte_size is {byte_size}")
        if not output and byte_size != need:
            raise InvalidInput(f"{what} has shared_memory_byte_size {byte_size}; shape {shape} of its datatype "
                               f"needs {need}")
        state = self.table.state()
        region = state.regions.get(name)
        if region is None:
            raise RegionNotFound(f"{what}: no shared-memory region named '{name}' is registered")
        if offset + byte_size > region.byte_size:
            raise InvalidInput(f"{what}: shared_memory_offset {offset} + byte_size {byte_size} runs past the end "
                               f"of region '{name}' ({region.byte_size} bytes)")
        return RegionRows(self._object(region, state), region.offset + offset, dtype, shape)

    def _object(self, region: Region, state: _State) -> _Object:
        self._prune(state)
        with self._lock:
            obj = self._objects.get(region.name)
            if obj is not None and obj.region.serial == region.serial:
                return obj
        fd = _open(_key_path(region.key), region.key)
        if _identity(fd) in state.reserved:  # (reserved after it was registered: a group started since)
            os.close(fd)
            raise InvalidInput(f"{region.key} is this server's own shared memory; it cannot be used as a region")
        if _identity(fd) != (region.dev, region.ino):
            os.close(fd)
            raise replaced(region)
        obj = _Object(region, fd)
        with self._lock:
            if state.version >= self._seen:  # else pruned past `state` meanwhile: the request's alone
                self._objects[region.name] = obj
        return obj

    def _prune(self, state: _State) -> None:
        """Drop the descriptors of regions no longer registered, or whose object the server has
        since reserved (an in-flight request keeps its own)."""
        with self._lock:
            if state.version <= self._seen:  # (another thread pruned at this version or a later one)
                return
            self._seen = state.version
            for name, obj in list(self._objects.items()):
                now = state.regions.get(name)
                if now is None or now.serial != obj.region.serial or (now.dev, now.ino) in state.reserved:
                    del self._objects[name]


def replaced(region: Region) -> InvalidInput:
    """The error of a region whose key now names another object than the one it was registered with."""
    return InvalidInput(f"shared-memory region '{region.name}': {region.key} is no longer the object that was "
                        f"registered (it was removed or replaced); register the region again")


def enabled(regions: Regions | None) -> Regions:
    """`regions`, or SharedMemoryOff (naming the flag) when the extension is off (None)."""
    if regions is None:
        raise SharedMemoryOff(OFF)
    return regions


# ---- Triton's CUDA shared-memory extension: never a region ---------------------------------
# Clients that clean up both kinds of region (perf_analyzer --shared-memory system unregisters its
# CUDA regions too) get Triton's answers for a server without CUDA shared memory: status is empty,
# unregister succeeds (there is nothing to remove), register is refused. The server metadata does
# not list "cuda_shared_memory".

CUDA_UNSUPPORTED = ("CUDA shared memory is not supported: this server reads no GPU memory of its clients; "
                    "use system shared memory (--shared-memory system)")


def cuda_status(name: str) -> list[dict]:
    """The CUDA regions (`name`'s, or every one): none."""
    if name:
        raise RegionNotFound(f"no CUDA shared-memory region '{name}' is registered ({CUDA_UNSUPPORTED})")
    return []


def cuda_register(name: str) -> typing.NoReturn:
    raise CudaSharedMemoryUnsupported(f"cannot register CUDA shared-memory region '{name}': {CUDA_UNSUPPORTED}")


def _count(value, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidInput(f"'{what}' must be an integer >= {least}{below_2_64(value)}, got {echoed(value)}")
    return value
