"""Collectives among the ranks of one host through shared memory: the serial layer's CPU transport.

Dimension letters: R ranks, C capacity per rank, H hidden, N = R*C tokens of a full step.

On the CPU default (4 rank processes on a few cores) a gloo collective of a few KB takes
milliseconds: each one is a ring of R-1 message hops, and every hop is a hand-off between threads
of two processes (caller -> gloo worker -> socket -> peer's I/O loop -> peer's worker), ~28
context switches per all-gather in one rank at R=4 (bench/cpu_collectives.py; bench/NOTES.md,
issue 11c). Ranks on one host need none of that. Their inputs need no exchange at all: every rank
maps the step's slot (service.worker.shm), so each reads the whole step's rows, ids and weights
where the front end wrote them. Only the partial sums cross ranks: each rank writes its plane of
one scratch region, a barrier says when all are written, and each sums its own rows.

    peers = HostPeers.create(ctx, cfg, timeout_s)   # the group, before it spawns the ranks
    comm = HostComm(peers, cfg, rank)                # each rank: views of the scratch
    comm.partials(seq)  [R, N, H] fp32  plane r: rank r's combine output for every token of step seq
    comm.seqs(seq)      [R] int64       word r: the step rank r ran (written before the barrier)
    comm.barrier()                      returns once every rank has called it as often as this one

The scratch is a multiprocessing RawArray (an unlinked file in /dev/shm, passed to the spawned
ranks as a descriptor: nothing is left behind whatever happens), the wake-ups R multiprocessing
semaphores, one per rank. A rank's barrier posts every peer's semaphore once, then takes R-1 posts
of its own, blocking in the kernel (no spinning: the front end shares the cores). Why that is a
barrier although posts carry no step number: a peer can post for barrier b+1 only after passing
b, which needs every rank's post for b; so while some rank q has not arrived at b, rank p has
received at most (R-2)*b + (b-1) < (R-1)*b posts and cannot pass. A semaphore post orders the
poster's earlier writes before the waiter's later reads.

A step of the serial layer needs one barrier (service.moe.serial): after each rank wrote its
partials plane and seq word; then each sums its own rows over the R planes and checks the R seq
words. Planes and seq words are double-buffered by the step's parity: right after the barrier of
step s a fast rank q may start step s+1 and write its plane while a slow rank p still sums step s,
so step s+1 writes the other buffer; q writes step s's buffer again only in step s+2, after the
barrier of step s+1, which p reaches only once it is done with step s. The slot's rows are read
before the barrier and the front end reuses a slot only after every rank answered.

A barrier waits at most `timeout_s` (the group's collective timeout) and gives up at once if the
group's parent is gone. A rank that dies mid-step leaves its peers waiting here; the group sees
the death (process sentinel), fails the step with WorkerError and kills the rest.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from service.config import LayerConfig, round_up

ALIGN = 64   # bytes; each region starts on a cache line
SLICE_S = 1.0  # a waiting rank wakes this often to check the deadline and its parent


class BarrierTimeout(RuntimeError):
    """A host barrier expired: ranks that did not arrive are named."""


def _layout(cfg: LayerConfig) -> tuple[dict[str, tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Region name -> (byte offset, dtype, shape); and the total size."""
    R, N, H = cfg.R, cfg.tokens_per_step, cfg.H
    regions: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "arrived": (torch.int64, (R,)),                          # [R] barriers each rank entered
        "seqs": (torch.int64, (2, R)),                           # [2, R] by step parity
        "partials": (torch.float32, (2, R, N, H)),               # [2, R, N, H] by step parity
    }
    layout, offset = {}, 0
    for name, (dtype, shape) in regions.items():
        layout[name] = (offset, dtype, shape)
        offset += round_up(torch.Size(shape).numel() * dtype.itemsize, ALIGN)
    return layout, offset


@dataclasses.dataclass(frozen=True)
class HostPeers:
    """What the ranks of one host share: made by the parent before it spawns them, handed to each
    with its start arguments (multiprocessing passes the scratch and the semaphores at spawn)."""

    scratch: object            # multiprocessing RawArray of _layout's size
    sems: tuple                # R multiprocessing semaphores: sems[r] wakes rank r
    timeout_s: float

    @classmethod
    def create(cls, ctx, cfg: LayerConfig, timeout_s: float) -> HostPeers:
        """ctx: the multiprocessing context the ranks are spawned with."""
        _, size = _layout(cfg)
        return cls(scratch=ctx.RawArray("b", size), sems=tuple(ctx.Semaphore(0) for _ in range(cfg.R)),
                   timeout_s=timeout_s)


class HostComm:
    """One rank's views of the shared scratch, and the barrier."""

    def __init__(self, peers: HostPeers, cfg: LayerConfig, rank: int):
        layout, size = _layout(cfg)
        raw = torch.frombuffer(peers.scratch, dtype=torch.uint8)  # [size] the whole region
        assert raw.numel() == size, (raw.numel(), size)
        views = {}
        for name, (offset, dtype, shape) in layout.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            views[name] = raw[offset:offset + nbytes].view(dtype).view(shape)
        self._partials = views["partials"]   # [2, R, N, H] fp32
        self._seqs = views["seqs"]           # [2, R] int64
        self._arrived = views["arrived"]     # [R] int64, for the timeout's message
        self.rank, self.R = rank, cfg.R
        self._sems, self._timeout_s = peers.sems, peers.timeout_s
        self._entered = 0
        self._parent = os.getppid()

    def partials(self, seq: int) -> torch.Tensor:
        """[R, N, H] fp32: every rank's plane of step `seq` (this rank writes plane `rank`)."""
        return self._partials[seq % 2]

    def seqs(self, seq: int) -> torch.Tensor:
        """[R] int64: the step each rank ran, in step `seq`'s buffer (this rank writes word `rank`)."""
        return self._seqs[seq % 2]

    def barrier(self) -> None:
        """Return once every rank has entered its barrier as many times as this one; BarrierTimeout
        after timeout_s (naming the ranks missing), or at once when the parent is gone."""
        self._entered += 1
        self._arrived[self.rank] = self._entered
        for peer, sem in enumerate(self._sems):
            if peer != self.rank:
                sem.release()
        deadline = time.monotonic() + self._timeout_s
        own = self._sems[self.rank]
        for _ in range(self.R - 1):
            while not own.acquire(timeout=max(0.0, min(SLICE_S, deadline - time.monotonic()))):
                if os.getppid() != self._parent:
                    raise BarrierTimeout(f"rank {self.rank}: the rank group's parent is gone")
                if time.monotonic() >= deadline:
                    late = [p for p in range(self.R) if int(self._arrived[p]) < self._entered]
                    raise BarrierTimeout(f"rank {self.rank}: barrier {self._entered}: ranks {late} did not "
                                         f"arrive within {self._timeout_s:g} s")
