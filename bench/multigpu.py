"""Issue 7 on a 4-GPU host: the fused layer against the serial NCCL baseline at R=4, and a load
client for a running moe-serve.

    python bench/multigpu.py layer [--capacities 512,1024] [--routings balanced,skewed] [--steps 200]
                                   [--json PATH] [--dry-run | --cpu-smoke]
    python bench/multigpu.py load --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001
                                  [--sizes 512,2048] [--concurrency 4] [--seconds 5] [--bench-json PATH]

`layer`: R processes (torch.multiprocessing spawn), one per GPU, each joining an NCCL group the way
service.worker.rank does (a TCPStore hosted by the parent, `device_id` bound); FusedLayer makes its
symmetric-memory rendezvous on that group. A second, gloo group gives a host barrier before every
timed step, so that the ranks launch each step within tens of microseconds of one another.
Shape: the seed preset (E=64, H=4096, I=3072, Ir=768, K=8, R=4, bf16) at each capacity C, every
rank holding C tokens (full steps), random weights, the same inputs for every layer. Per rank:
  serial        SerialLayer: NCCL all-gather, CUDA schedule op, Triton grouped GEMMs, combine,
                NCCL reduce-scatter. Eager: it is not graph-captured (it stages a host tensor per step).
  fused         FusedLayer: one CUDA-graph replay per step (the rows written once into its input buffers,
                as the rank writes them; the stage kernel inside the graph moves them).
  compute-only  FusedLayer(sync=False), graph: the same programs moving the same bytes with every
                wait removed (output discarded).
  fused eager   FusedLayer(graph=False) with stage marks (stage, exchange, tables, kernel1, kernel2, reduce).
  tables        the schedule builder alone on the step's global routing (isolated, eager).
A step's time is CUDA events around `forward` on each rank; the layer's time for the step is the
maximum over the ranks (its output is complete when the slowest rank is); tables print the p50 of
that over --steps steps after WARMUP, and the JSON keeps every rank's p50 too.
Exposed communication: fused, in the kernels (`FusedLayer.exposed_comm_s`, as /metrics reports it)
and as fused - compute-only; serial, the time in its collectives (all_gather + reduce_scatter).
Targets (issue 7): fused <= 0.80 x serial; exposed communication <= 5 % of the fused layer.

`load`: back-to-back requests from --concurrency threads (one connection each) through gRPC
(`inference.GRPCInferenceService/ModelInfer`, raw contents) and HTTP v2 with the binary tensor
extension, tokens/s and p50/p99 latency per size; then the server's /metrics, scraped before and
after, give the steps' exposed-communication histogram, compared with the `layer` figure. Needs only
grpcio and the standard library (not tritonclient), so it runs where the service runs.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import os
import statistics
import sys
import time
import urllib.parse
from pathlib import Path

# Run as a script: the repository's root on sys.path for the `bench.` imports below.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import loadstats  # noqa: E402
from bench.fused_layer import own_inputs  # noqa: E402
from service.config import LayerConfig, preset  # noqa: E402

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
TARGET_RATIO = 0.80     # fused / serial
TARGET_EXPOSED = 0.05   # exposed communication / fused layer time
WARMUP = 20             # untimed steps per layer and routing (clocks, caches, NCCL channels)
EAGER_STEPS = 50        # steps of the eager fused layer (stage breakdown only)
SAME_OUTPUT_TOL = 1e-2  # fused vs serial on the same inputs: both bf16 GEMMs with fp32 sums
CALL_TIMEOUT_S = 60.0   # one request of the load client


# ---------------------------------------------------------------------------------------------
# layer: one process per GPU
# ---------------------------------------------------------------------------------------------


def _inputs(cfg: LayerConfig, kind: str, dev: torch.device, seed: int):
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = cfg.C
    x = torch.randn(T, cfg.H, device=dev, generator=gen).to(cfg.dtype)            # [C, H]
    if kind == "balanced":
        ids = torch.rand(T, cfg.E, device=dev, generator=gen).argsort(dim=1)[:, :cfg.K]  # [C, K]
    else:  # skewed: expert e with probability ~ 1 / (e + 1)^2 (tests.helpers.routing)
        probs = 1.0 / (torch.arange(cfg.E, device=dev, dtype=torch.float32) + 1) ** 2  # [E]
        ids = torch.multinomial(probs.expand(T, cfg.E).contiguous(), cfg.K, replacement=False, generator=gen)
    w = torch.softmax(torch.randn(T, cfg.K, device=dev, generator=gen), dim=1)     # [C, K]
    return x, ids.int(), w


def _random_weights(cfg: LayerConfig, dev: torch.device, rank: int):
    from service.moe.weights import RankWeights

    gen = torch.Generator(device=dev).manual_seed(rank)
    w13 = torch.randn(cfg.E, cfg.H, 2 * cfg.Ir, device=dev, generator=gen) / cfg.H ** 0.5   # [E, H, 2*Ir]
    w2 = torch.randn(cfg.E, cfg.Ir, cfg.H, device=dev, generator=gen) / cfg.Ir ** 0.5       # [E, Ir, H]
    return RankWeights(w13=w13.to(cfg.dtype), w2=w2.to(cfg.dtype))


def _stopwatch(dev: torch.device):
    """Start timing now; the returned function waits for the work and gives seconds."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()

        def stop() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return stop
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


