"""The rank process: joins the process group, loads its weight slice, runs steps on request.

Control messages on the rank's pipe (parent -> rank): ("step", seq, slot_index, T, sources),
("ping", seq) and ("stop",). Answers (rank -> parent): ("ready", rank, info), ("done", rank,
seq, stats), ("pong", rank, seq, None), ("refused", rank, message, "backend" | "weights") for a backend asked for that
cannot run here, and ("error", rank, traceback_text). Tensors never cross the pipe: they live in
the slots. A step's stats carry the rank's host timestamps (`stamps`: step message read, copy-in
issued, layer and the answer's copy enqueued, device done, answer in the slot, answer ready to send: its pickling and
write fall in the next phase), which the group turns into StepStats.phases.

A CUDA rank holds up to `RankOptions.lookahead` steps in flight (`_steps`): answers still come in
seq order, and a ping or stop is answered after the steps before it. With nothing in flight it polls
its pipe for `RankOptions.idle_spin_s` after its last message or answer before it blocks in a read: a
process that has slept a few ms takes ~70-120 us longer to wake on some hosts (bench/wake_probe.py), and
at one client that wake is on every request's path; the price is a core kept busy while steps keep
coming (CPU ranks never spin: their cores are the layer's).

`sources` (service.worker.direct; empty but for `--shm-direct`) name rows of the step that are not in
the slot: a client's shared-memory object holds them, and their answer goes into another. The rank
reads its rows of each source from the object itself (CUDA: DMA from the page-locked mapping of the
source's region, that region's bytes alone, registered again when the object changed; CPU: preadv
into the rows the layer reads), zeroes those that are not all finite
before the layer reads them (CUDA: on the device, in stream order, the flags copied to the host with
the step's snapshot), writes its rows of their answer into the output object (CUDA: DMA before the
lane's `done` event; CPU: pwritev once the answer is in the slot) instead of the slot, and reports
per source its first bad row or why the source could not be used (`stats["sources"]`). Before each
step (every PRUNE_S) and when pinged, it lets go of regions no step used lately and of objects the
client removed (`Objects.prune`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import select
import signal
import time
import traceback
from collections.abc import Callable

import torch

from service.config import LayerConfig
from service.errors import BackendUnavailable, WeightsError
from service.moe.hostcomm import HostPeers
from service.moe.layer import Layer, StepState
from service.moe.routing import rank_range  # the split of a step's rows (the group and tests use it from here)
from service.worker import direct
from service.worker.direct import Objects, Plan
from service.worker.malloc import keep_freed_memory

LOOPBACK_IFNAME = "lo"  # Linux's loopback interface
# A step's timestamps (StepStats.phases): CLOCK_MONOTONIC, one clock for every process of the host,
# so the group compares them with its own.
now = time.monotonic


@dataclasses.dataclass(frozen=True)
class RankOptions:
    cfg: LayerConfig
    device: str                 # "cpu" or "cuda"
    store_host: str
    store_port: int
    slot_paths: tuple[str, ...]
    weights: str | None = None
    weights_prefix: str = ""
    seed: int = 0
    backend: str = "serial"
    timeout_s: float = 300.0    # process-group timeout (collectives, rendezvous)
    threads: int = 1            # CPU threads per rank
    host: HostPeers | None = None  # CPU ranks, R > 1: the serial layer's shared-memory collectives
    log_level: str = "INFO"
    lookahead: int = 2          # CUDA ranks: steps in flight at most (1: one at a time; CPU ranks always 1)
    copy_streams: bool = False  # CUDA ranks: rows in and answers out on copy streams beside the layers
    malloc_keep_mib: int = 0    # freed memory kept for reuse (service.worker.malloc; CPU ranks allocate per step)
    idle_spin_s: float = 0.0    # CUDA ranks: poll the pipe this long after the last message or answer before blocking


def pin_slot(slot) -> None:
    """Register the slot's shared pages with CUDA (page-locked, mapped for DMA): host-device copies
    from and to it are then asynchronous DMA instead of staged copies through a driver buffer."""
    start = slot.x.data_ptr()
    end = slot.out.data_ptr() + slot.out.numel() * slot.out.element_size()
    err = torch.cuda.cudart().cudaHostRegister(start, end - start, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of slot {slot.index} ({end - start} bytes) failed: error {int(err)}")


def rank_main(rank: int, opts: RankOptions, conn) -> None:
    """Entry point of a rank process (spawned by service.worker.group)."""
    # A terminal's Ctrl-C signals the whole process group: the ranks are the owner's to stop (it drains
    # first, then sends ("stop",)); a KeyboardInterrupt here failed the requests in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=opts.log_level,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("service.worker.rank")
    keep_freed_memory(opts.malloc_keep_mib)
    try:
        _serve(rank, opts, conn, log)
    except (BackendUnavailable, WeightsError) as err:  # a refusal, not a failure: the parent reports it (once)
        with contextlib.suppress(OSError):
            conn.send(("refused", rank, str(err), "weights" if isinstance(err, WeightsError) else "backend"))
        os._exit(1)
    except BaseException:  # noqa: BLE001 - everything, KeyboardInterrupt too, goes to the parent
        text = traceback.format_exc()
        log.error("rank %d failed:\n%s", rank, text)
        try:
            conn.send(("error", rank, text))
        except OSError:
            pass
        os._exit(1)  # skip process-group teardown, which can block on dead peers
    os._exit(0)


def _serve(rank: int, opts: RankOptions, conn, log: logging.Logger) -> None:
    import torch.distributed as dist

    from service.moe.layer import make_layer
    from service.moe.weights import load_rank_weights, synthetic_rank_weights
    from service.worker.shm import Slot

    cfg = opts.cfg
    torch.set_num_threads(opts.threads)
    # The ranks share one host: their gloo / NCCL sockets listen on loopback only, never on the
    # address the host name resolves to (a container's own IP).
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    if opts.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    store = dist.TCPStore(opts.store_host, opts.store_port, world_size=None, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.R, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    t0 = time.perf_counter()
    if opts.weights:
        weights = load_rank_weights(opts.weights, cfg, rank, prefix=opts.weights_prefix, device=device)
    else:
        weights = synthetic_rank_weights(cfg, rank, opts.seed, device=device)
    log.info("weights ready in %.1f s (%s)", time.perf_counter() - t0, opts.weights or f"synthetic seed {opts.seed}")
    # The fused layer when asked for and possible, else serial (reason logged); a fused step whose
    # bounded wait expired raises FusedTimeout from check_seq, reported to the parent below.
    layer = make_layer(cfg, weights, rank=rank, device=device, backend=opts.backend, log=log, host=opts.host)
    del weights
    slots = [Slot.open(cfg, i, p) for i, p in enumerate(opts.slot_paths)]
    own = {(st.st_dev, st.st_ino) for st in map(os.stat, opts.slot_paths)}  # never a source's object
    if device.type == "cuda":
        for slot in slots:
            pin_slot(slot)
    # This rank's rows of a step, on its device, allocated once at capacity: the layer's own input
    # buffers where it has them (the fused layer's step graph stages them), else buffers of our own
    # (on the CPU the slot views are used directly).
    inputs = None
    if device.type == "cuda":
        inputs = layer.inputs or (
            torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, device=device),    # [C, H]
            torch.empty(cfg.C, cfg.K, dtype=torch.int32, device=device),  # [C, K]
            torch.empty(cfg.C, cfg.K, dtype=torch.float32, device=device))  # [C, K]
    conn.send(("ready", rank, {"pid": os.getpid(), "device": str(device), "backend": layer.name,
                               "lookahead": opts.lookahead if device.type == "cuda" else 1,
                               "copy_streams": opts.copy_streams and device.type == "cuda"}))

    # Steps run in inference mode: no autograd bookkeeping per op (a CPU rank's T=8 step: -10 %,
    # bench/NOTES.md issue 11e); every tensor a step makes lives and dies inside this loop.
    with torch.inference_mode():
        _steps(rank, cfg, opts, conn, log, layer, slots, inputs, Objects(cuda=device.type == "cuda", reserved=own))


@dataclasses.dataclass
class _Lane:
    """What a step in flight reuses, one per step the rank may hold in flight: its timer and
    snapshot (a StepState), and on CUDA the events around its rows' copy-in, after its layer and
    after its answer's copy into the slot."""

    state: StepState
    copied_in: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    layer_done: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    out_dev: torch.Tensor | None = None  # CUDA: [C, H] the answer cast into the slot's dtype
    # copy streams only: the device buffers the rows land in ([C, H], [C, K], [C, K]), copied into
    # the layer's inputs on the device
    staged: tuple[torch.Tensor, ...] | None = None
    # CUDA, sources: [C] bool rows not all finite, on the device and (pinned) on the host
    flags: tuple[torch.Tensor, torch.Tensor] | None = None
    check: _SpanCheck | None = None  # CUDA with Triton: the rows' check as one graph replay (else `_check_cuda`)


