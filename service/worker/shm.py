"""Shared-memory batch slots between the front end and the ranks.

A slot is one file in /dev/shm mapped MAP_SHARED by every process (`torch.from_file` with
shared=True): the front end writes request rows into `x`, `ids`, `w`; each rank reads its rows
and writes its output rows into `out`. No tensor is pickled; the control messages carry only
(seq, slot index, T). Plain files rather than `multiprocessing.shared_memory`, whose resource
tracker unlinks segments when a child that attached them exits (Python < 3.13).

The files exist only while the ranks start: once every rank has mapped them the group unlinks
them, so a front end killed later leaves nothing in /dev/shm. Files of a front end killed
during a start are removed by the next start on the host. The group keeps each file's descriptor
until it closes: other front-end processes of the same server (service.fleet) are handed those
descriptors and map the slots through them (`Slot.open(cfg, i, f"/proc/self/fd/{fd}")`).

Instances can share /dev/shm without sharing a PID namespace (containers with `ipc: host`), so
nothing here depends on seeing another process's pid:
- names carry 128 random bits (uuid4), never a pid, so they cannot collide;
- the creating front end holds an exclusive flock on each file for as long as the file exists
  (taken before the name appears: the file is made with O_TMPFILE, locked, then linked in), and
  a file is stale exactly when that lock can be taken;
- the ranks open the files without O_CREAT (`torch.from_file(shared=True)` would create a
  missing file, and a rank computing on memory the front end never sees answers zeros).
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import queue
import tempfile
import uuid

import torch

from service.config import LayerConfig, round_up
from service.errors import ConfigError, GroupUnavailable

ALIGN = 64  # bytes; each field starts on a cache line
PREFIX = "moe-slot-"
ARENA_PREFIX = "moe-arena-"  # a front end's wire arena (service.api.arena), made and swept as the slots are


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _layout(cfg: LayerConfig) -> tuple[dict[str, tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Field name -> (byte offset, dtype, shape); and the total size."""
    N = cfg.tokens_per_step
    fields: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "x": (cfg.dtype, (N, cfg.H)),         # [R*C, H] hidden states in the layer dtype
        "ids": (torch.int32, (N, cfg.K)),     # [R*C, K] expert ids
        "w": (torch.float32, (N, cfg.K)),     # [R*C, K] routing weights
        "out": (cfg.dtype, (N, cfg.H)),       # [R*C, H] layer output
    }
    layout, offset = {}, 0
    for name, (dtype, shape) in fields.items():
        layout[name] = (offset, dtype, shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        offset += round_up(nbytes, ALIGN)
    return layout, offset


@dataclasses.dataclass
class Slot:
    """Views of one shared-memory slot. Write rows [0, T) of x, ids, w; read out[:T]."""

    index: int
    path: str
    x: torch.Tensor    # [R*C, H]
    ids: torch.Tensor  # [R*C, K] int32
    w: torch.Tensor    # [R*C, K] float32
    out: torch.Tensor  # [R*C, H]
    owner_fd: int = -1  # the creator's locked descriptor (front end only); closed by remove_slots

    @classmethod
    def open(cls, cfg: LayerConfig, index: int, path: str) -> Slot:
        """Map an existing slot file (MAP_SHARED). A missing file or one of the wrong size is an
        error: this never creates a file."""
        layout, size = _layout(cfg)
        fd = os.open(path, os.O_RDWR)  # no O_CREAT
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise RuntimeError(f"slot file {path} has {have} bytes, expected {size}")
            raw = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)  # the tensor keeps the map
        finally:
            os.close(fd)
        views = {}
        for name, (offset, dtype, shape) in layout.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            views[name] = raw[offset:offset + nbytes].view(dtype).view(shape)
        return cls(index=index, path=path, x=views["x"], ids=views["ids"], w=views["w"], out=views["out"])


class SlotPool:
    """The free slots of one user of a rank group: get() blocks until one is released."""

    def __init__(self, slots=()):
        self._free: queue.Queue[Slot] = queue.Queue()
        for slot in slots:
            self._free.put(slot)

    def get(self, timeout: float | None = None, alive: bool = True) -> Slot:
        """A free slot (GroupUnavailable past `timeout`, or at once when the group is not `alive`)."""
        if not alive:
            raise GroupUnavailable("the rank group is not running")
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise GroupUnavailable(f"no free slot within {timeout} s") from None

    def put(self, slot: Slot) -> None:
        self._free.put(slot)


def create_locked(directory: str, path: str, size: int) -> int:
    """A new file of `size` bytes at `path`, exclusively flock-ed by the returned descriptor before
    its name appears (so no other instance can ever see it unlocked)."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):  # no O_TMPFILE here: lock right after creating
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, size)
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, size)
        # linkat(AT_SYMLINK_FOLLOW) gives the locked inode its name. A dir fd makes os.link call
        # linkat; without one it calls link(), which does not follow /proc/self/fd/N.
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=dir_fd, follow_symlinks=True)
        finally:
            os.close(dir_fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_room(cfg: LayerConfig, count: int) -> None:
    """ConfigError when `count` slots of `cfg` (every front end's) are larger than the filesystem they
    live in (/dev/shm): the files are sparse, so they would be made, and the first steps that fill them
    would die of SIGBUS; a --capacity typo (1e8) had the owner's warm-up allocate a step's rows in RAM
    until the host ran out (16 GB in a minute), never exiting."""
    _, size = _layout(cfg)
    fs = os.statvfs(shm_dir())
    room = fs.f_blocks * fs.f_frsize
    if count * size > room:
        raise ConfigError(f"{count} batch slots of {size / 2**30:.3g} GiB (R*C = {cfg.tokens_per_step} tokens per "
                          f"step, H = {cfg.H}) need {count * size / 2**30:.3g} GiB of {shm_dir()}, which holds "
                          f"{room / 2**30:.3g} GiB: lower capacity, world_size, slots or frontends, or give "
                          f"{shm_dir()} more room")


def create_slots(cfg: LayerConfig, count: int) -> list[Slot]:
    """Create `count` slot files sized for one full step, locked by this process, and map them."""
    _, size = _layout(cfg)
    directory = shm_dir()
    slots = []
    for i in range(count):
        path = os.path.join(directory, f"{PREFIX}{uuid.uuid4().hex}-{i}")
        fd = create_locked(directory, path, size)
        slot = Slot.open(cfg, i, path)
        slot.owner_fd = fd
        slots.append(slot)
    return slots


def remove_stale_slots() -> None:
    """Remove slot files and wire arenas whose creator is gone: those nobody holds the lock of."""
    directory = shm_dir()
    for name in os.listdir(directory):
        if not name.startswith((PREFIX, ARENA_PREFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone already, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its creator is alive, whatever PID namespace it runs in
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)


def unlink_slots(slots: list[Slot]) -> None:
    """Unlink the slots' files; their descriptors (and locks) stay open, the mappings valid."""
    for slot in slots:
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass


def remove_slots(slots: list[Slot]) -> None:
    """Unlink the slots' files, then drop their locks (the mappings stay valid)."""
    unlink_slots(slots)
    for slot in slots:
        if slot.owner_fd >= 0:
            os.close(slot.owner_fd)
            slot.owner_fd = -1
