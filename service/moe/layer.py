"""The backend contract: what a rank needs from a layer, and the one place that picks a backend.

Dimension letters: C capacity per rank, H hidden, K top-k, n rows of this rank's step (n <= C).

    layer = make_layer(cfg, weights, rank=r, device=dev, backend="auto")
    x, ids, w = (buf[:n].copy_(rows) ...) for buf in layer.inputs   # or the rows themselves if None
    out = layer.forward(x, ids, w, seq, timer)   # [n, H] fp32 on the device, valid until the next step
    ... read out ...
    layer.check_seq(seq)                          # raises if the step failed or the ranks disagree
    layer.exposed_comm_s()                        # the step's communication not hidden by compute

With `host` (CPU ranks of one host, service.moe.hostcomm) every rank passes the whole step's rows
instead, x [T, H], ids [T, K], w [T, K] (the slot's), and gets its own rank_range rows back.

Both backends (service.moe.serial, service.moe.fused) implement `Layer`; the rank uses nothing else.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from service.config import LayerConfig
from service.errors import BackendUnavailable
from service.moe.hostcomm import HostPeers
from service.moe.timing import StageTimer
from service.moe.weights import RankWeights

BACKENDS = ("auto", "serial", "fused")


class Layer(Protocol):
    name: str  # "serial" or "fused": what the service reports as its backend

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [C, H] cfg.dtype, ids [C, K] int32, w [C, K] fp32 on the device, where a step's rows are
        written and whose [:n] views are passed to `forward` (nothing is copied again); None when
        `forward` takes the rows wherever they are."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: int,
                timer: StageTimer | None = None) -> torch.Tensor:
        """x [n, H], ids [n, K] int32, w [n, K] fp32 -> this rank's output [n, H] fp32 (a view of a
        buffer the next step overwrites). Work may still be running on the device on return."""

    def check_seq(self, seq: int) -> None:
        """After the output was read: raise if the step failed (a bounded wait expired) or if the
        ranks did not all run step `seq` (service.moe.routing.SequenceMismatch)."""

    def exposed_comm_s(self) -> float:
        """The last step's exposed communication in seconds (each backend defines how it measures)."""


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