@dataclasses.dataclass
class _Step:
    """A step enqueued and not yet answered."""

    seq: int
    n: int
    out: torch.Tensor | None  # CPU: the layer's output, copied into the slot when finished; CUDA: None (enqueued)
    slot_out: torch.Tensor    # [n, H] the slot's rows for this rank's answer
    lane: _Lane
    stamps: list[float]       # message read, copy-in issued, layer and the answer's copy enqueued (finish() adds three)
    behind: bool              # enqueued while the step before it was still in flight
    overlapped: bool          # ... and that step's layer was still running on the device (CUDA)
    direct: Plan | None = None  # its sources' moves (service.worker.direct), finished in finish()
    sources: tuple = ()


def _steps(rank: int, cfg: LayerConfig, opts: RankOptions, conn, log: logging.Logger, layer: Layer, slots,
           inputs, objects: Objects | None = None) -> None:
    """The rank's loop: control messages until ("stop",); on CUDA `inputs` are the device buffers
    its rows are copied into.

    On CUDA up to opts.lookahead steps are in flight: once step n is enqueued (copy-in, layer,
    snapshot, the answer's cast and copy into the slot, an event), a step message that waits in the
    pipe, or arrives before n's layer is done (the rank polls both: it spins as a CUDA event's
    synchronize does), is read and step n+1 enqueued behind it before the rank finishes n, so the
    device does not wait for the host work between two steps. The layer's stream orders them: n+1's
    copy-in into the layer's input buffers comes after n's layer read them, and n's answer leaves the
    layer's output (cast into its lane's out_dev) before n+1 overwrites it. With opts.copy_streams
    the rows' DMA runs on an in-stream into the lane's staging buffers (the layer's stream waits for
    it, then copies them into the inputs) and the answer's DMA on an out-stream from the lane's
    out_dev (after an event behind the cast); a lane's buffers are reused only once its previous
    step is finished.
    Steps are finished (checks from their own snapshot, answer sent) in seq order; a failed check of
    step n raises here, so n+1 is never answered.
    ("ping", seq) and ("stop",) first finish what is in flight. CPU layers are synchronous: one
    step at a time.
    A step's sources (`objects` holds what they name) change where its direct rows come from and go
    to, in the same stream and the same buffers as the slot's rows (`_dma_in`, `_dma_out`)."""
    cuda = inputs is not None
    if objects is None:  # (not `or`: an empty Objects is falsy, and the caller's holds the reserved set)
        objects = Objects(cuda=cuda)
    row_bytes = cfg.H * cfg.dtype.itemsize
    private: list[torch.Tensor] = []  # CPU ranks of one host, sources: [R*C, H] the step's rows the layer reads
    depth = opts.lookahead if cuda else 1
    streams = None  # copy streams: (rows in, answers out), beside the layer's stream
    if cuda:
        device = inputs[0].device
        # Per lane (a lane's previous step is finished before the lane is reused): [C, H] the answer
        # in the slot's dtype, and with copy streams the staging buffers of its rows.
        lanes = [_Lane(layer.new_state(), (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)),
                       torch.cuda.Event(), torch.cuda.Event(),
                       out_dev=torch.empty(cfg.C, cfg.H, dtype=cfg.dtype, device=device)) for _ in range(depth)]
        if opts.copy_streams:
            streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            for lane in lanes:
                lane.staged = tuple(torch.empty_like(b) for b in inputs)
        # Compiled now, not in the first step with direct rows (~1 s cold); only where the rows are on
        # a CUDA device, as `_check_cuda` requires (the loop's CPU tests fake the CUDA surface).
        zero_bad_rows = _row_check() if device.type == "cuda" else None
        if zero_bad_rows is not None:
            zero_bad_rows(torch.zeros(1, cfg.H, dtype=cfg.dtype, device=device),
                          torch.empty(1, dtype=torch.bool, device=device))
            for lane in lanes:  # the rows' check as a graph of each lane's (the check reads the layer's inputs)
                lane.flags = _new_flags(cfg.C, device)
                lane.check = _SpanCheck(zero_bad_rows, inputs[0], lane.flags)
    else:
        lanes = [_Lane(layer.new_state())]
    in_flight: collections.deque[_Step] = collections.deque()
    last_seq = 0
    spin_s = opts.idle_spin_s if cuda else 0.0  # (a CPU rank's cores are its layer's)
    active = now()  # the rank's last message or answer: it polls for the next one until active + spin_s
    pipe = select.poll()  # (~1 us a poll; conn.poll(0) builds a selector each time)
    pipe.register(conn.fileno(), select.POLLIN)

    def finish() -> None:
        step = in_flight.popleft()
        lane = step.lane
        if step.out is None:  # CUDA: the answer's copy into the slot is enqueued
            assert lane.layer_done is not None and lane.done is not None
            try:
                lane.layer_done.synchronize()
                device_done = now()
                lane.done.synchronize()  # the answer is in the slot, the snapshot on the host, the stage times final
            except Exception as exc:  # a device fault surfaces here: name the step it surfaced in
                raise RuntimeError(f"rank {rank}, step seq {step.seq} (on the device): "
                                   f"{type(exc).__name__}: {exc}") from exc
        else:
            device_done = step.stamps[-1]  # the CPU layer's work was all in forward (launch)
            step.slot_out.copy_(step.out)
            if step.direct is not None:
                _write_cpu(step.direct, step.slot_out)
        if step.direct is not None and lane.flags is not None:
            _note_flags(step.direct, lane.flags[1], step.sources, step.direct.rows_in)
        copied_out = now()
        layer.check_seq(step.seq, lane.state)
        stages = lane.state.timer.seconds()
        if lane.copied_in is not None:  # the rows' copies ran before the layer's own timer started: they
            # count as its copy_in (the fused layer's first stage; a serial layer on CUDA reports it this way alone)
            stages["copy_in"] = stages.get("copy_in", 0.0) + lane.copied_in[0].elapsed_time(lane.copied_in[1]) / 1e3
        stats: dict[str, object] = {
            "stages": stages, "layer_s": sum(stages.values()), "exposed_comm_s": layer.exposed_comm_s(lane.state),
            "tokens": step.n, "behind": step.behind,
            "overlapped": step.overlapped, "stamps": (*step.stamps, device_done, copied_out, now())}
        if step.direct is not None:
            stats["sources"] = step.direct.report
        conn.send(("done", rank, step.seq, stats))

    def message_first() -> bool:
        """With a lane free, wait until a message waits (True) or the oldest step's layer is done
        (False): a step message that arrives while the device computes is enqueued at once."""
        if len(in_flight) == depth:
            return False
        layer_done = in_flight[0].lane.layer_done
        while True:
            if conn.poll(0):
                return True
            if layer_done is None or layer_done.query():
                return False

    while True:
        if in_flight and not message_first():
            finish()  # no lane free, or the oldest step's layer done first: its answer first
            active = now()
            continue
        if spin_s > 0 and not in_flight:
            while now() - active < spin_s and not pipe.poll(0):
                pass
        msg = conn.recv()
        received = active = now()
        if msg[0] in ("stop", "ping"):  # their answers keep their place after the steps before them
            while in_flight:
                finish()
            if msg[0] == "stop":
                log.info("stopping after seq %d", last_seq)
                objects.close()
                return
            objects.prune(force=True)  # (idle: nothing in flight uses them)
            conn.send(("pong", rank, last_seq, None))
            continue
        _, seq, slot_index, T, *more = msg
        sources = more[0] if more else ()
        try:
            if seq != last_seq + 1:
                raise RuntimeError(f"rank {rank} expected seq {last_seq + 1}, got {seq}")
            last_seq = seq
            lane = lanes[seq % depth]  # steps finish in seq order, so this lane's previous step is finished
            slot = slots[slot_index]
            start, n = rank_range(T, cfg.R, rank)
            rows = slice(start, start + n)
            x, ids, w = slot.x[rows], slot.ids[rows], slot.w[rows]
            # CPU ranks of one host read every row of the step: each reads every source's rows (into
            # rows of its own, the same on every rank); a rank writes its own rows of the answer
            rows_in = (0, T) if opts.host is not None else (start, n)
            objects.prune()  # every PRUNE_S: regions no step used lately, objects removed (under load too)
            plan = direct.plan(sources, objects, row_bytes, rows_in, (start, n)) if sources else None
            if opts.host is not None:  # CPU ranks of one host: the layer reads every rank's rows from the slot
                x, ids, w = slot.x[:T], slot.ids[:T], slot.w[:T]
                if plan is not None:
                    if not private:
                        private.append(torch.empty_like(slot.x))
                    x = private[0][:T].copy_(x)
            if not cuda:
                if plan is not None:
                    _read_cpu(plan, x, sources, rows_in)
            elif streams is not None and lane.copied_in is not None and lane.staged is not None:
                # CUDA, copy streams: DMA from the pinned slot into this lane's staging buffers on the
                # in-stream (it runs while the step ahead computes), then one device copy into the layer's
                # inputs in the layer's stream (after the step ahead read them)
                assert inputs is not None
                with torch.cuda.stream(streams[0]):
                    lane.copied_in[0].record()
                    staged = [_dma_in(lane.staged[0][:n], x, plan, row_bytes),
                              *(buf[:n].copy_(src, non_blocking=True)
                                for buf, src in zip(lane.staged[1:], (ids, w), strict=True))]
                    lane.copied_in[1].record()
                torch.cuda.current_stream(inputs[0].device).wait_event(lane.copied_in[1])
                x, ids, w = (buf[:n].copy_(src) for buf, src in zip(inputs, staged, strict=True))
            elif lane.copied_in is not None:  # CUDA: DMA from the pinned slot, in stream order before the step
                assert inputs is not None
                lane.copied_in[0].record()
                x = _dma_in(inputs[0][:n], x, plan, row_bytes)
                ids, w = (buf[:n].copy_(src, non_blocking=True)
                          for buf, src in zip(inputs[1:], (ids, w), strict=True))
                lane.copied_in[1].record()
            if cuda and plan is not None and plan.span is not None:
                if lane.flags is None:
                    lane.flags = _new_flags(cfg.C, x.device)
                if lane.check is not None and lane.check.covers(x):
                    lane.check.run(*plan.span)
                else:
                    _check_cuda(x, plan, lane.flags)
            issued = now()
            result = layer.forward(x, ids, w, seq, state=lane.state)  # (its snapshot: into lane.state)
            out: torch.Tensor | None = result
            if streams is not None and lane.out_dev is not None and lane.layer_done is not None \
                    and lane.done is not None:
                # CUDA, copy streams: cast into this lane's buffer in the layer's stream, DMA into the
                # slot on the out-stream (the next step's layer does not wait for it)
                lane.out_dev[:n].copy_(result)
                lane.layer_done.record()
                streams[1].wait_event(lane.layer_done)
                with torch.cuda.stream(streams[1]):
                    _dma_out(lane.out_dev[:n], slot.out[rows], plan, row_bytes)
                    lane.done.record()
                out = None
            elif lane.out_dev is not None and lane.layer_done is not None and lane.done is not None:
                # CUDA: cast on the device (half the bytes to move), DMA into the slot
                lane.layer_done.record()
                _dma_out(lane.out_dev[:n].copy_(result), slot.out[rows], plan, row_bytes)
                lane.done.record()
                out = None
            ahead = in_flight[-1].lane.layer_done if in_flight else None  # the step before, if still in flight
            in_flight.append(_Step(seq, n, out, slot.out[rows], lane, [received, issued, now()], bool(in_flight),
                                   ahead is not None and not ahead.query(), plan, sources))
        except Exception as exc:  # the steps before it are answered first (or fail on their own), so the
            while in_flight:  # owner's error names the step that failed, not the one it was behind
                finish()
            raise RuntimeError(f"rank {rank}, step seq {seq}: {type(exc).__name__}: {exc}") from exc


