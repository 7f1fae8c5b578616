"""The serial backend: the MoE layer as collectives and grouped GEMMs, one after the other.

Rank r holds x_r [n_r, H], ids_r / w_r [n_r, K] (n_r <= C) and its tensor-parallel slice of
every expert, W13 [E, H, 2*Ir] (gate columns, then up columns) and W2 [E, Ir, H]. One step:

    1. all-gather routing (n_r, seq, ids, weights)       -> ids_g, w_g [R*C, K]
    2. schedule tables (service.moe.tables)              -> slots, offsets, ...
       (the per-expert loop: the real hits alone, by expert, grouped.pack_hits)
    3. all-gather tokens                                  -> x_g [R*C, H]
    4. grouped GEMM1, SwiGLU, grouped GEMM2               -> D [S, H] (the loop: D [M, H], M hits)
       (row s of GEMM1's input is x_g[row_token[s]]: the Triton GEMM gathers the rows as it
       loads them; the torch path first copies them into A [S, H], stage "scatter")
    5. top-k combine in fp32: partial[g] = sum_k w_g[g,k] * D[slots[g,k]]   [R*C, H]
    6. reduce-scatter over ranks (sum of the Ir slices)   -> out_r [n_r, H]

It runs on gloo or shared memory (CPU) and NCCL (GPU) and is the baseline the fused backend is
measured against, and its fallback.

CPU ranks on one host (the CPU default) pass `host` (service.moe.hostcomm) and then run another
step (`_host_step`): `forward` takes the whole step's rows, x [T, H], ids and w [T, K] (the slot's,
which every rank maps: the same on every rank) and returns this rank's rows
`routing.rank_range(T, R, rank)`. Nothing is gathered: the tables treat the step as one block of
T real tokens (stage "all_gather" is copying its ids and weights), GEMM1 reads the tokens where
they lie, the combine writes this rank's plane of the shared partials, and one barrier later
each rank sums its own rows over the R planes (stage "reduce_scatter").

The step reads no host value: the rows come through `inputs` (x_in, ids_in, w_in) and the
routing block's META words through `ctl`, one copy from pinned memory, so on a GPU (R = 1 or
NCCL) the whole step is CUDA-graph capturable; `graph=True` captures it once and `forward`
replays it (the benchmarks time both backends that way; the service runs it eagerly, with
per-stage times).

Exposed communication of this backend (`exposed_comm_s()`, reported in `StepStats.exposed_comm_s`)
is the time spent in the collectives (stages `all_gather` and `reduce_scatter`): nothing overlaps them.

Gloo (without `host`) has no reduce-scatter; there the step all-reduces the partials and keeps its
own rows (R times the traffic of a reduce-scatter, on the CPU path only). On gloo the token
all-gather and that all-reduce move only the first m = max(n_r) rows of every rank's block (the
counts are on the host after the routing all-gather; the rows past n_r are padding), and on gloo
and the CPU the portable combine computes only those rows: a step's traffic and combine follow its
tokens. NCCL moves whole blocks (reading m would sync the device).

Kernels, chosen once per rank and logged (`GEMMS`, `build_tables` below):
- GEMMs: on CUDA with bf16/fp16 the Triton grouped GEMM of service.kernels.grouped_gemm
  (SwiGLU fused into GEMM1; measured 1.18-1.23x `torch._grouped_mm` for GEMM1+SwiGLU and
  1.05-1.11x for GEMM2 at the seed shape on an H200, bench/RESULTS.md); GEMM1 on the Hopper
  CUDA tile (service.kernels.cuda_tile) when its tile config says cuda_tile (off by default); elsewhere
  service.moe.grouped (`torch._grouped_mm` where it runs, a per-expert loop otherwise).
- Tables: the one-launch CUDA op of csrc/ where it is built, the torch builder otherwise.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.distributed as dist

from service.config import BM, META, LayerConfig
from service.moe import routing
from service.moe import tables as torch_tables
from service.moe.grouped import (
    PackedHits,
    grouped_mm,
    grouped_mm_host,
    native_grouped_mm_reason,
    pack_hits,
    prepare_weight,
)
from service.moe.hostcomm import HostComm, HostPeers
from service.moe.layer import HostWords, StepState
from service.moe.timing import StageTimer
from service.moe.weights import RankWeights

log = logging.getLogger(__name__)

COLLECTIVE_STAGES = ("all_gather", "reduce_scatter")
SequenceMismatch = routing.SequenceMismatch  # where callers have looked for it
_NO_TIMER = types.SimpleNamespace(mark=lambda stage: None)  # stands in for a StageTimer while capturing


def triton_gemms_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Triton grouped GEMM serves this device and dtype, else why not."""
    if device.type != "cuda":
        return f"device {device.type} is not CUDA"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} is not bf16/fp16"
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not importable ({err})"
    return None


