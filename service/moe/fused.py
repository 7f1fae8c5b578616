"""The fused backend: the layer in three launches (plus the input stage, a one-CTA exchange and the
schedule tables), peers' memory through PyTorch symmetric memory, communication overlapped with
the GEMMs (ARCHITECTURE.md section 3; docs/CONTRACTS.md lists where the code departs from it).

Three modules, one job each: service/moe/fused_buffers.py (the symmetric region's layout and
the buffers, and the kernels' argument structure over them), service/moe/fused_plan.py (grids,
roles and tiles for a device; the capability probe), and this one (the layer: rendezvous,
warm-up, the step's graph, errors and timings). The kernels are service/kernels/fused_kernels.py.

Dimension letters: R ranks, C capacity per rank, N = R*C global tokens, K top-k, H hidden,
Ir = I / R, E experts, S gathered rows, NB = S / BM row blocks, L = META + 2*C*K.

One step on rank r (service/moe/simulate.py is the CPU model of exactly this dataflow):

    host     x, ids, w in this rank's input buffers (`FusedLayer.inputs`: the rank writes its
             rows there; other tensors are copied in); ctl = (seq, n, batch seq) -> the device
             (one copy from pinned memory). Then one CUDA graph replay of:
    stage    rows < n of the inputs -> the symmetric token and routing buffers of parity seq & 1.
    exchange one CTA: write META, store seq into bar[r] of every peer (release), wait until all R
             of our bar slots reach seq (the device barrier), copy the R routing blocks -> routing_g.
    tables   service.moe.serial.build_tables (CUDA op or torch builder): identical on every rank.
    kernel 1 comm programs pull each remote real token once from its owner's buffer in pull_order
             into `pulled` [N, H] of this rank's region and mark arrived[g] = seq (release);
             compute programs run grouped GEMM1 + SwiGLU over the gathered layout, reading row s
             as token row_token[s] in place (own tokens from the token buffer, remote ones from
             `pulled`: the K copies of a token are re-reads of one row, no scattered A [S, H]),
             each tile gated on arrived[g] >= seq for the remote tokens of its row block (a pair
             tile, GemmConfig.pair: of its two blocks).
    kernel 2 compute programs run grouped GEMM2, marking tiles[block] (+1 per column tile, for
             used and unused blocks, so the target is seq * n_tiles; with pair tiles +1 on both
             blocks of a pair per tile number of the pair and +2 otherwise: seq * 2 * n_tiles);
             jobs (job_tokens tokens per grab from an atomic dispenser in job_order) wait for
             their K rows, sum them in fp32 with the routing weights, store the rows into the
             owners' staging planes for source r; the last writer per owner (local count,
             elected) stores seq into the owner's wm[r] (release, no remote read-modify-write).
             Owners with no tokens are published at the kernel's start. GEMM programs join the
             dispenser after their tiles.
    reduce   wait until wm[s] >= seq for all s, out_r = sum over the R planes; reset kernel 2's
             local scratch and refresh every arrival flag to seq (see "Sequence numbers").

Sequence numbers. Every flag is compared against a function of the step number `seq` (the
layer's own counter, ctl[0], which also runs the warm-up step) and never reset: token arrivals,
watermarks and barrier slots target seq, tile counters seq*n_tiles (pair tiles: seq*2*n_tiles;
int32, wrap-safe comparisons, service/kernels/sync.py). A token's arrival flag is set only when
it is pulled, so the final reduce refreshes all of them to seq every step: a token left unpulled
for 2**31 steps would otherwise read as arrived. Only the dispenser, the two kernels' tile queues
(GemmConfig.queue) and the per-owner push counts are zeroed, by the final reduce: they are local,
read by no peer, and the counters overshoot by the number of programs that find them empty, so no
seq target could describe them.

Why one barrier per step is enough: the token and routing buffers are double buffered by parity.
Rank o overwrites parity p at step seq+2 only after its exchange of step seq+1, which waited for
every peer's seq+1 signal; a peer sends that signal after its kernel 1 of step seq (stream order),
the last reader of parity p. Staging planes are single buffered: a peer pushes into o's planes at
step seq+1 only after the barrier of seq+1, which o enters after its final reduce of step seq.

Deadlock rules. Each launch is one persistent grid of #SMs programs at one CTA per SM (the GEMM
tiles' shared memory allows no second one), so every program is resident: spinning consumers can
never keep a producer off the machine. Every wait is bounded (`max_spins` polls); the first
expiry is recorded in the error flag, later kernels of the step do nothing, `check_seq` raises
`FusedTimeout`, and the rank group restarts.

Exposed communication (`exposed_comm_s`, per step, measured in the kernels with %globaltimer):
    barrier wait (exchange)
  + mean over kernel-1 compute programs of their time waiting at gates
  + mean over kernel-2 GEMM programs of their time in the dispenser after their last tile
    (the all-hands tail: communication the GEMM did not hide)
  + the final reduce's wait for the watermarks.
Communication hidden behind the GEMMs costs nothing here; anything the GEMM programs or the
reduce had to wait for counts.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from service.config import LayerConfig
from service.moe import routing
from service.moe.fused_plan import (
    default_plan,
    fused_unavailable_reason,  # noqa: F401 (callers pick the backend through this module)
    local_unavailable_reason,
)
from service.moe.layer import HostWords, StepState
from service.moe.timing import StageTimer
from service.moe.weights import RankWeights

if TYPE_CHECKING:  # the kernels import triton: only once the probe said it is there
    from service.kernels import fused_kernels as fk
    from service.moe.fused_buffers import RankBuffers

log = logging.getLogger(__name__)

WARMUP_SPINS = 1 << 30  # the warm-up step waits for peers that are still compiling


class FusedTimeout(RuntimeError):
    """A bounded wait of the fused kernels expired: a peer is dead, stuck or out of step."""


def _seq32(seq: int) -> int:
    """The low 32 bits of a step number as a signed int32 (flags compare wrap-safe)."""
    seq &= 0xFFFFFFFF
    return seq - (1 << 32) if seq >= 1 << 31 else seq


def build_step_tables(b: RankBuffers):
    """The schedule tables of the step whose routing the exchange left in b.routing_g."""
    from service.moe.serial import build_tables

    counts, ids_g, _ = b.routing_views()
    return build_tables(ids_g, counts, b.cfg.E, b.cfg.C, b.cfg.S)


def device_step(args: fk.StepArgs, plan: fk.Plan, bufs: RankBuffers, mark=lambda _: None):
    """One step's launches in stream order (captured once into the layer's graph); returns the
    step's tables. `mark(stage)` closes each stage (a StageTimer's mark, eager runs)."""
    from service.kernels import fused_kernels as fk

    fk.stage(args)
    mark("stage")
    fk.exchange(args, plan)
    mark("exchange")
    tables = build_step_tables(bufs)
    mark("tables")
    fk.ag_gemm1(args, plan, tables)
    mark("kernel1")
    fk.gemm2_push(args, plan, tables)
    mark("kernel2")
    fk.final_reduce(args, plan)
    mark("reduce")
    return tables


class _StateGraph:
    """One step of the layer as a CUDA graph made for one StepState: the control words' copy from
    this graph's own pinned words (written by `replay` just before it launches), the step (the
    layer's `device_step`), and the snapshot into the state's words. One launch where the eager
    order is the control words' event wait, copy and event, then the graph, then the snapshot's copy
    (bench/step_enqueue_probe.py: ~0.13 ms sooner per step at one client on an H100 host).

    The control words are rewritten at each replay: safe because a state (and so its graph) is used
    again only once the step that used it is done (service.moe.layer.Layer.forward's rule; the
    rank's lanes keep it), so the copy that read them has run."""

    def __init__(self, layer: FusedLayer, words: torch.Tensor):
        bufs = layer.bufs
        self._ctl = torch.zeros(bufs.ctl.shape, dtype=bufs.ctl.dtype, pin_memory=True)
        self._ctl_np = self._ctl.numpy()  # written without a torch op per word
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(layer.device)
        stream = torch.cuda.Stream(layer.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), torch.cuda.graph(self.graph, stream=stream,
                                                         capture_error_mode="thread_local"):
            bufs.ctl.copy_(self._ctl, non_blocking=True)
            layer._device_step(None)
            words.copy_(bufs.state, non_blocking=True)
        current.wait_stream(stream)
        torch.cuda.synchronize(layer.device)

    def replay(self, ctl: tuple[int, ...]) -> None:
        self._ctl_np[:] = ctl
        self.graph.replay()


class FusedLayer:
    """One rank's share of the fused layer (implements service.moe.layer.Layer)."""

    name = "fused"

    def __init__(self, cfg: LayerConfig, weights: RankWeights, *, rank: int, device: torch.device,
                 group: dist.ProcessGroup | None = None, graph: bool = True, **plan_overrides):
        device = torch.device(device)
        reason = local_unavailable_reason(cfg, device)
        if reason:
            raise RuntimeError(f"the fused backend cannot run here: {reason}")
        from service.moe.fused_buffers import Layout, RankBuffers

        self.cfg, self.rank, self.device, self.group = cfg, rank, device, group
        self.plan = default_plan(cfg, device, **plan_overrides)
        self.w13 = weights.w13.to(device, cfg.dtype).contiguous()  # [E, H, 2*Ir]
        self.w2 = weights.w2.to(device, cfg.dtype).contiguous()    # [E, Ir, H]
        self.b13 = None if weights.b13 is None else weights.b13.to(device, cfg.dtype).contiguous()  # [E, 2*Ir]
        self.b2 = None if weights.b2 is None else weights.b2.to(device, cfg.dtype).contiguous()     # [E, H] rank 0
        lay = Layout(cfg.R, cfg.C, cfg.H, cfg.K, cfg.dtype.itemsize)
        if cfg.R == 1:
            self._handle = None
            region = torch.zeros(lay.nbytes, dtype=torch.uint8, device=device)
            ptrs = [region.data_ptr()]
        else:
            import torch.distributed._symmetric_memory as symm_mem

            group = group or dist.group.WORLD
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # needed before rendezvous in older torch, a no-op (deprecated) later
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(group.group_name)
            region = symm_mem.empty(lay.nbytes, dtype=torch.uint8, device=device)
            self._handle = symm_mem.rendezvous(region, group.group_name)
            off = region.data_ptr() - self._handle.buffer_ptrs[rank]
            ptrs = [p + off for p in self._handle.buffer_ptrs]
            region.zero_()
            torch.cuda.synchronize(device)
            dist.barrier(group=group)  # every region is zero before anyone signals into it
        self.bufs = RankBuffers(cfg, rank, region, ptrs)
        self.args = self.bufs.args(self.w13, self.w2, self.b13, self.b2)
        self._ctl = HostWords(self.bufs.ctl)
        self._own_state: StepState | None = None  # check_seq/exposed_comm_s without a state: their snapshot
        self.step = 0  # the flags' sequence number: counts every step, the warm-up included
        self._tables = None
        self._graph = None
        # Warm-up: one empty step on every rank (compiles every kernel), then the graph. Peers
        # compile at different speeds (Triton's disk cache may serve one and not another), so the
        # warm-up waits allow minutes; max_spins is a kernel argument, not a constant: the
        # captured steps get the plan's bound.
        self._run(torch.empty(0, cfg.H, dtype=cfg.dtype, device=device),
                  torch.empty(0, cfg.K, dtype=torch.int32, device=device),
                  torch.empty(0, cfg.K, dtype=torch.float32, device=device), 0, None,
                  dataclasses.replace(self.plan, max_spins=max(self.plan.max_spins, WARMUP_SPINS)))
        torch.cuda.synchronize(device)
        self._raise_on_error("warm-up step", self._words(None)[1])
        if graph:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), torch.cuda.graph(self._graph, stream=stream):
                self._device_step(None)
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
        log.info("fused layer ready: %d programs, %d pulling in kernel 1, %d GEMM2 programs (join=%s), graph=%s, "
                 "weights through %s", self.plan.num_programs, self.plan.num_comm1, self.plan.num_compute2,
                 self.plan.join, graph, "TMA descriptors" if self.plan.config1.w_desc else "pointer loads")

    # -- one step --------------------------------------------------------------------------------
    def _device_step(self, timer: StageTimer | None, plan: fk.Plan | None = None) -> None:
        self._tables = device_step(self.args, plan or self.plan, self.bufs, timer.mark if timer else (lambda _: None))
        self.bufs.seqs.copy_(self.bufs.routing_g[:, 1:3])  # beside stats and error: `snapshot` is one copy

    def _run(self, x, ids, w, seq: int, timer: StageTimer | None, plan: fk.Plan | None = None) -> torch.Tensor:
        n = x.shape[0]
        self.step += 1
        self.bufs.take_inputs(x, ids, w)
        self._ctl.send((_seq32(self.step), n, *routing.seq_words(seq)))
        if timer:
            timer.mark("copy_in")
        if self._graph is not None:
            self._graph.replay()
            if timer:
                timer.mark("fused")
        else:
            self._device_step(timer, plan)
        return self.bufs.out[:n]

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [C, H], ids [C, K] int32, w [C, K] fp32 on the device: write a step's rows here and
        pass the [:n] views to `forward`, which then copies nothing."""
        b = self.bufs
        return b.x_in, b.ids_in, b.w_in

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: int,
                timer: StageTimer | None = None, state: StepState | None = None) -> torch.Tensor:
        """x [n, H], ids [n, K], w [n, K] on this rank's device (ideally views of `inputs`) ->
        this rank's output [n, H] fp32 (a view of a buffer the next step overwrites). With `state`
        (service.moe.layer.Layer): timed by its timer, its snapshot into its words; with the graph
        on, one replay of the state's own graph (_StateGraph: the control words, the step and the
        snapshot, where the eager path takes ~5 more CUDA calls on the host before the layer starts)."""
        cfg = self.cfg
        n = x.shape[0]
        assert n <= cfg.C, f"rank {self.rank} got {n} tokens, capacity is {cfg.C}"
        timer = state.timer if state is not None else (timer or StageTimer(self.device))
        timer.start()
        if state is None:
            return self._run(x, ids, w, seq, timer)
        if not isinstance(state.graph, _StateGraph):
            out = self._run(x, ids, w, seq, timer)
            self.snapshot(state)
            return out
        self.step += 1
        self.bufs.take_inputs(x, ids, w)
        state.graph.replay((_seq32(self.step), n, *routing.seq_words(seq)))
        timer.mark("fused")
        return self.bufs.out[:n]

    # -- after a step ----------------------------------------------------------------------------
    def new_state(self) -> StepState:
        """A step's timer and its snapshot words (RankBuffers.state's layout, in pinned memory) and,
        with the graph on, the state's own graph of a step (_StateGraph)."""
        words = self._words_buffer()
        return StepState(StageTimer(self.device), words, _StateGraph(self, words) if self._graph is not None else None)

    def _words_buffer(self) -> torch.Tensor:
        """Host words for a snapshot: RankBuffers.state's layout, pinned."""
        state = self.bufs.state
        return torch.zeros(state.shape, dtype=state.dtype, pin_memory=True)

    def snapshot(self, state: StepState) -> None:
        """The step's stats, error flag and seq words (RankBuffers.state) -> state.words: one copy."""
        state.words.copy_(self.bufs.state, non_blocking=True)

    def _words(self, state: StepState | None) -> tuple[list[int], int, list[int]]:
        """A step's snapshot (the last step's, read now with a sync, without `state`) as stats [4]
        int64 ns, the error word and the step each rank ran. Read through one numpy view of the pinned
        words: a torch op per word cost ~10 us each on the serving guests, 74 us for check_seq alone
        at one client (bench/rank_pieces_probe.py, eighteenth session)."""
        from service.moe.fused_buffers import STATE_ERROR, STATE_SEQS

        if state is None:
            state = self._own_state = self._own_state or StepState(StageTimer(self.device), self._words_buffer())
            self.snapshot(state)
            torch.cuda.current_stream(self.device).synchronize()
        w = state.words.numpy()  # int32 [STATE_SEQS + 2R]
        seqs = w[STATE_SEQS:].reshape(self.cfg.R, 2).astype(np.int64)  # routing.seq_words' two words a rank
        return w[:STATE_ERROR].view(np.int64).tolist(), int(w[STATE_ERROR]), (seqs[:, 0] | (seqs[:, 1] << 31)).tolist()

    def _raise_on_error(self, what: str, code: int) -> None:
        from service.kernels.fused_kernels import describe_error

        if code:
            raise FusedTimeout(f"rank {self.rank}, {what}: {describe_error(code)}")

    def check_seq(self, seq: int, state: StepState | None = None) -> None:
        """After a step: the kernels' error flag, then every rank must have run the same batch
        (from the step's snapshot: host reads alone)."""
        _, code, seqs = self._words(state)
        self._raise_on_error(f"step seq {seq}", code)
        routing.check_seqs(seqs, seq, self.rank)

    def exposed_comm_s(self, state: StepState | None = None) -> float:
        """The step's exposed communication in seconds (definition in the module docstring)."""
        return sum(self.exposure_breakdown_s(state).values())

    def exposure_breakdown_s(self, state: StepState | None = None) -> dict[str, float]:
        ns = self._words(state)[0]
        plan = self.plan
        return {"barrier": ns[0] * 1e-9, "gates": ns[1] * 1e-9 / max(1, plan.num_programs - plan.num_comm1),
                "tail": ns[2] * 1e-9 / max(1, plan.num_compute2), "reduce_wait": ns[3] * 1e-9}
