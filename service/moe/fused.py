"""The fused backend: the layer in three launches (plus the input stage, a one-CTA exchange and the
schedule tables), peers' memory through PyTorch symmetric memory, communication overlapped with
the GEMMs (ARCHITECTURE.md section 3; docs/CONTRACTS.md lists where the code departs from it).

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
             each tile gated on arrived[g] >= seq for the remote tokens of its row block.
    kernel 2 compute programs run grouped GEMM2, marking tiles[block] (+1 per column tile, for
             used and unused blocks, so the target is seq * n_tiles); jobs (job_tokens tokens per
             grab from an atomic dispenser in job_order) wait for their K rows, sum them in fp32
             with the routing weights, store the rows into the owners' staging planes for source r; the
             last writer per owner (local count, elected) stores seq into the owner's wm[r]
             (release, no remote read-modify-write). Owners with no tokens are published at the
             kernel's start. GEMM programs join the dispenser after their tiles.
    reduce   wait until wm[s] >= seq for all s, out_r = sum over the R planes; reset kernel 2's
             local scratch and refresh every arrival flag to seq (see "Sequence numbers").

Sequence numbers. Every flag is compared against a function of the step number `seq` (the
layer's own counter, ctl[0], which also runs the warm-up step) and never reset: token arrivals,
watermarks and barrier slots target seq, tile counters seq*n_tiles (int32, wrap-safe
comparisons, service/kernels/sync.py). A token's arrival flag is set only when it is pulled, so
the final reduce refreshes all of them to seq every step: a token left unpulled for 2**31 steps
would otherwise read as arrived. Only the dispenser and the per-owner push counts are zeroed, by
the final reduce: they are local, read by no peer, and the dispenser overshoots by the number of
programs that find it empty, so no seq target could describe it.

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

import torch
import torch.distributed as dist

from service.config import BM, LayerConfig
from service.moe import routing
from service.moe.timing import StageTimer
from service.moe.weights import RankWeights

log = logging.getLogger(__name__)

ALIGN = 256                 # bytes between regions of the symmetric buffer
DEFAULT_MAX_SPINS = 1 << 22  # ~1 s at ~0.2 us per system-scope poll: far beyond an honest wait
WARMUP_SPINS = 1 << 30       # the warm-up step waits for peers that are still compiling


class FusedTimeout(RuntimeError):
    """A bounded wait of the fused kernels expired: a peer is dead, stuck or out of step."""


def _align(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte layout of one rank's symmetric region (service/kernels/fused_kernels.py lists it)."""

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
        return _align(self.tok_bytes + 2 * self.C * self.H * self.itemsize)

    @property
    def rt_bytes(self) -> int:
        return _align(self.pull_bytes + self.R * self.C * self.H * self.itemsize)

    @property
    def stage_bytes(self) -> int:
        return _align(self.rt_bytes + 2 * self.L * 4)

    @property
    def wm_bytes(self) -> int:
        return _align(self.stage_bytes + self.R * self.C * self.H * 4)

    @property
    def bar_bytes(self) -> int:
        return _align(self.wm_bytes + self.R * 4)

    @property
    def nbytes(self) -> int:
        return _align(self.bar_bytes + self.R * 4)


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
        # Element offsets of the parts inside any rank's region (the kernels' arguments).
        self.tok_off, self.pull_off = lay.tok_bytes // cfg.dtype.itemsize, lay.pull_bytes // cfg.dtype.itemsize
        self.rt_off, self.stage_off = lay.rt_bytes // 4, lay.stage_bytes // 4
        self.wm_off, self.bar_off = lay.wm_bytes // 4, lay.bar_bytes // 4
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
        self.disp = z(1)                               # job dispenser
        self.pushed = z(R)                             # jobs pushed per owner this step
        self.ctl = z(4)                                # seq, n, batch seq low, batch seq high
        self.error = z(1)
        self.stats = z(4, dtype=torch.int64)           # ns, see fused_kernels

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


