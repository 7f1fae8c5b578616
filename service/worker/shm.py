"""Shared-memory batch slots between the front end and the ranks.

A slot is one file in /dev/shm mapped MAP_SHARED by every process (`torch.from_file` with
shared=True): the front end writes request rows into `x`, `ids`, `w`; each rank reads its rows
and writes its output rows into `out`. No tensor is pickled; the control messages carry only
(seq, slot index, T). Plain files rather than `multiprocessing.shared_memory`, whose resource
tracker unlinks segments when a child that attached them exits (Python < 3.13).

The files exist only while the ranks start: once every rank has mapped them the group unlinks
them, so a front end killed later leaves nothing in /dev/shm. Files of a front end killed
during a start are removed by the next start on the host (their pid is gone).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid

import torch

from service.config import LayerConfig

ALIGN = 64  # bytes; each field starts on a cache line


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _layout(cfg: LayerConfig) -> tuple[dict[str, tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Field name -> (byte offset, dtype, shape); and the total size."""
    N = cfg.tokens_per_step
    fields = {
        "x": (cfg.dtype, (N, cfg.H)),         # [R*C, H] hidden states in the layer dtype
        "ids": (torch.int32, (N, cfg.K)),     # [R*C, K] expert ids
        "w": (torch.float32, (N, cfg.K)),     # [R*C, K] routing weights
        "out": (cfg.dtype, (N, cfg.H)),       # [R*C, H] layer output
    }
    layout, offset = {}, 0
    for name, (dtype, shape) in fields.items():
        layout[name] = (offset, dtype, shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        offset += -(-nbytes // ALIGN) * ALIGN
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

    @classmethod
    def open(cls, cfg: LayerConfig, index: int, path: str) -> "Slot":
        layout, size = _layout(cfg)
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        views = {}
        for name, (offset, dtype, shape) in layout.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            views[name] = raw[offset:offset + nbytes].view(dtype).view(shape)
        return cls(index=index, path=path, **views)


def create_slots(cfg: LayerConfig, count: int) -> list[Slot]:
    """Create `count` slot files sized for one full step and map them."""
    _, size = _layout(cfg)
    slots = []
    for i in range(count):
        path = os.path.join(_shm_dir(), f"moe-slot-{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        slots.append(Slot.open(cfg, i, path))
    return slots


def remove_stale_slots() -> None:
    """Remove slot files left by front ends that died before their ranks were up (pid gone)."""
    directory = _shm_dir()
    for name in os.listdir(directory):
        if not name.startswith("moe-slot-"):
            continue
        try:
            pid = int(name.split("-")[2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
        except PermissionError:
            pass  # another user's live process


def remove_slots(slots: list[Slot]) -> None:
    for slot in slots:
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass
