"""The fused backend's memory: one rank's symmetric region (its byte layout) and the buffers every
step reuses, allocated once at capacity, and the kernels' argument structure built from them.

Dimension letters: R ranks, C capacity per rank, N = R*C global tokens, K top-k, H hidden,
Ir = I / R, E experts, S gathered rows, NB = S / BM row blocks, L = META + 2*C*K.

The region (service/kernels/fused_kernels.py says who reads and writes each part):
    tokens [2, C, H], pulled [N, H] (layer dtype), routing [2, L] int32, staging [R, C, H] fp32,
    wm [R] int32, bar [R] int32; parts start ALIGN bytes apart.
"""

from __future__ import annotations

import dataclasses

import torch

from service.config import BM, LayerConfig, round_up
from service.kernels.fused_kernels import StepArgs
from service.moe import routing

ALIGN = 256  # bytes between the parts of a region
# Word offsets in RankBuffers.state: stats [4] int64 at 0, the error flag, every rank's seq words
# (8-byte aligned: a view of them as int64 is possible).
STATE_ERROR = 8
STATE_SEQS = 10


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte layout of one rank's symmetric region."""

    R: int
    C: int
    H: int
    K: int
    itemsize: int

    @property
    def L(self) -> int:
        return routing.block_len(self.C, self.K)

    # Byte offsets of the fields, in region order: tokens (first), pulled tokens, routing,
    # staging planes, watermarks, barrier slots.
    @property
    def tok_bytes(self) -> int:
        return 0

    @property
    def pull_bytes(self) -> int:
        return round_up(self.tok_bytes + 2 * self.C * self.H * self.itemsize, ALIGN)

    @property
    def rt_bytes(self) -> int:
        return round_up(self.pull_bytes + self.R * self.C * self.H * self.itemsize, ALIGN)

    @property
    def stage_bytes(self) -> int:
        return round_up(self.rt_bytes + 2 * self.L * 4, ALIGN)

    @property
    def wm_bytes(self) -> int:
        return round_up(self.stage_bytes + self.R * self.C * self.H * 4, ALIGN)

    @property
    def bar_bytes(self) -> int:
        return round_up(self.wm_bytes + self.R * 4, ALIGN)

    @property
    def nbytes(self) -> int:
        return round_up(self.bar_bytes + self.R * 4, ALIGN)


class RankBuffers:
    """Everything one rank's steps touch, allocated once at capacity.

    `region` is this rank's symmetric buffer (uint8 [nbytes]); `addresses` the base address of
    every rank's region as mapped in this process, kept as `region_off [R] int64`, each region's
    distance from ours in 16-byte units (what the kernels take). The views below are ours.
    """

    def __init__(self, cfg: LayerConfig, rank: int, region: torch.Tensor, addresses: list[int]):
        R, C, H, K, S = cfg.R, cfg.C, cfg.H, cfg.K, cfg.S
        dev = region.device
        self.cfg, self.rank = cfg, rank
        self.lay = lay = Layout(R, C, H, K, cfg.dtype.itemsize)
        assert region.dtype == torch.uint8 and region.numel() >= lay.nbytes
        assert len(addresses) == R and addresses[rank] == region.data_ptr()
        bad = [a for a in addresses if a % 16]
        assert not bad, f"symmetric regions must be 16-byte aligned, got {[hex(a) for a in bad]}"
        self.region = region
        self.region_off = torch.tensor([(a - addresses[rank]) // 16 for a in addresses], dtype=torch.int64, device=dev)
        L = lay.L
        self.tokens = region[:lay.pull_bytes].view(cfg.dtype)[:2 * C * H].view(2, C, H)      # [2, C, H]
        self.pulled = region[lay.pull_bytes:lay.rt_bytes].view(cfg.dtype)[:R * C * H].view(R * C, H)  # [N, H]
        self.routing = region[lay.rt_bytes:lay.rt_bytes + 2 * L * 4].view(torch.int32).view(2, L)  # [2, L]
        self.staging = region[lay.stage_bytes:lay.stage_bytes + R * C * H * 4].view(torch.float32).view(R, C, H)
        self.wm = region[lay.wm_bytes:lay.wm_bytes + R * 4].view(torch.int32)                # [R]
        self.bar = region[lay.bar_bytes:lay.bar_bytes + R * 4].view(torch.int32)             # [R]
        z = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        # This step's inputs, written by the caller (the rank copies its slot rows straight in)
        # and staged into the parity buffers inside the graph.
        self.x_in = z(C, H, dtype=cfg.dtype)           # [C, H]
        self.ids_in = z(C, K)                          # [C, K] int32
        self.w_in = z(C, K, dtype=torch.float32)       # [C, K]
        self.routing_g = z(R, L)                       # [R, L] every rank's routing block
        self.act = z(S, cfg.Ir, dtype=cfg.dtype)       # [S, Ir]
        self.D = z(S, H, dtype=cfg.dtype)              # [S, H]
        self.out = z(C, H, dtype=torch.float32)        # [C, H]
        self.arrived = z(R * C + 1)                    # [N + 1] pulled-token arrivals (kernel 1); [N] a dummy
        self.tiles = z(S // BM)                        # [NB] finished GEMM2 tiles (kernel 2)
        self.disp = z(3)                               # job dispenser, kernel 1's and kernel 2's tile queues
        self.pushed = z(R)                             # jobs pushed per owner this step
        self.ctl = z(4)                                # seq, n, batch seq low, batch seq high
        # The step's small state in one buffer, so that one copy takes it to the host after a step
        # (FusedLayer.snapshot): stats, the error flag, every rank's batch seq words.
        self.state = z(STATE_SEQS + 2 * R)             # [STATE_SEQS + 2R] int32
        self.stats = self.state[:STATE_ERROR].view(torch.int64)  # [4] int64 ns, see fused_kernels
        self.error = self.state[STATE_ERROR:STATE_ERROR + 1]     # [1]
        self.seqs = self.state[STATE_SEQS:].view(R, 2)           # [R, 2] routing_g[:, 1:3], copied in the step

    def args(self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
             b2: torch.Tensor | None = None) -> StepArgs:
        """The kernels' argument structure over these buffers and this rank's weights
        (w13 [E, H, 2*Ir], w2 [E, Ir, H], biases b13 [E, 2*Ir], b2 [E, H] or None)."""
        cfg, lay = self.cfg, self.lay
        item = cfg.dtype.itemsize
        return StepArgs(
            rank=self.rank, R=cfg.R, C=cfg.C, H=cfg.H, K=cfg.K, E=cfg.E, Ir=cfg.Ir, L=lay.L,
            region=self.region, region_off=self.region_off,
            # Element offsets of the parts inside any rank's region, in the type read there.
            tok_off=lay.tok_bytes // item, pull_off=lay.pull_bytes // item, rt_off=lay.rt_bytes // 4,
            stage_off=lay.stage_bytes // 4, wm_off=lay.wm_bytes // 4, bar_off=lay.bar_bytes // 4,
            x_in=self.x_in, ids_in=self.ids_in, w_in=self.w_in, pulled=self.pulled, staging=self.staging, wm=self.wm,
            routing_g=self.routing_g, act=self.act, D=self.D, out=self.out, arrived=self.arrived, tiles=self.tiles,
            disp=self.disp, pushed=self.pushed, ctl=self.ctl, error=self.error, stats=self.stats,
            w13=w13, w2=w2, b13=b13, b2=b2, activation=cfg.act)

    def take_inputs(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Make x_in[:n], ids_in[:n], w_in[:n] this step's inputs: nothing to do for a tensor that
        is already a view of them (the rank writes there), else one copy each."""
        n = x.shape[0]
        for buf, src in ((self.x_in, x), (self.ids_in, ids), (self.w_in, w)):
            if src.data_ptr() != buf.data_ptr():
                buf[:n].copy_(src)

    def routing_views(self):
        """counts [R], ids_g [R*C, K], w_g [R*C, K] fp32 views of routing_g."""
        return routing.unpack(self.routing_g, self.cfg.C, self.cfg.K)