def _read_cpu(plan: Plan, x: torch.Tensor, sources, rows_in: tuple[int, int]) -> None:
    """CPU: the sources' rows into x (the rows the layer reads), checked; a failed source's zeroed."""
    for a, b in plan.zero:
        x[a:b].zero_()
    for m in plan.reads:
        try:
            direct.read_rows(m, x[m.a:m.b])
        except direct.SourceError as err:  # shrank since the plan's check: the request's error alone
            plan.report[m.source] = ("in", err.code, str(err))
            x[m.a:m.b].zero_()
            continue
        direct.check_rows(x, m, rows_in[0] + m.a - sources[m.source][0], plan.report)


def _write_cpu(plan: Plan, slot_out: torch.Tensor) -> None:
    """CPU: the rank's rows of each source's answer (in slot_out, the slot's dtype) into its output object."""
    for m in plan.writes:
        if isinstance(plan.report.get(m.source), tuple):  # its rows were never read
            continue
        try:
            direct.write_rows(m, slot_out[m.a:m.b])
        except direct.SourceError as err:
            plan.report[m.source] = ("out", err.code, str(err))


def _dma_in(dst: torch.Tensor, slot_rows: torch.Tensor, plan: Plan | None, row_bytes: int) -> torch.Tensor:
    """CUDA, in the current stream: dst [n, H] on the device <- the rank's rows, from the pinned slot
    and, for the sources' rows, from their objects' page-locked mappings (bytes: no view of a client's
    offset as the dtype is needed); a failed source's rows zeroed. Returns dst."""
    if plan is None or not (plan.reads or plan.zero):
        return dst.copy_(slot_rows, non_blocking=True)
    at = 0
    parts = sorted([(m.a, m.b, m) for m in plan.reads] + [(a, b, None) for a, b in plan.zero], key=lambda p: p[0])
    for a, b, move in parts:
        if at < a:
            dst[at:a].copy_(slot_rows[at:a], non_blocking=True)
        if move is None:
            dst[a:b].zero_()
        else:
            dst[a:b].view(torch.uint8).copy_(move.entry.view(move.at, b - a, row_bytes), non_blocking=True)
        at = b
    if at < dst.shape[0]:
        dst[at:].copy_(slot_rows[at:], non_blocking=True)
    return dst