def _seq32(seq: int) -> int:
    """The low 32 bits of a step number as a signed int32 (flags compare wrap-safe)."""
    seq &= 0xFFFFFFFF
    return seq - (1 << 32) if seq >= 1 << 31 else seq


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the kernels are launched: grid sizes, roles, tiles, bounds."""

    num_programs: int
    num_comm1: int      # kernel 1 programs that pull (0 when R = 1: nothing is remote)
    num_compute2: int   # kernel 2 programs that run GEMM2 (the rest take jobs from the start)
    join: bool          # GEMM2 programs take jobs after their tiles
    config1: object
    config2: object
    max_spins: int = DEFAULT_MAX_SPINS
    use_ptx: bool = True
    sync: bool = True
    # Columns a kernel-2 job loads per step (K rows of them at once). Swept on an H200 at the seed
    # share, R=1 (bench/RESULTS.md): 512 -> job tail 360 us, 1024 -> 134, 2048 -> 66, 4096 -> 61.
    job_cols: int = 2048
    # Tokens a kernel-2 job takes per dispenser grab (their K rows load together; the fixed
    # costs of a job are paid once per grab). H200, seed share, R=1, job_cols 2048
    # (bench/RESULTS.md): 1 -> job tail 72 us, 2 -> 52, 4 -> 39 (fused 978 -> 919 us); narrower
    # columns lose (4 x 1024: 102, 8 x 512: 316).
    job_tokens: int = 4
    # Tokens a kernel-1 puller moves per iteration. H200, seed share, R=1, when kernel 1 still
    # wrote K rows per token (bench/RESULTS.md): 4 -> 1.17x serial, 8 -> 1.13x, 16 -> 1.21x.
    pull_tokens: int = 8


def run_stage(b: RankBuffers) -> None:
    from service.kernels import fused_kernels as fk

    fk.stage(x=b.x_in, ids=b.ids_in, w=b.w_in, region=b.region, ctl=b.ctl, C=b.cfg.C, L=b.lay.L,
             tok_off=b.tok_off, rt_off=b.rt_off)


def run_exchange(b: RankBuffers, plan: Plan) -> None:
    from service.kernels import fused_kernels as fk

    fk.exchange(region=b.region, region_off=b.region_off, routing_g=b.routing_g, ctl=b.ctl, error=b.error, stats=b.stats,
                rank=b.rank, R=b.cfg.R, L=b.lay.L, rt_off=b.rt_off, bar_off=b.bar_off,
                max_spins=plan.max_spins, use_ptx=plan.use_ptx, sync=plan.sync)


def build_step_tables(b: RankBuffers):
    from service.moe.serial import build_tables

    counts, ids_g, _ = b.routing_views()
    return build_tables(ids_g, counts, b.cfg.E, b.cfg.C, b.cfg.S)


def run_kernel1(b: RankBuffers, plan: Plan, tables, w13: torch.Tensor, b13: torch.Tensor | None = None) -> None:
    from service.kernels import fused_kernels as fk

    fk.ag_gemm1(region=b.region, region_off=b.region_off, pulled=b.pulled, w13=w13, act=b.act, tables=tables,
                activation=b.cfg.act, b13=b13,
                arrived=b.arrived, ctl=b.ctl, error=b.error, stats=b.stats, rank=b.rank, R=b.cfg.R, C=b.cfg.C,
                tok_off=b.tok_off, pull_off=b.pull_off, config=plan.config1, num_programs=plan.num_programs,
                num_comm=plan.num_comm1, max_spins=plan.max_spins, use_ptx=plan.use_ptx, sync=plan.sync,
                pull_tokens=plan.pull_tokens)


def run_kernel2(b: RankBuffers, plan: Plan, tables, w2: torch.Tensor, b2: torch.Tensor | None = None) -> None:
    from service.kernels import fused_kernels as fk

    fk.gemm2_push(region=b.region, region_off=b.region_off, act=b.act, w2=w2, D=b.D, tables=tables, routing_g=b.routing_g,
                  b2=b2,
                  tiles=b.tiles, disp=b.disp, pushed=b.pushed, ctl=b.ctl, error=b.error, stats=b.stats,
                  rank=b.rank, R=b.cfg.R, C=b.cfg.C, L=b.lay.L, stage_off=b.stage_off, wm_off=b.wm_off,
                  config=plan.config2, num_programs=plan.num_programs, num_compute=plan.num_compute2,
                  join=plan.join, max_spins=plan.max_spins, use_ptx=plan.use_ptx, sync=plan.sync,
                  job_cols=plan.job_cols, job_tokens=plan.job_tokens)


def run_reduce(b: RankBuffers, plan: Plan) -> None:
    from service.kernels import fused_kernels as fk

    fk.final_reduce(staging=b.staging, wm=b.wm, out=b.out, routing_g=b.routing_g, disp=b.disp, pushed=b.pushed,
                    arrived=b.arrived, ctl=b.ctl, error=b.error, stats=b.stats, rank=b.rank, R=b.cfg.R, C=b.cfg.C, L=b.lay.L,
                    max_spins=plan.max_spins, use_ptx=plan.use_ptx, sync=plan.sync)


# ---------------------------------------------------------------------------------------------
# Capability probe.
# ---------------------------------------------------------------------------------------------


def _local_reason(cfg: LayerConfig, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"device {device.type} is not CUDA"
    if cfg.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {cfg.dtype} is not bf16/fp16"
    if cfg.H % 8 or cfg.Ir % 8:
        return f"H ({cfg.H}) and Ir ({cfg.Ir}) must be multiples of 8 (16-byte rows)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 8.0"
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not importable ({err})"
    if cfg.R > 1:
        try:
            import importlib

            importlib.import_module("torch.distributed._symmetric_memory")
        except ImportError as err:
            return f"no symmetric memory in this torch ({err})"
    return None


def fused_unavailable_reason(cfg: LayerConfig, device: torch.device, group=None) -> str | None:
    """None when the fused backend can run here, else why not. With R > 1 this is a collective over
    `group` (every rank must call it) and every rank gets the same verdict."""
    device = torch.device(device)
    reason = _local_reason(cfg, device)
    if cfg.R == 1:
        return reason
    if not dist.is_initialized():
        return reason or "no process group: peers cannot rendezvous"
    index = device.index if device.type == "cuda" and device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    gathered: list = [None] * cfg.R
    dist.all_gather_object(gathered, (reason, index), group=group)
    for r, (why, _) in enumerate(gathered):
        if why:
            return f"rank {r}: {why}"
    indices = sorted({i for _, i in gathered})
    for a in indices:
        for b in indices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} has no peer access to GPU {b}"
    return None


# ---------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_plan(cfg: LayerConfig, device: torch.device, **overrides) -> Plan:
    from service.kernels.tuning import lookup_for_device

    sms = _num_sms(device)
    # Pullers in kernel 1: none at R = 1 (every token is read in place); an eighth of the SMs
    # otherwise, for (R-1)/R * N * H * itemsize bytes (12 MB at the seed shape, R = 4). When
    # kernel 1 still copied every token to its K rows (8x the bytes), a sweep at R = 1 on an H200
    # found a quarter of the SMs best (bench/RESULTS.md); R > 1 awaits the 4-GPU run.
    comm = 0 if cfg.R == 1 else max(1, sms // 8)
    # Kernel 2: three quarters of the SMs run GEMM2, the rest take jobs from the start, and the
    # GEMM programs join them after their tiles (the split measured with the sweep above).
    plan = dict(num_programs=sms, num_comm1=comm, num_compute2=sms - max(1, sms // 4), join=True,
                config1=lookup_for_device(device, "gemm1", cfg.E, cfg.H, cfg.Ir),
                config2=lookup_for_device(device, "gemm2", cfg.E, cfg.H, cfg.Ir))
    plan.update(overrides)
    return Plan(**plan)


class FusedLayer:
    """One rank's share of the fused layer (implements service.moe.layer.Layer)."""

    name = "fused"

    def __init__(self, cfg: LayerConfig, weights: RankWeights, *, rank: int, device: torch.device,
                 group: dist.ProcessGroup | None = None, graph: bool = True, **plan_overrides):
        device = torch.device(device)
        reason = _local_reason(cfg, device)
        if reason:
            raise RuntimeError(f"the fused backend cannot run here: {reason}")
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
        self._ctl_host = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        self._ctl_np = self._ctl_host.numpy()
        self._ctl_copied = torch.cuda.Event()
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
        self._raise_on_error("warm-up step")
        if graph:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), torch.cuda.graph(self._graph, stream=stream):
                self._device_step(None)
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
        log.info("fused layer ready: %d programs, %d pulling in kernel 1, %d GEMM2 programs (join=%s), graph=%s",
                 self.plan.num_programs, self.plan.num_comm1, self.plan.num_compute2, self.plan.join, graph)

    # -- one step --------------------------------------------------------------------------------
    def _device_step(self, timer: StageTimer | None, plan: Plan | None = None) -> None:
        b, plan = self.bufs, plan or self.plan
        mark = timer.mark if timer else (lambda _: None)
        run_stage(b)
        mark("stage")
        run_exchange(b, plan)
        mark("exchange")
        self._tables = build_step_tables(b)
        mark("tables")
        run_kernel1(b, plan, self._tables, self.w13, self.b13)
        mark("kernel1")
        run_kernel2(b, plan, self._tables, self.w2, self.b2)
        mark("kernel2")
        run_reduce(b, plan)
        mark("reduce")

    def _run(self, x, ids, w, seq: int, timer: StageTimer | None, plan: Plan | None = None) -> torch.Tensor:
        n = x.shape[0]
        self.step += 1
        self.bufs.take_inputs(x, ids, w)
        self._ctl_copied.synchronize()  # the previous step's copy has read the pinned words
        self._ctl_np[:] = (_seq32(self.step), n, *routing.seq_words(seq))  # no torch op per word
        self.bufs.ctl.copy_(self._ctl_host, non_blocking=True)
        self._ctl_copied.record()
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
                timer: StageTimer | None = None) -> torch.Tensor:
        """x [n, H], ids [n, K], w [n, K] on this rank's device (ideally views of `inputs`) ->
        this rank's output [n, H] fp32 (a view of a buffer the next step overwrites)."""
        cfg = self.cfg
        n = x.shape[0]
        assert n <= cfg.C, f"rank {self.rank} got {n} tokens, capacity is {cfg.C}"
        timer = timer or StageTimer(self.device)
        timer.start()
        return self._run(x, ids, w, seq, timer)

    # -- after a step ----------------------------------------------------------------------------
    def _raise_on_error(self, what: str) -> None:
        from service.kernels.fused_kernels import describe_error

        code = int(self.bufs.error.item())
        if code:
            raise FusedTimeout(f"rank {self.rank}, {what}: {describe_error(code)}")

    def check_seq(self, seq: int) -> None:
        """After a step (the output was read, so no extra sync): the kernels' error flag, then every
        rank must have run the same batch."""
        self._raise_on_error(f"step seq {seq}")
        routing.check_seq(self.bufs.routing_g, seq, self.rank)

    def exposed_comm_s(self) -> float:
        """This step's exposed communication in seconds (definition in the module docstring)."""
        ns = self.bufs.stats.tolist()
        plan = self.plan
        k1 = ns[1] / max(1, plan.num_programs - plan.num_comm1)
        k2 = ns[2] / max(1, plan.num_compute2)
        return (ns[0] + k1 + k2 + ns[3]) * 1e-9

    def exposure_breakdown_s(self) -> dict[str, float]:
        ns = self.bufs.stats.tolist()
        plan = self.plan
        return {"barrier": ns[0] * 1e-9, "gates": ns[1] * 1e-9 / max(1, plan.num_programs - plan.num_comm1),
                "tail": ns[2] * 1e-9 / max(1, plan.num_compute2), "reduce_wait": ns[3] * 1e-9}
