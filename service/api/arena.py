"""The wire arena: request bodies received into shared memory that the ranks read, answers written by
the ranks where the response is sent from (`--wire-arena-mib`, Settings.wire_arena_mib).

T tokens, H hidden.

Over the wire a v2 binary request's hidden_states arrive in its body and its answer leaves in the
response's. Without the arena the front end receives the body into its own memory, copies the rows
into the step's slot (and checks them there), and copies the answer out of the slot into the
response: two host copies of T x H per request (on one H200 host, T=512 bf16: ~1.6 + ~1.2 ms of a
request's ~10 ms). With it, such a body is received (recv_into, service.api.connections.DirectBody)
into a block of this front end's arena, and the answer is given a block of its own: both are rows
the ranks can open, so the batcher hands them to the ranks as a *source* exactly as it does a
client's shared-memory regions with --shm-direct (service.api.batcher, service.worker.direct): each
rank reads its rows from the body's block (CUDA: DMA from its page-locked mapping of the arena;
the rows checked on the device, a bad one named in the request's 400) and writes its answer's rows
into the answer's block, which the response then sends as it is (a view). The front end copies
neither way.

The arena is one POSIX shared-memory object, `/dev/shm/moe-arena-<uuid4 hex>`, made by the front end
as the slots are (service.worker.shm: created locked, so a file whose lock can be taken is a dead
front end's and is removed at the next group start, or when the fleet sees it die) and mapped once.
It stays named while the front end lives, since the ranks open it by that name when a source first
names it (a restarted group's too); `OWN_PREFIX` keeps clients from ever naming it, and with system
shared memory on its identity is also reserved in the region table. Every page is written once when
it is made, before any rank maps it: a page's first write fault would move the object's ctime, and a
rank takes a moved ctime for a changed object and registers its mapping again
(service.worker.direct, "stale pages"). A rank maps and page-locks the whole arena as one region the
first time a source names it, and keeps it while the arena's name exists (not let go when idle:
registering 256 MiB again costs tens of ms).

Blocks are handed out first fit from the free extents, rounded to PAGE bytes, and an offset `lead`
into a block can be aligned to ALIGN (a body's binary part, after its JSON header, so that its rows
start on a cache line). A block is freed when nothing refers to its memory any more: its views come
from one ctypes array per block, and `weakref.finalize` on that array returns the block to the free
list. The decoded tensors, the batcher's job (held by its step's thread while the ranks read and
write it), the response's parts and asyncio's transport buffer (Python 3.12 keeps a view of what
the socket did not take yet instead of copying it) all hold a reference, so a block is never handed
out again while anything may still read or write it. A finalizer may run in any thread, inside
another allocation even (a collection), so it only appends to a queue; allocations, under a lock,
take those frees first. What does not fit (a body larger than the free extents) takes the copy
path as before, counted in moe_wire_arena_full_total.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import logging
import mmap
import os
import threading
import uuid
import weakref

import torch

from service.api import arena_objects
from service.config import round_up
from service.worker.direct import SHM_ROOT
from service.worker.shm import ALIGN, ARENA_PREFIX, create_locked

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE  # blocks are whole pages (a block's `lead` byte is placed on an ALIGN boundary)
MIB = 1 << 20
OBJECTS_SHARE = 0.5  # of an arena, for its front end's large Python objects with --wire-arena-grpc

# Where a tensor's rows lie for a rank: the arena's key, its identity, the rows' first byte, and the
# region a rank maps (the whole arena) -- service.worker.direct.Source's fields for one side.
Place = tuple[str, tuple[int, int], int, tuple[int, int]]


class WireArena:
    """One front end's arena of `size` bytes (see the module docstring)."""

    def __init__(self, size: int):
        if size <= 0 or size % PAGE:
            raise ValueError(f"an arena is a positive number of {PAGE}-byte pages, got {size} bytes")
        name = f"{ARENA_PREFIX}{uuid.uuid4().hex}"
        self.path = os.path.join(SHM_ROOT, name)
        self.key = "/" + name
        self.size = size
        self.fd = create_locked(SHM_ROOT, self.path, size)  # held (and its lock) until close()
        try:
            st = os.fstat(self.fd)
            self.identity = (st.st_dev, st.st_ino)
            # Reserve every page first: a full /dev/shm (a container's 64 MiB default) is then ENOSPC here,
            # an OSError `make_arena` reports, instead of a SIGBUS at the first write through the mapping.
            os.posix_fallocate(self.fd, 0, size)
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # Every page written once, now, before any rank maps the arena (the module docstring).
            zeros = bytes(MIB)
            for at in range(0, size, MIB):
                n = min(MIB, size - at)
                self._mm[at:at + n] = zeros[:n]
            # Where the arena's bytes lie in this process: (address, file offset, length) windows, this
            # mapping's first; adopt_objects adds the objects' window (mapped by its C library).
            self._windows = [(ctypes.addressof(ctypes.c_char.from_buffer(self._mm)), 0, size)]
        except BaseException:
            self.close()
            raise
        self._free: list[tuple[int, int]] = [(0, size)]  # (start, length) extents, by start
        self._freed: collections.deque[tuple[int, int]] = collections.deque()  # from finalizers
        self._lock = threading.Lock()
        self._used = 0  # bytes in blocks handed out, the finalizers' queue not yet taken

    # ---- blocks ------------------------------------------------------------------------------

    def buffer(self, n: int, lead: int = 0) -> memoryview | None:
        """n writable bytes of the arena whose byte `lead` lies on an ALIGN boundary, or None when no
        free extent holds them. Freed once no view of them is left."""
        if n <= 0:
            return None
        pad = (-lead) % ALIGN
        length = round_up(pad + n, PAGE)
        with self._lock:
            self._take_freed()
            i = next((i for i, (_, free) in enumerate(self._free) if free >= length), None)
            if i is None:
                return None
            start, free = self._free[i]
            if free == length:
                del self._free[i]
            else:
                self._free[i] = (start + length, free - length)
            self._used += length
        block = (ctypes.c_char * n).from_buffer(self._mm, start + pad)
        weakref.finalize(block, self._freed.append, (start, length))
        return memoryview(block).cast("B")

    def rows(self, T: int, H: int, dtype: torch.dtype) -> torch.Tensor | None:
        """An answer's rows [T, H] of `dtype` in a block of their own (None when they do not fit)."""
        view = self.buffer(T * H * dtype.itemsize)
        if view is None:
            return None
        return torch.frombuffer(view, dtype=dtype).view(T, H)  # the tensor keeps the view, and so the block

    def place(self, t: torch.Tensor) -> Place | None:
        """Where the contiguous CPU tensor `t` lies for a rank, if its memory is in the arena."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        first, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for address, offset, length in self._windows:
            if address <= first and first + nbytes <= address + length:
                return self.key, self.identity, offset + first - address, (0, self.size)
        return None

    def adopt_objects(self, share: float = OBJECTS_SHARE, min_bytes: int = arena_objects.MIN_BYTES) -> None:
        """Give the arena's last `share` (whole pages) to this process's large Python objects (the gRPC
        messages among them: service.api.arena_objects), the blocks keeping the rest. Before any block
        is handed out and before any rank maps the arena (its C library writes each page of its window
        once); once per process. OSError, logged by the caller, when it cannot be (the arena is then
        unchanged)."""
        length = int(self.size * share) // PAGE * PAGE
        with self._lock:
            if self._used or self._free != [(0, self.size)] or len(self._windows) > 1:
                raise RuntimeError("adopt_objects is for a fresh arena")
            start = self.size - length
            address = arena_objects.install(self.fd, start, length, min_bytes)
            self._windows.append((address, start, length))
            self._free = [(0, start)]

    def objects_bytes(self) -> int:
        """Bytes of the arena given to large Python objects (adopt_objects; 0 before or without it)."""
        return sum(length for _, _, length in self._windows[1:])

    def _take_freed(self) -> None:
        """Return the blocks finalizers freed to the free extents, merging neighbours (under the lock)."""
        while self._freed:
            start, length = self._freed.popleft()
            self._used -= length
            i = bisect.bisect(self._free, (start, length))
            if i < len(self._free) and start + length == self._free[i][0]:  # the extent after it
                length += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # the extent before it
                start, length = self._free[i - 1][0], self._free[i - 1][1] + length
                self._free[i - 1] = (start, length)
            else:
                self._free.insert(i, (start, length))

    def in_use(self) -> int:
        """Bytes in blocks some view still holds (frees taken first)."""
        with self._lock:
            self._take_freed()
            return self._used

    # ---- life --------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the arena's name and drop its lock (the mapping stays valid while views are left:
        blocks still in flight keep their memory; the pages go when the last view and mapping do)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def adopt_objects(arena: WireArena) -> bool:
    """The arena's second half for this process's large Python objects (gRPC messages: `--wire-arena-grpc`,
    service.api.arena_objects); False, logged, when that cannot be (the whole arena then serves v2 binary
    bodies, and gRPC requests take the front end's copies)."""
    try:
        arena.adopt_objects()
    except Exception as err:  # noqa: BLE001  (a compiler that hangs, no home for the cache: the arena serves v2)
        log.warning("gRPC messages cannot be placed in the wire arena (%s): gRPC requests take the front end's "
                    "copies", err)
        return False
    log.info("wire arena: its last %d MiB hold gRPC messages and their responses (objects of %d KiB or more "
             "made on the event loop)", arena.objects_bytes() // MIB, arena_objects.MIN_BYTES >> 10)
    return True


def make_arena(mib: int) -> WireArena | None:
    """This front end's arena of `mib` MiB, or None (logged) when it is off (0) or cannot be made: the
    copies then serve every request, as without the arena."""
    if mib <= 0:
        return None
    try:
        arena = WireArena(mib * MIB)
    except OSError as err:
        log.warning("the wire arena (%d MiB in %s) could not be made (%s): v2 binary bodies take the front "
                    "end's copies", mib, SHM_ROOT, err.strerror or err)
        return None
    log.info("wire arena: %d MiB at %s (v2 binary bodies received there; the ranks read their rows and "
             "write the answer there)", mib, arena.path)
    return arena