class _Runner:
    """Times `forward` of one layer on this rank, continuing its batch sequence numbers."""

    def __init__(self, layer, dev: torch.device, host_group, check: bool = True):
        self.layer, self.dev, self.host, self.check, self.seq = layer, dev, host_group, check, 0

    def steps(self, x, ids, w, n: int, warmup: int = WARMUP, timer=None, after=None):
        import torch.distributed as dist

        x, ids, w = own_inputs(self.layer, x, ids, w)
        times, extra = [], []
        for i in range(warmup + n):
            dist.barrier(group=self.host)
            self.seq += 1
            stop = _stopwatch(self.dev)
            out = self.layer.forward(x, ids, w, seq=self.seq, timer=timer)
            dt = stop()
            if self.check:  # the kernels' error flag (FusedTimeout) and the group's seq
                self.layer.check_seq(self.seq)
            if i >= warmup:
                times.append(dt)
                if after:
                    extra.append(after())
        return times, extra, out


def _median_stages(stage_dicts: list[dict]) -> dict:
    keys = stage_dicts[0].keys() if stage_dicts else ()
    return {k: statistics.median(d.get(k, 0.0) for d in stage_dicts) for k in keys}


def _bench_capacity(cfg: LayerConfig, weights, rank: int, dev: torch.device, host, args) -> list[dict]:
    import torch.distributed as dist

    from service.moe.serial import COLLECTIVE_STAGES, SerialLayer
    from service.moe.timing import StageTimer

    group = dist.group.WORLD
    gpu = dev.type == "cuda"
    serial = _Runner(SerialLayer(cfg, weights, rank=rank, device=dev, group=group, gemm="auto"), dev, host)
    runners = {}
    if gpu:
        from service.moe.fused import FusedLayer

        runners["fused"] = _Runner(FusedLayer(cfg, weights, rank=rank, device=dev, group=group), dev, host)
        # No waits, so no consistent routing either: check_seq would (rightly) object.
        runners["compute"] = _Runner(FusedLayer(cfg, weights, rank=rank, device=dev, group=group, sync=False),
                                     dev, host, check=False)
        runners["eager"] = _Runner(FusedLayer(cfg, weights, rank=rank, device=dev, group=group, graph=False),
                                   dev, host)
    rows = []
    for r_i, kind in enumerate(args.routings.split(",")):
        x, ids, w = _inputs(cfg, kind, dev, seed=1000 * cfg.C + 10 * rank + r_i)
        row: dict = {"C": cfg.C, "routing": kind, "rank": rank}
        timer = StageTimer(dev)
        t, stages, out_serial = serial.steps(x, ids, w, args.steps, timer=timer, after=timer.seconds)
        out_serial = out_serial.clone()
        row["serial"] = t
        row["serial_stages"] = _median_stages(stages)
        row["serial_comm"] = [sum(s.get(k, 0.0) for k in COLLECTIVE_STAGES) for s in stages]
        row["gemm"] = serial.layer.gemms.impl
        if gpu:
            from service.kernels import schedule
            from service.moe.fused import build_step_tables

            fused = runners["fused"]
            t, exposed, out = fused.steps(x, ids, w, args.steps, after=fused.layer.exposed_comm_s)
            row["fused"], row["exposed_in_kernel"] = t, exposed
            row["exposure_breakdown"] = fused.layer.exposure_breakdown_s()
            row["same_output_rel_diff"] = float((out - out_serial).norm() / out_serial.norm())
            if not row["same_output_rel_diff"] <= SAME_OUTPUT_TOL:
                raise RuntimeError(f"rank {rank} C={cfg.C} {kind}: fused and serial outputs differ by "
                                   f"{row['same_output_rel_diff']:.2e} (relative)")
            row["compute_only"], _, _ = runners["compute"].steps(x, ids, w, args.steps)
            timer = StageTimer(dev)
            eager = runners["eager"]
            row["eager"], stages, _ = eager.steps(x, ids, w, min(EAGER_STEPS, args.steps), timer=timer,
                                                  after=timer.seconds)
            row["eager_stages"] = _median_stages(stages)
            tables = []
            for i in range(WARMUP + args.steps):  # fused.bufs.routing_g holds the last step's routing
                stop = _stopwatch(dev)
                build_step_tables(fused.layer.bufs)
                if i >= WARMUP:
                    tables.append(stop())
            row["tables"] = tables
            row["tables_impl"] = ("cuda op" if schedule.use_cuda_op(fused.layer.bufs.routing_views()[1], cfg.E)
                                  else "torch builder")
            row["plan"] = str(fused.layer.plan)
        rows.append(row)
    dist.barrier(group=host)  # nobody frees symmetric memory a peer may still read
    return rows