def _dma_out(src: torch.Tensor, slot_rows: torch.Tensor, plan: Plan | None, row_bytes: int) -> None:
    """CUDA, in the current stream: the answer's rows src [n, H] (the slot's dtype, on the device) into
    the slot, and each source's rows into its output object's page-locked mapping instead."""
    writes = sorted(plan.writes, key=lambda m: m.a) if plan is not None else []
    at = 0
    for m in writes:
        if at < m.a:
            slot_rows[at:m.a].copy_(src[at:m.a], non_blocking=True)
        m.entry.view(m.at, m.b - m.a, row_bytes).copy_(src[m.a:m.b].view(torch.uint8), non_blocking=True)
        at = m.b
    if at < src.shape[0]:
        slot_rows[at:].copy_(src[at:], non_blocking=True)


def _check_cuda(x: torch.Tensor, plan: Plan, flags: tuple[torch.Tensor, torch.Tensor]) -> None:
    """CUDA, in the layer's stream before it reads x [n, H]: flag the rows over the sources' span that
    are not all finite, zero them, and copy the flags to the (pinned) host for finish(). Two calls: one
    launch (service.kernels.finite_rows) and the flags' copy; without Triton (or on CPU tensors, as the
    plan's CPU tests pass) the same result from torch calls. A CUDA rank with Triton runs the same as
    its lane's graph (`_SpanCheck`) where x starts at the graph's buffer; this is the other way."""
    span = plan.span
    assert span is not None
    lo, hi = span
    bad = flags[0][lo:hi]  # [r]
    zero_bad_rows = _row_check() if x.is_cuda else None
    if zero_bad_rows is not None:
        zero_bad_rows(x[lo:hi], bad)
    else:
        bad.copy_(torch.isfinite(x[lo:hi]).all(dim=1)).logical_not_()
        x[lo:hi].masked_fill_(bad[:, None], 0)
    flags[1][lo:hi].copy_(bad, non_blocking=True)