class GroupedGemms:
    """GEMM1 + SwiGLU and GEMM2 over the gathered layout (the per-expert loop: over the packed
    hits), one implementation per rank."""

    def __init__(self, cfg: LayerConfig, weights: RankWeights, device: torch.device, impl: str = "auto"):
        reason = triton_gemms_reason(device, cfg.dtype)
        if impl == "triton" and reason:
            raise RuntimeError(f"gemm=triton is not possible: {reason}")
        self.impl = "triton" if impl in ("auto", "triton") and reason is None else "torch"
        log.info("grouped GEMMs: %s (%s)", self.impl, "Triton kernel available" if self.impl == "triton"
                 else reason or "asked for")
        if self.impl == "triton":
            from service.kernels.tuning import lookup_for_device

            self.w13 = weights.w13.to(device, cfg.dtype).contiguous()  # [E, H, 2*Ir] in the layer dtype, as fused
            self.w2 = weights.w2.to(device, cfg.dtype).contiguous()    # [E, Ir, H]
            self.configs = [lookup_for_device(device, mode, cfg.E, cfg.H, cfg.Ir) for mode in ("gemm1", "gemm2")]
            if self.configs[0].cuda_tile:  # the opt-in Hopper GEMM1: refused here, at start, where it cannot run
                from service.kernels.cuda_tile import device_reason, layer_reason

                reason = layer_reason(cfg.dtype, cfg.act, weights.b13, cfg.H, cfg.Ir) or device_reason(device)
                if reason:
                    raise RuntimeError(f"the GEMM1 config asks for the CUDA tile (cuda_tile): {reason}")
                log.info("GEMM1: the sm_90a CUDA tile (service.kernels.cuda_tile)")
            self.h = torch.empty(cfg.S, cfg.Ir, dtype=cfg.dtype, device=device)  # [S, Ir] activations
            self.d = torch.empty(cfg.S, cfg.H, dtype=cfg.dtype, device=device)    # [S, H]
            from service.kernels.grouped_gemm import queue_counter

            self.queue = queue_counter(device)  # both GEMMs' tile queue, rewound by each launch's last program
        # The per-expert loop computes the hits alone (PackedHits), the others the padded layout (Tables).
        self.loop = self.impl == "torch" and native_grouped_mm_reason(device, cfg.dtype) is not None
        if self.impl == "torch":
            self.w13 = prepare_weight(weights.w13.to(device, cfg.dtype))  # [E, H, 2*Ir]
            self.w2 = prepare_weight(weights.w2.to(device, cfg.dtype))    # [E, Ir, H]
            if not self.loop:
                self.A = torch.zeros(cfg.S, cfg.H, dtype=cfg.dtype, device=device)  # [S, H] gathered layout
            else:  # the packed hits, at most R*C*K (reused: a fresh 2 MB block costs its page faults every step)
                hits = cfg.R * cfg.C * cfg.K
                self.A = torch.zeros(hits, cfg.H, dtype=cfg.dtype, device=device)       # [N, H] tokens
                self.h = torch.zeros(hits, 2 * cfg.Ir, dtype=cfg.dtype, device=device)  # [N, 2*Ir]
                self.d = torch.zeros(hits, cfg.H, dtype=cfg.dtype, device=device)       # [N, H]
        self.act = cfg.act
        self.b13 = None if weights.b13 is None else weights.b13.to(device, cfg.dtype)  # [E, 2*Ir]
        self.b2 = None if weights.b2 is None else weights.b2.to(device, cfg.dtype)    # [E, H] (rank 0)

    def schedule(self, ids: torch.Tensor, counts: torch.Tensor, E: int, C: int,
                 S: int) -> torch_tables.Tables | PackedHits:
        """The step's schedule from its routing (ids [R*C, K], counts [R]): the padded layout's
        tables (`build_tables`), or for the per-expert loop the hits alone (`pack_hits`)."""
        return pack_hits(ids, counts, E, C) if self.loop else build_tables(ids, counts, E, C, S)

    def __call__(self, x_g: torch.Tensor, tables, timer: StageTimer) -> tuple[torch.Tensor, torch.Tensor]:
        """Global tokens x_g [R*C, H] and the step's `schedule` -> (D, slots): D's rows hold the
        hits' expert outputs and slots [R*C, K] (int32, or int64 from the loop) addresses them (-1
        for padding tokens).
        Marks the stages scatter and swiglu (torch only), gemm1 and gemm2. Triton and the native
        grouped GEMM compute over the gathered layout (D [S, H], tables.slots); the Triton GEMM1
        reads each row's token through row_token, the native path first copies the tokens into the
        layout. The per-expert loop computes the hits alone, packed (D [M, H], PackedHits.slots)."""
        Ir = self.w2.shape[1]
        if self.impl == "triton":
            from service.kernels.grouped_gemm import gemm1_swiglu, gemm2

            gemm1_swiglu(x_g, self.w13, tables.block_expert, config=self.configs[0], out=self.h,
                         row_token=tables.row_token, act=self.act, bias=self.b13, expert_offsets=tables.expert_offsets,
                         queue=self.queue)
            timer.mark("gemm1")
            gemm2(self.h, self.w2, tables.block_expert, config=self.configs[1], out=self.d, bias=self.b2,
                  row_token=tables.row_token, expert_offsets=tables.expert_offsets, queue=self.queue)
            timer.mark("gemm2")
            return self.d, tables.slots
        if self.loop:
            return self._packed(x_g, tables, timer)
        A = torch.index_select(x_g, 0, tables.row_token.clamp(min=0), out=self.A)  # [S, H]
        timer.mark("scatter")
        h = grouped_mm(A, self.w13, tables.expert_offsets)        # [S, 2*Ir] one launch over whole ranges
        if self.b13 is not None or self.b2 is not None:
            # Expert of every row (blocks past the last expert carry E: clamped, their rows are unused).
            row_expert = tables.block_expert.long().clamp(max=self.w13.shape[0] - 1).repeat_interleave(BM)  # [S]
        if self.b13 is not None:
            h += self.b13[row_expert]
        timer.mark("gemm1")
        act = self.act.apply(h[:, :Ir], h[:, Ir:])                 # [S, Ir]
        timer.mark("swiglu")
        d = grouped_mm(act, self.w2, tables.expert_offsets)       # [S, H]
        if self.b2 is not None:
            d += self.b2[row_expert]
        timer.mark("gemm2")
        return d, tables.slots

    def _packed(self, x_g: torch.Tensor, hits: PackedHits, timer: StageTimer) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-expert loop over the hits alone (a step's cost follows its tokens): one gather,
        one activation and E matmuls per GEMM over the M packed rows (`pack_hits`, by expert; one
        call on the CPU where torch's grouped GEMM runs there, `grouped_mm_host`)."""
        Ir = self.w2.shape[1]
        M = hits.tokens.numel()
        A = torch.index_select(x_g, 0, hits.tokens, out=self.A[:M])  # [M, H]
        timer.mark("scatter")
        h = grouped_mm_host(A, self.w13, hits.offsets, out=self.h[:M])  # [M, 2*Ir]
        if self.b13 is not None:
            h += self.b13[hits.experts]
        timer.mark("gemm1")
        act = self.act.apply(h[:, :Ir], h[:, Ir:])                      # [M, Ir]
        timer.mark("swiglu")
        d = grouped_mm_host(act, self.w2, hits.offsets, out=self.d[:M])  # [M, H]
        if self.b2 is not None:
            d += self.b2[hits.experts]
        timer.mark("gemm2")
        return d, hits.slots


def build_tables(ids: torch.Tensor, counts: torch.Tensor, E: int, C: int, S: int) -> torch_tables.Tables:
    """The schedule tables, the one dispatcher: the csrc CUDA op where it runs (CUDA ids, within
    its limits, library built), else the vectorized torch builder. Same values either way."""
    if ids.is_cuda:
        from service.kernels import schedule

        if schedule.use_cuda_op(ids, E):
            return torch_tables.Tables(*schedule.build_tables_cuda(ids, counts, E, C, S))
    return torch_tables.build_tables(ids, counts, E, C, S)


class SerialLayer:
    """One rank's share of the layer; buffers are allocated once at capacity and reused."""

    name = "serial"

    def __init__(self, cfg: LayerConfig, weights: RankWeights, *, rank: int, device: torch.device,
                 group: dist.ProcessGroup | None = None, gemm: str = "auto", graph: bool = False,
                 host: HostPeers | None = None):
        device = torch.device(device)
        self.cfg, self.rank, self.device, self.group = cfg, rank, device, group
        self.gemms = GroupedGemms(cfg, weights, device, gemm)
        R, C, K, H = cfg.R, cfg.C, cfg.K, cfg.H
        if host is not None and (device.type != "cpu" or R == 1):
            raise ValueError("shared-memory collectives are for CPU ranks, R > 1")
        self.host = None if host is None else HostComm(host, cfg, rank)
        self.nccl = self.host is None and dist.is_initialized() and dist.get_backend(group) == "nccl"
        self.gloo = self.host is None and not self.nccl and R > 1
        if R > 1:
            log.info("collectives: %s", "shared memory (service.moe.hostcomm)" if self.host else
                     "NCCL" if self.nccl else "gloo")
        kw = dict(device=device)
        self._timer: StageTimer | None = None  # the last step's, for exposed_comm_s
        self.out = torch.zeros(C, H, dtype=torch.float32, **kw)  # [C, H] fp32 sum of the slices
        self._rows = C  # leading rows of each rank's block that hold its tokens (m; C on CUDA but gloo)
        if self.gemms.impl == "torch":  # the portable combine's gather buffer
            self.gathered = torch.empty(R * C, H, dtype=cfg.dtype, **kw)   # [R*C, H]
        self._graph = None
        if self.host is not None:  # _host_step's own buffers; it needs nothing below
            self.ids_g = torch.zeros(R * C, K, dtype=torch.int32)   # [R*C, K] the step's ids (rows >= T stale)
            self.w_g = torch.zeros(R * C, K, dtype=torch.float32)   # [R*C, K] the step's weights
            self._count = torch.zeros(1, dtype=torch.int64)         # [1] T: the step as one block
            self._seqs: list[int] = []                              # the step each rank ran, for check_seq
            return
        # Routing block of this rank (layout: service.moe.routing) and every rank's.
        L = routing.block_len(C, K)
        self.routing = torch.zeros(L, dtype=torch.int32, **kw)        # [L]
        self.routing_g = torch.zeros(R, L, dtype=torch.int32, **kw)   # [R, L]
        self.x_g = torch.zeros(R * C, H, dtype=cfg.dtype, **kw)  # [R*C, H]
        self.partial = torch.empty(R * C, H, dtype=torch.float32, **kw)  # [R*C, H] combine output
        if self.gloo:  # gloo's all-reduce of the first _rows rows of each block
            self.reduce_buf = torch.empty(R * C, H, dtype=torch.float32, **kw)  # [R*C, H]
        # This step's inputs (`inputs`: the caller may write its rows here) and control words: the
        # routing block's META words (n, seq low, seq high, 0), copied to the device from pinned
        # memory, so the step itself reads no host value and is CUDA-graph capturable.
        self.x_in = torch.zeros(C, H, dtype=cfg.dtype, **kw)          # [C, H]
        self.ids_in = torch.zeros(C, K, dtype=torch.int32, **kw)      # [C, K]
        self.w_in = torch.zeros(C, K, dtype=torch.float32, **kw)      # [C, K]
        self.ctl = torch.zeros(META, dtype=torch.int32, **kw)         # [META]
        self._row = torch.arange(C, **kw)                             # [C] local row index
        cuda = device.type == "cuda"
        self._ctl = HostWords(self.ctl)
        self._out = self.out
        if graph:
            if not cuda or (R > 1 and not self.nccl):
                raise ValueError("a graphed serial layer needs a CUDA device and, with R > 1, NCCL")
            self._capture()

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [C, H], ids [C, K] int32, w [C, K] fp32 on this rank's device: write a step's rows here
        and pass the [:n] views to `forward`, which then copies nothing. None with `host` (forward
        reads the step's rows where they are)."""
        return None if self.host is not None else (self.x_in, self.ids_in, self.w_in)

    def _capture(self) -> None:
        """One eager step with no tokens (compiles every kernel, warms NCCL), then the step as a
        CUDA graph on a side stream; `forward` then replays it."""
        self._set_inputs(self.x_in[:0], self.ids_in[:0], self.w_in[:0], 0)
        self._device_step(None)
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(self._graph, stream=stream):
            self._device_step(None)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    # -- collectives: the same call on gloo, NCCL and shared memory ------------------------------
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self.cfg.R == 1:
            out.copy_(inp.reshape(out.shape))
        elif self.nccl:
            dist.all_gather_into_tensor(out, inp, group=self.group)
        else:
            # gloo has no bf16 kernels; a byte view moves the same bits.
            view = (lambda t: t.view(torch.uint8)) if inp.dtype == torch.bfloat16 else (lambda t: t)
            src = view(inp)
            chunks = [c.view(src.shape) for c in view(out).chunk(self.cfg.R)]
            if src.shape[0] == self.cfg.C and src.dim() == 2:  # token blocks: the first m rows only
                src, chunks = src[:self._rows], [c[:self._rows] for c in chunks]
            dist.all_gather(chunks, src, group=self.group)

    def _reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        R, C = self.cfg.R, self.cfg.C
        if self.cfg.R == 1:
            return partial
        if self.nccl:
            dist.reduce_scatter_tensor(self.out, partial, group=self.group)
            return self.out
        m = self._rows
        rows = self.reduce_buf[:R * m].view(R, m, -1)              # [R, m, H]
        rows.copy_(partial.view(R, C, -1)[:, :m])
        dist.all_reduce(rows, group=self.group)
        return rows[self.rank]

    # -- one step --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: int,
                timer: StageTimer | None = None, state: StepState | None = None) -> torch.Tensor:
        """x [n, H], ids [n, K], w [n, K] on any device (ideally views of `inputs`) -> this rank's
        output [n, H] fp32 (a view of a buffer the next step overwrites). With `host`: the whole
        step's rows x [T, H], ids, w [T, K] (the same on every rank) -> this rank's rows of it.
        With `state`: timed by its timer, its snapshot into its words (service.moe.layer.Layer)."""
        out = self._forward(x, ids, w, seq, state.timer if state is not None else timer)
        if state is not None:
            self.snapshot(state)
        return out

    def _forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: int,
                 timer: StageTimer | None) -> torch.Tensor:
        if self.host is not None:
            return self._host_step(x, ids, w, seq, timer)
        n = x.shape[0]
        assert n <= self.cfg.C, f"rank {self.rank} got {n} tokens, capacity is {self.cfg.C}"
        timer = self._timer = timer or StageTimer(self.device)
        timer.start()
        self._set_inputs(x, ids, w, seq)
        if self._graph is not None:
            self._graph.replay()  # one unit: no per-stage times (benchmarks time the whole step)
        else:
            self._device_step(timer)
        return self._out[:n]

    def _set_inputs(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: int) -> None:
        """The step's rows into `inputs` (nothing to copy for views of them) and its META words
        into `ctl` (one copy from pinned memory on a GPU, service.moe.layer.HostWords)."""
        n = x.shape[0]
        for buf, src in ((self.x_in, x), (self.ids_in, ids), (self.w_in, w)):
            if src.data_ptr() != buf.data_ptr():
                buf[:n].copy_(src)
        self._ctl.send(routing.meta_words(n, seq))

    def _device_step(self, timer: StageTimer | None) -> None:
        """Steps 1-6 on the device from `inputs` and `ctl`: no host value is read (on NCCL or
        R = 1), so the step is captured as it is (`graph=True`); the output lands in `_out`."""
        cfg = self.cfg
        R, C, K = cfg.R, cfg.C, cfg.K
        timer = timer or _NO_TIMER  # capture: no timing events inside a graph
        mark = timer.mark

        # 1. routing all-gather; padding rows get weight 0 so they add nothing anywhere.
        routing.pack(self.routing, self.ctl, self.ids_in, self.w_in, self._row)
        self._all_gather(self.routing_g, self.routing)
        mark("all_gather")
        counts, ids_g, w_g = routing.unpack(self.routing_g, C, K)  # [R], [R*C, K], [R*C, K]
        if self.gloo or self.device.type == "cpu":  # m: rows moved and combined (a host read, never captured)
            self._rows = max(1, int(counts.max()))

        # 2. schedule tables, identical on every rank.
        tables = self.gemms.schedule(ids_g, counts, cfg.E, C, cfg.S)
        mark("tables")

        # 3. tokens: all-gather (rows past n are stale: padding tokens, which no row reads).
        self._all_gather(self.x_g, self.x_in)
        mark("all_gather")

        # 4. grouped GEMM1 + SwiGLU over the gathered layout, grouped GEMM2.
        d, slots = self.gemms(self.x_g, tables, timer)            # [S or N, H], [R*C, K]

        # 5. top-k combine in fp32 -> partial [R*C, H]; padding tokens' rows are 0.
        partial = self._combine(d, slots, w_g, self.partial, R, self._rows)
        mark("combine")

        # 6. reduce-scatter: this rank's rows of the sum over the R intermediate slices.
        self._out = self._reduce_scatter(partial)                 # [C, H]
        mark("reduce_scatter")

    def _host_step(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: int,
                   timer: StageTimer | None) -> torch.Tensor:
        """CPU ranks of one host (module docstring): x [T, H], ids [T, K], w [T, K] the whole step's
        rows -> this rank's rows of the output [n, H] fp32. One barrier, after the own plane."""
        cfg = self.cfg
        T, N = x.shape[0], cfg.tokens_per_step
        assert T <= N, f"a step has at most {N} tokens, got {T}"
        start, n = routing.rank_range(T, cfg.R, self.rank)
        timer = self._timer = timer or StageTimer(self.device)
        timer.start()
        self.ids_g[:T].copy_(ids)   # rows >= T: padding tokens (the tables ignore their ids)
        self.w_g[:T].copy_(w)
        self._count[0] = T
        timer.mark("all_gather")
        tables = self.gemms.schedule(self.ids_g, self._count, cfg.E, N, cfg.S)  # the step as one block of N
        timer.mark("tables")
        d, slots = self.gemms(x, tables, timer)                           # row tokens < T index x
        self._combine(d, slots, self.w_g, self.host.partials(seq)[self.rank], 1, T)
        self.host.seqs(seq)[self.rank] = seq
        timer.mark("combine")
        self.host.barrier()                                               # every plane is written
        self._seqs = self.host.seqs(seq).tolist()
        out = torch.sum(self.host.partials(seq)[:, start:start + n], dim=0, out=self.out[:n])  # [n, H]
        timer.mark("reduce_scatter")
        return out

    def _combine(self, d: torch.Tensor, slots: torch.Tensor, w_g: torch.Tensor, out: torch.Tensor,
                 blocks: int, m: int) -> torch.Tensor:
        """out[g] = sum_k w_g[g, k] * d[slots[g, k]] in fp32 -> out [N, H]; rows of padding tokens
        are 0. The N tokens are `blocks` blocks of which only the first m rows hold real tokens."""
        if self.gemms.impl == "triton":  # CUDA with Triton: one streaming kernel
            from service.kernels.combine import combine

            return combine(d, slots, w_g, out=out)
        # Portable: K rounds of gather + fused multiply-add into the buffers of __init__ (the
        # multiply-add reads the layer dtype and accumulates in fp32), over the first m rows of each
        # rank's block only (the rest are padding tokens, which nothing reads). A padding token's
        # slots are -1, read as row 0 with weight 0; its row is then zeroed (as is any non-finite
        # value of row 0).
        B, K = blocks, slots.shape[1]
        C = slots.shape[0] // B
        part = out.view(B, C, -1)[:, :m]                                   # [B, m, H] fp32
        gathered = self.gathered[:B * m]                                   # [B*m, H]
        slots, w_g = slots.view(B, C, K)[:, :m], w_g.view(B, C, K)[:, :m]  # [B, m, K]
        idx = slots.reshape(B * m, K).long().clamp(min=0)                  # [B*m, K]
        part.zero_()
        if d.shape[0] == 0:  # a step without hits (no tokens anywhere): the partials are 0
            return out
        for k in range(K):
            torch.index_select(d, 0, idx[:, k], out=gathered)
            part.addcmul_(gathered.view(B, m, -1), w_g[:, :, k:k + 1])
        part.masked_fill_(slots[:, :, :1] < 0, 0.0)
        return out

    # -- after a step ----------------------------------------------------------------------------
    def new_state(self) -> StepState:
        """A step's timer and its snapshot words: every rank's seq, [R] int64 with `host`, else the
        routing blocks' seq words [R, 2] int32 (pinned on CUDA)."""
        R, cuda = self.cfg.R, self.device.type == "cuda"
        words = torch.zeros(R, dtype=torch.int64) if self.host is not None else \
            torch.zeros(R, 2, dtype=torch.int32, pin_memory=cuda)
        return StepState(StageTimer(self.device), words)

    def snapshot(self, state: StepState) -> None:
        """The step's seq words -> state.words (one copy; the stage times are state.timer's)."""
        if self.host is not None:
            state.words.copy_(torch.tensor(self._seqs))
        else:
            state.words.copy_(self.routing_g[:, 1:3], non_blocking=True)

    def _state(self, state: StepState | None) -> StepState:
        if state is None:  # the last step's, read now (a sync)
            state = StepState(self._timer or StageTimer(self.device), self.new_state().words)
            self.snapshot(state)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        return state

    def check_seq(self, seq: int, state: StepState | None = None) -> None:
        """After a step: every rank must have run the same batch (from the step's snapshot)."""
        words = self._state(state).words
        if self.host is not None:
            routing.check_seqs(words.tolist(), seq, self.rank)
        else:
            routing.check_seq_words(words, seq, self.rank)

    def exposed_comm_s(self, state: StepState | None = None) -> float:
        """The step's time in collectives (nothing overlaps them in this backend)."""
        timer = state.timer if state is not None else self._timer
        stages = timer.seconds() if timer else {}
        return sum(stages.get(s, 0.0) for s in COLLECTIVE_STAGES)