def _rank_main(rank: int, args, port: int) -> None:
    os.environ.update(ENV)
    import torch.distributed as dist

    gpu = not args.cpu_smoke
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank, world_size=args.ranks,
                            timeout=timeout, **({"device_id": dev} if gpu else {}))
    host = dist.new_group(backend="gloo") if gpu else dist.group.WORLD
    base = _layer_shape(args)
    weights = _random_weights(base, dev, rank)
    rows = []
    for C in (int(c) for c in args.capacities.split(",")):
        rows += _bench_capacity(base.replace(C=C), weights, rank, dev, host, args)
        if gpu:
            torch.cuda.empty_cache()
    gathered: list = [None] * args.ranks
    dist.all_gather_object(gathered, rows, group=host)
    if rank == 0:
        _report(gathered, base, args, dev)
    dist.barrier(group=host)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown, which can block on a peer that already left


def _layer_shape(args) -> LayerConfig:
    if args.cpu_smoke:  # the harness on gloo with a tiny fp32 layer: serial only
        return LayerConfig(E=8, H=64, I=32 * args.ranks, K=2, R=args.ranks, C=16, dtype=torch.float32)
    return preset("seed").replace(R=args.ranks)


def _p50_max(per_rank: list[list[float]]) -> float:
    """p50 over steps of the slowest rank's time of each step."""
    return statistics.median(max(ts) for ts in zip(*per_rank, strict=True))


