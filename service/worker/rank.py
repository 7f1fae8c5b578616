"""The rank process: joins the process group, loads its weight slice, runs steps on request.

Control messages on the rank's pipe (parent -> rank): ("step", seq, slot_index, T),
("ping", seq) and ("stop",). Answers (rank -> parent): ("ready", rank, info), ("done", rank,
seq, stats), ("pong", rank, seq, None), ("refused", rank, message) for a backend asked for that
cannot run here, and ("error", rank, traceback_text). Tensors never cross the pipe: they live in
the slots. A step's stats carry the rank's host timestamps (`stamps`: step message read, copy-in
issued, layer and the answer's copy enqueued, device done, answer in the slot, answer ready to send: its pickling and
write fall in the next phase), which the group turns into StepStats.phases.

A CUDA rank holds up to `RankOptions.lookahead` steps in flight (`_steps`): answers still come in
seq order, and a ping or stop is answered after the steps before it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import logging
import os
import time
import traceback

import torch

from service.config import LayerConfig
from service.errors import BackendUnavailable
from service.moe.hostcomm import HostPeers
from service.moe.layer import Layer, StepState
from service.moe.routing import rank_range  # the split of a step's rows (the group and tests use it from here)

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
    logging.basicConfig(level=opts.log_level,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("service.worker.rank")
    try:
        _serve(rank, opts, conn, log)
    except BackendUnavailable as err:  # a refusal, not a failure: the parent reports it (once)
        with contextlib.suppress(OSError):
            conn.send(("refused", rank, str(err)))
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
        _steps(rank, cfg, opts, conn, log, layer, slots, inputs)


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


def _steps(rank: int, cfg: LayerConfig, opts: RankOptions, conn, log: logging.Logger, layer: Layer, slots,
           inputs) -> None:
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
    step at a time."""
    cuda = inputs is not None
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
    else:
        lanes = [_Lane(layer.new_state())]
    in_flight: collections.deque[_Step] = collections.deque()
    last_seq = 0

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
        copied_out = now()
        layer.check_seq(step.seq, lane.state)
        stages = lane.state.timer.seconds()
        if lane.copied_in is not None:  # the rows' copies ran before the layer's own timer started: they
            # count as its copy_in (the fused layer's first stage; a serial layer on CUDA reports it this way alone)
            stages["copy_in"] = stages.get("copy_in", 0.0) + lane.copied_in[0].elapsed_time(lane.copied_in[1]) / 1e3
        stats = {"stages": stages, "layer_s": sum(stages.values()), "exposed_comm_s": layer.exposed_comm_s(lane.state),
                 "tokens": step.n, "behind": step.behind,
                 "overlapped": step.overlapped, "stamps": (*step.stamps, device_done, copied_out, now())}
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
            continue
        msg = conn.recv()
        received = now()
        if msg[0] in ("stop", "ping"):  # their answers keep their place after the steps before them
            while in_flight:
                finish()
            if msg[0] == "stop":
                log.info("stopping after seq %d", last_seq)
                return
            conn.send(("pong", rank, last_seq, None))
            continue
        _, seq, slot_index, T = msg
        try:
            if seq != last_seq + 1:
                raise RuntimeError(f"rank {rank} expected seq {last_seq + 1}, got {seq}")
            last_seq = seq
            lane = lanes[seq % depth]  # steps finish in seq order, so this lane's previous step is finished
            slot = slots[slot_index]
            start, n = rank_range(T, cfg.R, rank)
            rows = slice(start, start + n)
            x, ids, w = slot.x[rows], slot.ids[rows], slot.w[rows]
            if opts.host is not None:  # CPU ranks of one host: the layer reads every rank's rows from the slot
                x, ids, w = slot.x[:T], slot.ids[:T], slot.w[:T]
            elif streams is not None and lane.copied_in is not None and lane.staged is not None:
                # CUDA, copy streams: DMA from the pinned slot into this lane's staging buffers on the
                # in-stream (it runs while the step ahead computes), then one device copy into the layer's
                # inputs in the layer's stream (after the step ahead read them)
                assert inputs is not None
                with torch.cuda.stream(streams[0]):
                    lane.copied_in[0].record()
                    staged = [buf[:n].copy_(src, non_blocking=True)
                              for buf, src in zip(lane.staged, (x, ids, w), strict=True)]
                    lane.copied_in[1].record()
                torch.cuda.current_stream(inputs[0].device).wait_event(lane.copied_in[1])
                x, ids, w = (buf[:n].copy_(src) for buf, src in zip(inputs, staged, strict=True))
            elif lane.copied_in is not None:  # CUDA: DMA from the pinned slot, in stream order before the step
                assert inputs is not None
                lane.copied_in[0].record()
                x, ids, w = (buf[:n].copy_(src, non_blocking=True)
                             for buf, src in zip(inputs, (x, ids, w), strict=True))
                lane.copied_in[1].record()
            issued = now()
            result = layer.forward(x, ids, w, seq, lane.state.timer)
            layer.snapshot(lane.state)
            out: torch.Tensor | None = result
            if streams is not None and lane.out_dev is not None and lane.layer_done is not None \
                    and lane.done is not None:
                # CUDA, copy streams: cast into this lane's buffer in the layer's stream, DMA into the
                # slot on the out-stream (the next step's layer does not wait for it)
                lane.out_dev[:n].copy_(result)
                lane.layer_done.record()
                streams[1].wait_event(lane.layer_done)
                with torch.cuda.stream(streams[1]):
                    slot.out[rows].copy_(lane.out_dev[:n], non_blocking=True)
                    lane.done.record()
                out = None
            elif lane.out_dev is not None and lane.layer_done is not None and lane.done is not None:
                # CUDA: cast on the device (half the bytes to move), DMA into the slot
                lane.layer_done.record()
                slot.out[rows].copy_(lane.out_dev[:n].copy_(result), non_blocking=True)
                lane.done.record()
                out = None
            ahead = in_flight[-1].lane.layer_done if in_flight else None  # the step before, if still in flight
            in_flight.append(_Step(seq, n, out, slot.out[rows], lane, [received, issued, now()], bool(in_flight),
                                   ahead is not None and not ahead.query()))
        except Exception as exc:  # the steps before it are answered first (or fail on their own), so the
            while in_flight:  # owner's error names the step that failed, not the one it was behind
                finish()
            raise RuntimeError(f"rank {rank}, step seq {seq}: {type(exc).__name__}: {exc}") from exc