def _new_flags(C: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A lane's flags: [C] bool on the device, and their (pinned) copy on the host."""
    return torch.empty(C, dtype=torch.bool, device=device), torch.empty(C, dtype=torch.bool, pin_memory=True)


class _SpanCheck:
    """`_check_cuda` for one lane as a CUDA graph: the span's copy from pinned words (written by `run`
    just before the replay), the check's launch over every row of the layer's input buffer x [C, H]
    (each program outside the span returns at once), and all C flags' copy to the host. One replay
    where the eager way takes the Triton launcher and a copy (~94 us of host time a step on the
    serving guests, bench/rank_pieces_probe.py). The span's words are rewritten at each replay: safe,
    since a lane is reused only once its previous step is finished, so the copy that read them ran.
    Flags outside the span keep older values; `_note_flags` reads the plan's reads alone, inside it."""

    def __init__(self, zero_bad_rows: Callable[..., None], x: torch.Tensor, flags: tuple[torch.Tensor, torch.Tensor]):
        self._x = x.data_ptr()
        self._span = torch.zeros(2, dtype=torch.int32, pin_memory=True)
        self._span_np = self._span.numpy()  # written without a torch op
        span = torch.zeros(2, dtype=torch.int32, device=x.device)
        # Every buffer the graph reads or writes stays referenced here as long as the graph: a freed one
        # would be handed to another tensor, which each replay would then overwrite (the span's 8 bytes)
        self._buffers = (x, flags, span)
        zero_bad_rows(x, flags[0], span)  # compiled before the capture (an empty span: nothing read or written)
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(x.device)
        stream = torch.cuda.Stream(x.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            span.copy_(self._span, non_blocking=True)
            zero_bad_rows(x, flags[0], span)
            flags[1].copy_(flags[0], non_blocking=True)
        current.wait_stream(stream)
        torch.cuda.synchronize(x.device)

    def covers(self, x: torch.Tensor) -> bool:
        """x (the step's rows) starts where the graph's buffer does."""
        return x.data_ptr() == self._x

    def run(self, lo: int, hi: int) -> None:
        """In the current stream: the rows [lo, hi) checked (bad ones zeroed), the flags on their way to the host."""
        self._span_np[:] = (lo, hi)
        self.graph.replay()


@functools.cache
def _row_check() -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """The one-launch check of `_check_cuda`, or None where Triton is not importable (logged once)."""
    try:
        from service.kernels.finite_rows import zero_bad_rows
    except ImportError as err:
        logging.getLogger("service.worker.rank").debug(
            "triton is not importable (%s): the direct rows' device check runs as torch calls", err)
        return None
    return zero_bad_rows


def _note_flags(plan: Plan, flags: torch.Tensor, sources, rows_in: tuple[int, int]) -> None:
    """CUDA, after the step's sync: each read's first flagged row into the plan's report."""
    seen = flags.numpy()  # the pinned flags, read without a torch op per read (~10 us each on the serving guests)
    for m in plan.reads:
        bad = seen[m.a:m.b].nonzero()[0]
        if bad.size:
            direct.note_bad(plan.report, m, rows_in[0] + m.a - sources[m.source][0], int(bad[0]))