def _report(gathered: list[list[dict]], base: LayerConfig, args, dev: torch.device) -> None:
    us = 1e6
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"\ndevice: {args.ranks} x {name}, torch {torch.__version__}; {base.describe()} (C varies); "
          f"p50 of {args.steps} steps of the per-step max over ranks; serial eager, fused one graph replay per step")
    summary = []
    for i, row0 in enumerate(gathered[0]):
        rows = [g[i] for g in gathered]
        C = row0["C"]
        flops = 2 * base.R * C * base.K * base.H * 3 * base.Ir  # per rank: all N tokens' hits, GEMM1 + GEMM2
        s = {"C": C, "routing": row0["routing"], "gemm": row0["gemm"], "flops_per_rank": flops}
        s["serial_s"] = _p50_max([r["serial"] for r in rows])
        s["serial_rank_p50_s"] = [statistics.median(r["serial"]) for r in rows]
        s["serial_comm_s"] = _p50_max([r["serial_comm"] for r in rows])
        s["serial_stages_rank0_s"] = row0["serial_stages"]
        if "fused" in row0:
            s["fused_s"] = _p50_max([r["fused"] for r in rows])
            s["fused_rank_p50_s"] = [statistics.median(r["fused"]) for r in rows]
            s["compute_only_s"] = _p50_max([r["compute_only"] for r in rows])
            s["exposed_diff_s"] = s["fused_s"] - s["compute_only_s"]
            s["exposed_in_kernel_rank0_p50_s"] = statistics.median(row0["exposed_in_kernel"])
            s["exposed_in_kernel_rank0_mean_s"] = statistics.fmean(row0["exposed_in_kernel"])
            s["exposed_in_kernel_max_s"] = _p50_max([r["exposed_in_kernel"] for r in rows])
            s["exposure_breakdown_rank0_s"] = row0["exposure_breakdown"]
            s["eager_s"] = _p50_max([r["eager"] for r in rows])
            s["eager_stages_rank0_s"] = row0["eager_stages"]
            s["tables_s"] = statistics.median(row0["tables"])
            s["tables_impl"] = row0["tables_impl"]
            s["same_output_rel_diff_max"] = max(r["same_output_rel_diff"] for r in rows)
            s["plan"] = row0["plan"]
        summary.append(s)

    print("\n| C | routing | serial (us) | fused (us) | fused / serial | target <= 0.80 | compute-only (us) "
          "| fused TFLOP/s per GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summary:
        if "fused_s" not in s:
            print(f"| {s['C']} | {s['routing']} | {s['serial_s'] * us:.0f} | n/a | - | - | - | - |")
            continue
        ratio = s["fused_s"] / s["serial_s"]
        print(f"| {s['C']} | {s['routing']} | {s['serial_s'] * us:.0f} | {s['fused_s'] * us:.0f} | {ratio:.3f} | "
              f"{'met' if ratio <= TARGET_RATIO else 'MISSED'} | {s['compute_only_s'] * us:.0f} | "
              f"{s['flops_per_rank'] / s['fused_s'] / 1e12:.0f} |")
    print("\n| C | routing | exposed = fused - compute-only (us) | in-kernel exposed, rank 0 / max (us) "
          "| exposed / fused | target <= 5% | serial collectives (us) | schedule tables (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summary:
        if "fused_s" not in s:
            print(f"| {s['C']} | {s['routing']} | - | - | - | - | {s['serial_comm_s'] * us:.0f} | - |")
            continue
        worst = max(s["exposed_diff_s"], s["exposed_in_kernel_max_s"]) / s["fused_s"]
        print(f"| {s['C']} | {s['routing']} | {s['exposed_diff_s'] * us:.0f} | "
              f"{s['exposed_in_kernel_rank0_p50_s'] * us:.0f} / {s['exposed_in_kernel_max_s'] * us:.0f} | "
              f"{s['exposed_diff_s'] / s['fused_s']:.1%} / {s['exposed_in_kernel_max_s'] / s['fused_s']:.1%} | "
              f"{'met' if worst <= TARGET_EXPOSED else 'MISSED'} | {s['serial_comm_s'] * us:.0f} | "
              f"{s['tables_s'] * us:.1f} ({s['tables_impl']}) |")
    print()
    for s in summary:
        fmt = lambda d: ", ".join(f"{k} {v * us:.0f}" for k, v in d.items())  # noqa: E731
        print(f"C={s['C']} {s['routing']}: serial stages rank 0 (us): {fmt(s['serial_stages_rank0_s'])}; "
              f"per-rank p50 {[round(t * us) for t in s['serial_rank_p50_s']]}")
        if "fused_s" in s:
            print(f"C={s['C']} {s['routing']}: fused per-rank p50 {[round(t * us) for t in s['fused_rank_p50_s']]}; "
                  f"eager fused {s['eager_s'] * us:.0f} us, stages rank 0: {fmt(s['eager_stages_rank0_s'])}; "
                  f"in-kernel breakdown rank 0: {fmt(s['exposure_breakdown_rank0_s'])}; "
                  f"fused vs serial output max rel diff {s['same_output_rel_diff_max']:.1e}")
    if summary and "plan" in summary[0]:
        print(f"fused plan: {summary[0]['plan']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "ranks": args.ranks, "steps": args.steps, "shape": base.describe(),
                       "targets": {"fused_over_serial": TARGET_RATIO, "exposed_over_fused": TARGET_EXPOSED},
                       "results": summary}, f, indent=1)
    sys.stdout.flush()


def _dry_run(args) -> None:
    from service.moe.fused_buffers import Layout

    base = _layer_shape(args)
    how = "gloo, CPU" if args.cpu_smoke else "NCCL + symmetric memory, one GPU each"
    print(f"plan: {args.ranks} spawned ranks ({how}), {base.describe()}; env {ENV}")
    for C in (int(c) for c in args.capacities.split(",")):
        cfg = base.replace(C=C)
        flops = 2 * cfg.R * C * cfg.K * cfg.H * 3 * cfg.Ir
        item = cfg.dtype.itemsize  # symmetric region (tokens, pulled, routing, staging, flags) + D, act, inputs
        layer_bytes = (Layout(cfg.R, C, cfg.H, cfg.K, item).nbytes
                       + cfg.S * (cfg.H + cfg.Ir) * item + C * cfg.H * item)
        print(f"  C={C}: N={cfg.R * C} tokens, S={cfg.S} gathered rows, {flops / 1e9:.0f} GFLOP per rank, "
              f"~{layer_bytes / 2**30:.2f} GiB of buffers per fused layer; routings {args.routings}: "
              f"serial {args.steps} steps, fused {args.steps} replays, compute-only {args.steps}, "
              f"eager {min(EAGER_STEPS, args.steps)}, tables {args.steps}; {WARMUP} warm-ups each")


def run_layer(args) -> int:
    if args.dry_run:
        _dry_run(args)
        return 0
    os.environ.update(ENV)
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not args.cpu_smoke:
        gpus = torch.cuda.device_count()
        if gpus < args.ranks:
            print(f"layer: {args.ranks} ranks need {args.ranks} GPUs, torch sees {gpus}", file=sys.stderr)
            return 1
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.pg_timeout))
    ctx = mp.spawn(_rank_main, args=(args, store.port), nprocs=args.ranks, join=False)
    deadline = time.monotonic() + args.timeout
    try:
        while not ctx.join(timeout=max(1.0, min(10.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                print(f"layer: the ranks did not finish within {args.timeout:.0f} s: killing them", file=sys.stderr)
                for p in ctx.processes:
                    p.kill()
                return 1
    except Exception as exc:  # noqa: BLE001 - a rank raised or died; torch has stopped the others
        print(f"layer: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# load: a running moe-serve
# ---------------------------------------------------------------------------------------------


def _http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", u.path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _wait_ready(url: str, wait_s: float, server_pid: int | None) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < wait_s:
        if server_pid:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"the server (pid {server_pid}) exited before it was ready") from None
        try:
            if _http_get(url + "/v2/health/ready")[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not ready within {wait_s:.0f} s")


def _tensors(cfg: LayerConfig, T: int, seed: int):
    """fp32 hidden states, int32 ids, fp32 weights as numpy arrays
    (bench/serve_load.py --wire-dtype fp32 sends the same)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.H, generator=gen)                                                  # [T, H]
    ids = torch.stack([torch.randperm(cfg.E, generator=gen)[:cfg.K] for _ in range(T)]).int()  # [T, K]
    w = torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1)                            # [T, K]
    return [("hidden_states", x.numpy(), "FP32"), ("topk_ids", ids.numpy(), "INT32"),
            ("topk_weights", w.numpy(), "FP32")]


def _check_output(shape, raw: bytes, T: int, H: int, what: str, finite: bool) -> None:
    if list(shape) != [T, H] or len(raw) != T * H * 4:
        raise RuntimeError(f"{what}: output shape {list(shape)} with {len(raw)} bytes, expected [{T}, {H}] fp32")
    if finite:
        import numpy as np

        if not np.isfinite(np.frombuffer(raw, dtype=np.float32)).all():
            raise RuntimeError(f"{what}: non-finite values in the output")


def _grpc_caller(target: str, model: str, tensors, T: int, H: int):
    import grpc

    from service.api.proto import grpc_predict_v2_pb2 as pb
    from service.api.proto import grpc_predict_v2_pb2_grpc as pb_grpc

    limit = 256 << 20  # the server's default grpc_max_message_bytes
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", limit),
                                                     ("grpc.max_receive_message_length", limit)])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    req = pb.ModelInferRequest(model_name=model)
    for name, arr, dt in tensors:
        req.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
        req.raw_input_contents.append(arr.tobytes())

    def call(finite: bool = False) -> None:
        resp = stub.ModelInfer(req, timeout=CALL_TIMEOUT_S)
        _check_output(resp.outputs[0].shape, resp.raw_output_contents[0], T, H, "grpc", finite)
    return call


def _v2_binary_caller(url: str, model: str, tensors, T: int, H: int):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=CALL_TIMEOUT_S)
    doc = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": dt, "parameters": {"binary_data_size": a.nbytes}}
                      for n, a, dt in tensors],
           "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}
    header = json.dumps(doc).encode()
    body = header + b"".join(a.tobytes() for _, a, _ in tensors)
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}

    def post():
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        r = conn.getresponse()
        return r, r.read()

    def call(finite: bool = False) -> None:
        try:
            r, data = post()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            conn.close()  # the server closed an idle keep-alive connection: the next request reconnects
            r, data = post()
        if r.status != 200:
            raise RuntimeError(f"v2_binary: HTTP {r.status}: {data[:300]!r}")
        n = int(r.getheader("Inference-Header-Content-Length"))
        _check_output(json.loads(data[:n])["outputs"][0]["shape"], data[n:], T, H, "v2_binary", finite)
    return call


def _histograms(text: str) -> dict:
    """{(metric, backend): {"buckets": [(le, cumulative)], "sum": s, "count": n}} of the moe_ histograms."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram" or fam.name not in ("moe_exposed_comm_seconds", "moe_layer_seconds"):
            continue
        for s in fam.samples:
            h = out.setdefault((fam.name, s.labels.get("backend", "")), {"buckets": [], "sum": 0.0, "count": 0.0})
            if s.name.endswith("_bucket"):
                h["buckets"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
            elif s.name.endswith("_count"):
                h["count"] = s.value
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for key, h in after.items():
        b = before.get(key, {"buckets": [(le, 0.0) for le, _ in h["buckets"]], "sum": 0.0, "count": 0.0})
        pairs = zip(sorted(h["buckets"]), sorted(b["buckets"]), strict=True)
        out[key] = {"buckets": [(le, c - cb) for (le, c), (_, cb) in pairs],
                    "sum": h["sum"] - b["sum"], "count": h["count"] - b["count"]}
    return out


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile: linear within the bucket holding the q-th observation."""
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    rank, lo, prev = q * total, 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * (rank - prev) / max(cum - prev, 1e-12)
        lo, prev = le, cum
    return lo


def run_load(args) -> int:
    cfg = preset(args.preset)
    ready_s = _wait_ready(args.url, args.wait_s, args.server_pid)
    print(f"server {args.url} ready after {ready_s:.1f} s of waiting; {cfg.describe()}; concurrency "
          f"{args.concurrency}; {args.seconds:g} s per cell; fp32 in and out")
    before = _histograms(_http_get(args.url + "/metrics")[1].decode())
    results = []
    for T in (int(s) for s in args.sizes.split(",")):
        tensors = _tensors(cfg, T, seed=T)
        for proto in ("grpc", "v2_binary"):
            make = _grpc_caller if proto == "grpc" else _v2_binary_caller
            callers = [make(args.grpc if proto == "grpc" else args.url, args.model, tensors, T, cfg.H)
                       for _ in range(args.concurrency)]
            for call in callers:
                call(finite=True)  # warm-up: connection, first allocations; checks the values once
            lats, wall = loadstats.measure(callers, args.seconds)
            results.append({"protocol": proto, "T": T, **loadstats.summary(lats, wall, T)})
    after = _histograms(_http_get(args.url + "/metrics")[1].decode())

    print("\n| protocol | T | requests | tokens/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['protocol']} | {r['T']} | {r['requests']} | {r['tok_s']:.0f} | {r['p50_ms']:.1f} "
              f"| {r['p99_ms']:.1f} |")

    hist = _delta(after, before)
    bench = None
    if args.bench_json and os.path.exists(args.bench_json):
        with open(args.bench_json) as f:
            rows = json.load(f)["results"]
        bench = next((r for r in rows if r["C"] == cfg.C and r["routing"] == "balanced"), None)
    print("\n/metrics over the load's steps (rank 0's figures, as the service records them):")
    metrics = {}
    for (name, backend), h in sorted(hist.items()):
        if h["count"] <= 0:
            continue
        b = sorted(h["buckets"])
        m = {"steps": h["count"], "mean_s": h["sum"] / h["count"], "p50_s": _quantile(0.5, b),
             "p99_s": _quantile(0.99, b)}
        metrics[f"{name}{{backend={backend}}}"] = m
        print(f"  {name}{{backend=\"{backend}\"}}: {m['steps']:.0f} steps, mean {m['mean_s'] * 1e6:.0f} us, "
              f"p50 ~{m['p50_s'] * 1e6:.0f} us, p99 ~{m['p99_s'] * 1e6:.0f} us (bucket interpolation)")
    exposed = {k: v for k, v in metrics.items() if k.startswith("moe_exposed_comm_seconds")}
    if not exposed:
        print("  no step was recorded: the metric comparison is void")
    if bench and exposed:
        fused = (f"fused in-kernel rank 0 mean {bench['exposed_in_kernel_rank0_mean_s'] * 1e6:.0f} us, p50 "
                 f"{bench['exposed_in_kernel_rank0_p50_s'] * 1e6:.0f} us, fused - compute-only "
                 f"{bench['exposed_diff_s'] * 1e6:.0f} us; " if "fused_s" in bench else "no fused figures; ")
        for key, m in exposed.items():
            print(f"  {key}: service mean {m['mean_s'] * 1e6:.0f} us vs bench/multigpu.py layer (C={cfg.C}, "
                  f"balanced, full steps): {fused}serial collectives {bench['serial_comm_s'] * 1e6:.0f} us")
    elif exposed:
        print(f"  nothing to compare with: no C={cfg.C} balanced row in {args.bench_json}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": results, "metrics": metrics, "bench": bench}, f, indent=1)
    return 0 if exposed else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    lay = sub.add_parser("layer", help="fused vs serial at R ranks, one process per GPU")
    lay.add_argument("--ranks", type=int, default=4)
    lay.add_argument("--capacities", default="512,1024", help="tokens per rank C, comma-separated")
    lay.add_argument("--routings", default="balanced,skewed", help="balanced and/or skewed")
    lay.add_argument("--steps", type=int, default=200, help="timed steps per layer (graph replays for fused)")
    lay.add_argument("--json", help="write the figures here")
    lay.add_argument("--timeout", type=float, default=300.0, help="kill the ranks after this many seconds")
    lay.add_argument("--pg-timeout", type=float, default=120.0, help="process-group and store timeout (s)")
    lay.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    lay.add_argument("--cpu-smoke", action="store_true",
                     help="the harness on CPU: gloo ranks, tiny fp32 layer, serial only")
    load = sub.add_parser("load", help="gRPC and HTTP v2 binary load on a running moe-serve, and its /metrics")
    load.add_argument("--url", default="http://127.0.0.1:8000", help="the server's HTTP base URL")
    load.add_argument("--grpc", default="127.0.0.1:8001", help="the server's gRPC host:port")
    load.add_argument("--model", default="moe")
    load.add_argument("--preset", default="seed", help="the layer shape the server runs (for H, K, E, C)")
    load.add_argument("--sizes", default="512,2048", help="tokens per request, comma-separated")
    load.add_argument("--concurrency", type=int, default=4)
    load.add_argument("--seconds", type=float, default=5.0, help="time per (protocol, size) cell")
    load.add_argument("--wait-s", type=float, default=240.0, help="how long to wait for readiness")
    load.add_argument("--server-pid", type=int, help="fail at once if this process exits before it is ready")
    load.add_argument("--bench-json", help="the layer JSON to compare the exposed communication with")
    load.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if args.command == "layer":
        if args.ranks < 1 or args.steps < 1:
            p.error("--ranks and --steps must be positive")
        bad = set(args.routings.split(",")) - {"balanced", "skewed"}
        if bad:
            p.error(f"--routings: unknown {sorted(bad)}")
        return run_layer(args)
    return run_load(args)


if __name__ == "__main__":
    sys.exit(main())
