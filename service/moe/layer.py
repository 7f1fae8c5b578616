"""The backend contract: what a rank needs from a layer, and the one place that picks a backend.

Dimension letters: C capacity per rank, H hidden, K top-k, n rows of this rank's step (n <= C).

    layer = make_layer(cfg, weights, rank=r, device=dev, backend="auto")
    state = layer.new_state()                     # once per step in flight, reused once its step is done
    x, ids, w = (buf[:n].copy_(rows) ...) for buf in layer.inputs   # or the rows themselves if None
    out = layer.forward(x, ids, w, seq, state=state)  # [n, H] fp32 on the device, valid until the next
                                                  # step; the step's small device state -> state.words (async)
    ... read out; wait for the step (an event recorded after forward) ...
    layer.check_seq(seq, state)                   # raises if the step failed or the ranks disagree
    layer.exposed_comm_s(state)                   # the step's communication not hidden by compute

Without `state` check_seq and exposed_comm_s take a snapshot of the last step themselves and wait
for it (tests, benchmarks: one step at a time). With a state the reads after a step are host reads
of state.words and state.timer alone, so a caller may have enqueued the next step already: the
next forward overwrites the layer's device buffers, never a step's state (service.worker.rank runs
two steps in flight on CUDA that way).

With `host` (CPU ranks of one host, service.moe.hostcomm) every rank passes the whole step's rows
instead, x [T, H], ids [T, K], w [T, K] (the slot's), and gets its own rank_range rows back.

Both backends (service.moe.serial, service.moe.fused) implement `Layer`; the rank uses nothing else.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch

from service.config import LayerConfig
from service.errors import BackendUnavailable
from service.moe.hostcomm import HostPeers
from service.moe.timing import StageTimer
from service.moe.weights import RankWeights

BACKENDS = ("auto", "serial", "fused")


@dataclasses.dataclass
class StepState:
    """What one step leaves to be read after it: its stage timer and the host words its snapshot
    lands in (their dtype and layout are the backend's; pinned on CUDA). One per step in flight.
    `graph`: the backend's own step made for this state (the fused layer's CUDA graph that writes
    this state's words), or None."""

    timer: StageTimer
    words: torch.Tensor
    graph: object | None = None


class HostWords:
    """Control words for the device: `depth` pinned host buffers used in turn, each copied to `dst`
    (int32 [n] on the device) in stream order without blocking. A buffer is rewritten only after its
    previous copy read it, so with up to `depth` steps in flight `send` never waits."""

    def __init__(self, dst: torch.Tensor, depth: int = 2):
        self.dst = dst
        cuda = dst.device.type == "cuda"
        self._host = [torch.zeros(dst.shape, dtype=dst.dtype, pin_memory=cuda) for _ in range(depth)]
        self._np = [h.numpy() for h in self._host]  # written without a torch op per word
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(depth)]
        self._next = 0

    def send(self, words) -> None:
        i = self._next
        self._next = (i + 1) % len(self._host)
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # this buffer's previous copy has read it
        self._np[i][:] = words
        self.dst.copy_(self._host[i], non_blocking=self._copied[i] is not None)
        if self._copied[i] is not None:
            self._copied[i].record()


class Layer(Protocol):
    name: str  # "serial" or "fused": what the service reports as its backend

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [C, H] cfg.dtype, ids [C, K] int32, w [C, K] fp32 on the device, where a step's rows are
        written and whose [:n] views are passed to `forward` (nothing is copied again); None when
        `forward` takes the rows wherever they are."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: int,
                timer: StageTimer | None = None, state: StepState | None = None) -> torch.Tensor:
        """x [n, H], ids [n, K] int32, w [n, K] fp32 -> this rank's output [n, H] fp32 (a view of a
        buffer the next step overwrites). Work may still be running on the device on return.
        With `state` (one of `new_state`'s, per step in flight) the step is timed by state.timer
        (`timer` is not used) and leaves its small device state (error flag, every rank's seq, the
        backend's statistics) in state.words, in stream order: valid once the work enqueued so far
        is done. A state is passed again only once the step that used it is done (its words read).
        Without it, `timer` times the step and check_seq / exposed_comm_s snapshot it themselves."""

    def new_state(self) -> StepState:
        """A fresh StepState for this layer (its timer on the layer's device, its snapshot words)."""

    def check_seq(self, seq: int, state: StepState | None = None) -> None:
        """After the step (its snapshot done): raise if it failed (a bounded wait expired) or if the
        ranks did not all run step `seq` (service.moe.routing.SequenceMismatch). Without `state`:
        from a snapshot of the last step taken now (a sync)."""

    def exposed_comm_s(self, state: StepState | None = None) -> float:
        """The step's exposed communication in seconds (each backend defines how it measures);
        without `state` the last step's, as check_seq."""


def make_layer(cfg: LayerConfig, weights: RankWeights, *, rank: int, device: torch.device,
               backend: str = "auto", log: logging.Logger | None = None,
               host: HostPeers | None = None) -> Layer:
    """The fused layer when asked for (auto/fused) and possible, else the serial one for auto
    (rank 0 logs why: at INFO on the CPU, where serial is the expected path) and BackendUnavailable
    for fused. With R > 1 the probe is collective (every rank calls this) and gives every rank the
    same verdict. `host`: CPU ranks of one host, whose serial layer then communicates through
    shared memory (service.moe.hostcomm) instead of the process group; its `forward` takes the
    whole step's rows (the slot's, every rank the same) and returns this rank's rows of them."""
    from service.moe.serial import SerialLayer

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    log = log or logging.getLogger(__name__)
    if backend != "serial":
        from service.moe.fused import FusedLayer, fused_unavailable_reason

        reason = fused_unavailable_reason(cfg, device)
        if reason is None:
            return FusedLayer(cfg, weights, rank=rank, device=device)
        if backend == "fused":
            raise BackendUnavailable(f"--backend fused cannot run here: {reason}; use --backend auto or serial")
        if rank == 0:
            log.log(logging.INFO if device.type == "cpu" else logging.WARNING,
                    "backend %s: fused unavailable (%s); running serial", backend, reason)
    return SerialLayer(cfg, weights, rank=rank, device=device, host=host)
