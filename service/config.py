"""Layer shapes, presets and service settings. `Settings` reads every `MOE_*` setting from the
environment; the service's only other variables are `MOE_CACHE_DIR` (READ_ELSEWHERE below),
`XDG_CACHE_HOME` and `CC`, read by service/api/arena_objects.py to build the wire arena's C library.

Dimension letters (used in every module):
    T tokens in a batch, H hidden, I total intermediate, E experts, K top-k, R ranks,
    C token capacity per rank, Ir = I / R intermediate slice per rank,
    S rows of the gathered layout, BM = 128 row block.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.errors import ConfigError

log = logging.getLogger(__name__)

META = 4  # int32 words in front of a rank's routing block (layout: service.moe.routing)
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def round_up(x: int, n: int) -> int:
    """The smallest multiple of n that is >= x."""
    return cdiv(x, n) * n


BM = 128  # rows per block of the gathered layout; every expert's run is padded to a multiple

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

ACT_KINDS = ("silu", "gelu_tanh", "gpt_oss")
GPT_OSS_ALPHA = 1.702  # gpt-oss's default swiglu_alpha


@dataclasses.dataclass(frozen=True)
class Activation:
    """The gated activation between the two GEMMs, a compile-time choice of GEMM1's epilogue.

    With g = x @ gate^T (+ gate bias) and u = x @ up^T (+ up bias), and with `limit` set,
    g <- min(g, limit) and u <- clamp(u, -limit, limit) first (DeepSeek-V4's and gpt-oss's
    swiglu_limit; transformers clamps exactly this way):
        silu       silu(g) * u
        gelu_tanh  gelu(g, approximate="tanh") * u
        gpt_oss    (u + 1) * g * sigmoid(alpha * g)
    """

    kind: str = "silu"
    limit: float | None = None  # clamp bound; None: no clamp
    alpha: float = GPT_OSS_ALPHA  # gpt_oss only

    def __post_init__(self) -> None:
        if self.kind not in ACT_KINDS:
            raise ConfigError(f"activation must be one of {list(ACT_KINDS)}, got {self.kind!r}")
        if self.limit is not None and not self.limit > 0:
            raise ConfigError(f"activation clamp limit must be positive, got {self.limit!r}")

    def apply(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The activation in torch (the CPU path and the fp32 references; the Triton kernels have
        their own copy in GEMM1's epilogue, service.kernels.grouped_gemm.gated_act)."""
        if self.limit is not None:
            g = g.clamp(max=self.limit)
            u = u.clamp(min=-self.limit, max=self.limit)
        if self.kind == "silu":
            return torch.nn.functional.silu(g) * u
        if self.kind == "gelu_tanh":
            return torch.nn.functional.gelu(g, approximate="tanh") * u
        return (u + 1) * (g * torch.sigmoid(self.alpha * g))

    def describe(self) -> str:
        parts = [self.kind] + ([f"limit={self.limit:g}"] if self.limit is not None else []) + (
            [f"alpha={self.alpha:g}"] if self.kind == "gpt_oss" else [])
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Shape of the served MoE layer and of the rank group that serves it."""

    E: int  # experts
    H: int  # hidden size
    I: int  # noqa: E741  total intermediate size (all ranks together)
    K: int  # experts per token (top-k)
    R: int  # ranks
    C: int  # token capacity per rank and step
    dtype: torch.dtype  # compute dtype, required (every caller passes a preset's or Settings.dtype)
    act: Activation = Activation()  # the experts' gated activation (from the checkpoint's config.json)
    bias: bool = False  # per-expert biases (gpt-oss): gate/up before the activation, down after GEMM2

    def __post_init__(self) -> None:
        for name in ("E", "H", "I", "K", "R", "C"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.K > self.E:
            raise ConfigError(f"K (top-k = {self.K}) must not exceed E (experts = {self.E})")
        if self.I % self.R:
            raise ConfigError(f"I ({self.I}) must be divisible by R ({self.R}) for the tensor-parallel split")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype}")

    @property
    def Ir(self) -> int:
        return self.I // self.R

    @property
    def tokens_per_step(self) -> int:
        """The most tokens one step of the whole group takes: R * C."""
        return self.R * self.C

    @property
    def S(self) -> int:
        """Rows of the gathered layout at capacity: every hit plus the worst-case padding."""
        hits = self.R * self.C * self.K
        return round_up(hits + self.E * (BM - 1), BM)

    def replace(self, **changes) -> LayerConfig:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (f"E={self.E} H={self.H} I={self.I} K={self.K} R={self.R} C={self.C} "
                f"dtype={DTYPE_NAMES[self.dtype]} act={self.act.describe()}{' bias' if self.bias else ''}")


PRESETS: dict[str, LayerConfig] = {
    # The reference shape of the project (Hunyuan-A13B geometry, TP4 over one host).
    "seed": LayerConfig(E=64, H=4096, I=3072, K=8, R=4, C=512, dtype=torch.bfloat16),
    # The embedded default where there is no GPU: a full batch (512 tokens) in tens of ms.
    "cpu": LayerConfig(E=16, H=256, I=512, K=4, R=4, C=128, dtype=torch.float32),
}


def preset(name: str, **overrides) -> LayerConfig:
    if name not in PRESETS:
        raise ConfigError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    cfg = PRESETS[name]
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return cfg.replace(**overrides) if overrides else cfg


def httptools_installed() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The CPU cores this process can use: those it may run on (its affinity: a cpuset, `taskset`),
    capped by the CPU quota of its cgroup or any cgroup above it (a container's `--cpus`, compose's
    `cpus:`, Kubernetes' limits), rounded up; at least 1. os.cpu_count() counts the host's cores:
    by it, four CPU ranks in a 2-core container on a 64-core host took 16 intra-op threads each."""
    cpus = len(os.sched_getaffinity(0))
    for quota, period in _cpu_quotas(cgroup_root, proc_cgroup):
        cpus = min(cpus, math.ceil(quota / period))
    return max(1, cpus)


def _cpu_quotas(root: str, proc_cgroup: str) -> list[tuple[int, int]]:
    """(quota, period) of each CPU limit over this process: cgroup v2's cpu.max, v1's cfs files, from
    its own cgroup up to the hierarchy's root, wherever the hierarchy may be mounted (v2 at the root or,
    on a hybrid host, at unified/; v1's cpu controller at cpu/ or cpu,cpuacct/). None where the files
    are absent, unreadable or "max"/-1 (no limit); nothing at all if /proc/self/cgroup cannot be read
    or parsed (a server start never fails here)."""
    found = []
    try:
        with open(proc_cgroup, errors="surrogateescape") as f:
            lines = f.read().splitlines()
        for line in lines:
            _, controllers, path = line.split(":", 2)
            v2 = controllers == ""
            if not v2 and "cpu" not in controllers.split(","):
                continue
            bases = ("", "unified") if v2 else ("cpu", "cpu,cpuacct", "cpuacct,cpu")
            parts = [p for p in path.split("/") if p]
            for base in bases:
                for depth in range(len(parts), -1, -1):
                    limit = _cpu_limit(os.path.join(root, base, *parts[:depth]), v2)
                    if limit is not None:
                        found.append(limit)
    except (OSError, ValueError):
        return []
    return found


def _cpu_limit(folder: str, v2: bool) -> tuple[int, int] | None:
    """The (quota, period) a cgroup folder sets; None without one (no such files, "max", -1)."""
    try:
        if v2:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
        else:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        limit = (int(quota), int(period)) if quota != "max" else None
    except (OSError, ValueError):
        return None
    return limit if limit is not None and limit[0] > 0 and limit[1] > 0 else None


# The largest time setting, in seconds (~11.6 days: "never" for a deadline or a timeout): what the
# libraries take fits (grpc's idle option is a C int of ms, torch's store timeout a C int of ms,
# threading's waits a _PyTime_t); past it a start failed with an OverflowError, or exit 1 saying
# "Python int too large to convert to C int".
MAX_SECONDS = 1_000_000
# grpc takes its message limits and max_connections * MAX_STREAMS (service.api.grpc) as C ints: past
# these a start failed with an OverflowError traceback
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1
MAX_CONNECTIONS = 1_000_000

_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")  # RFC 1123 labels


class Settings(BaseSettings):
    """Every knob of the service; each is a flag of `moe-serve` and a `MOE_*` variable."""

    # env_ignore_empty: `MOE_PRESET=` (deploy/env.example's unset lines uncommented as they stand, a
    # compose env_file) means unset, as the example says, not an empty value that fails validation.
    # allow_inf_nan=False: "inf" passes `gt=0`, and no time setting means "never" (an infinite
    # idle_timeout_s crashed the start with a traceback, request_timeout_s made /config a 500).
    model_config = SettingsConfigDict(env_prefix="MOE_", extra="ignore", env_ignore_empty=True,
                                      allow_inf_nan=False)

    host: str = Field("0.0.0.0", description="address the HTTP and gRPC servers bind: an IPv4 or IPv6 address "
                      "(`::` every interface, IPv4 too; brackets optional) or a host name (HTTP binds its IPv4 "
                      "address, gRPC every address it resolves to)")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port: `/moe/forward`, the v2 routes, `/metrics`")
    grpc_port: int = Field(8001, ge=0, le=65535,
        description="gRPC port: `inference.GRPCInferenceService` and `grpc.health.v1`")
    metrics_port: int = Field(0, ge=0, le=65535,
                              description="separate port serving only /metrics (any other path: 404); "
                                          "0 = only on the HTTP port")
    model_name: str = Field("moe", description="model name in the v2 routes and gRPC calls (one URL path segment; "
                                               "not 'stats', which GET /v2/models/stats takes)")

    preset: str | None = Field(None, description="layer preset: cpu or seed; unset: seed on GPU, cpu otherwise")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto`: cuda when torch sees a GPU, else cpu")
    world_size: int | None = Field(
        None, ge=1, description="ranks R; default the preset's (capped by GPUs, on the CPU by usable cores)")
    capacity: int | None = Field(None, ge=1, description="tokens per rank and step C; default the preset's")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None,
        description="compute dtype; default the preset's")
    weights: str | None = Field(None,
        description="a safetensors file, a `*.safetensors.index.json` or a Hugging Face model directory (config.json "
                    "+ shards); synthetic weights when unset")
    weights_prefix: str = Field("",
        description="key prefix of the experts in a file without config.json, e.g. `model.layers.0.mlp.`")
    layer: int | None = Field(None, ge=0,
        description="decoder layer to serve from a model directory; default the first with routed experts")
    top_k: int | None = Field(None, ge=1,
        description="experts per token K for weights without config.json (default the preset's); a model directory's "
                    "config.json gives it")
    seed: int = Field(0, description="seed of the synthetic weights")
    backend: Literal["auto", "serial", "fused"] = Field("auto",
        description="layer backend; `auto`: fused where it can run, else serial (the reason is logged at start)")

    batch_delay_ms: float = Field(2.0, ge=0, le=MAX_SECONDS * 1000,
                                  description="how long the batcher waits to fill a step")
    batch_idle_wait: bool = Field(False, description="also wait batch_delay_ms when no step is running "
                                  "(off: an idle group takes a step at once; steps fill while one runs)")
    queue_tokens: int = Field(65536, ge=1,
        description="queued tokens beyond which requests get 503; also the most tokens one request may carry (a "
                    "larger one gets 413)")
    max_request_bytes: int = Field(256 << 20, ge=1024, description="largest HTTP request body; a larger one gets 413")
    grpc_max_message_bytes: int = Field(256 << 20, ge=1024, le=MAX_GRPC_MESSAGE_BYTES,
                                        description="largest gRPC message, received or sent (grpc itself "
                                                    "refuses a larger request with RESOURCE_EXHAUSTED, before "
                                                    "the service sees it)")
    request_timeout_s: float = Field(30.0, gt=0, le=MAX_SECONDS, description="default per-request deadline")
    step_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS,
        description="a step slower than this fails the group; once steps are measured the bound is the smaller "
                    "of this and max(5 s, 10x the slowest of the last 64 steps)")
    start_timeout_s: float = Field(300.0, gt=0, le=MAX_SECONDS, description="rank group start-up limit")
    drain_timeout_s: float = Field(20.0, ge=0, le=MAX_SECONDS,
                                   description="SIGTERM grace period for in-flight requests")
    restart_backoff_s: float = Field(1.0, ge=0, le=MAX_SECONDS,
        description="first delay before restarting a failed rank group; doubles on each failure, up to 30 s")
    max_restart_failures: int = Field(5, ge=0,
        description="failures of the rank group in a row (a restart that never got it ready, or a group that "
                    "failed within 60 s of turning ready: a crash loop; a group that served longer ends the row) "
                    "before the server gives up and exits with status 4, so that the orchestrator restarts or "
                    "reschedules it; 0 = never give up")
    slots: int = Field(2, ge=1, le=16, description="shared-memory batch slots per front-end process")
    copy_threads: int = Field(1, ge=1, le=16,
        description="threads of each front-end process that share a step's big copies (a request's rows into the "
                    "slot with their check, its answer out into the response's buffer or output region): a piece "
                    "of 1 MiB or more, counted in the slot's dtype, is split into min(N, rows) row ranges, a smaller "
                    "one stays whole; idle ones block, none spins; 1 copies in the step's thread")
    send_threads: int = Field(0, ge=0, le=16,
        description="threads of each front-end process that hand HTTP writes of 1 MiB or more (v2 binary answers) "
                    "to the kernel in place of the event loop (loopback TCP does the whole transmit inside send(): "
                    "~1.1-2 ms of the loop per 4 MiB); each sends what the socket takes and never waits for a slow "
                    "reader; 0 = the loop writes everything")
    rank_lookahead: int = Field(2, ge=1, le=2,
        description="steps a CUDA rank holds in flight: 2 enqueues the next step (when its message waits or "
                    "arrives before this one's layer is done) before finishing this one, so the GPU does not idle "
                    "through the host work between steps; 1 runs one at a time (CPU ranks always do)")
    rank_copy_streams: bool = Field(True,
        description="a CUDA rank copies a step's rows in and its answer out on two copy streams (through device "
                    "staging buffers) beside the layers, so the next step's layer does not wait for those copies "
                    "(one H200, T=512: +5 % group steps/s, served v2 binary +11-21 % tokens/s at c=16, gRPC "
                    "within noise); "
                    "false: every copy in the layer's stream; CPU ranks have no copy streams")
    rank_idle_spin_ms: float = Field(10.0, ge=0, le=1000,
        description="a CUDA rank with no step in flight polls for the next step's message this long after its "
                    "last message or answer before it blocks in a read: a rank idle a few ms wakes ~70-120 us later "
                    "on some hosts, on every request's path at one client; the price is a core busy while steps "
                    "keep coming (an idle server spins for this long, then sleeps); 0 = block at once; CPU ranks "
                    "never spin")
    frontends: int | None = Field(None, ge=1, le=32,
        description="front-end processes serving the HTTP and gRPC ports (SO_REUSEPORT), each with its own batcher and "
                    "slots, all feeding the one rank group; default min(4, CPU cores // 2) on a GPU host, 1 on the CPU")
    shared_memory: Literal["off", "system"] = Field("off",
        description="Triton's system shared-memory extension for clients on this host: `system` lets a client "
                    "register POSIX shared-memory objects (/dev/shm) and pass tensors through them instead of the "
                    "request and response bodies; `off` (default) refuses those calls, since the server then reads "
                    "and writes memory a client names")
    shm_direct: bool | None = Field(None,
        description="with `shared_memory: system`, the ranks read a request's hidden_states straight from the "
                    "client's input region and write its answer straight into its output region when both hold "
                    "the compute dtype: a CUDA rank maps and page-locks the region's bytes (not the object; a "
                    "region over 1 GiB, or past a step's 64 regions and 4 GiB, keeps the copies) and DMAs them; "
                    "the front end copies nothing for such a request (other requests, and regions of another "
                    "dtype, keep the front end's copies; one served T=512 request on an H200: -1.6 ms); a "
                    "request that fails (a row with NaN or infinity, a deadline, the gRPC client's own deadline) "
                    "may have had its output region written, as Triton leaves outputs unspecified on error, and "
                    "an object removed while its region stays registered is an error; unset (default): on where "
                    "the ranks are CUDA, off on CPU ranks (there each rank would read every row itself); true is "
                    "refused without shared_memory: system")
    wire_arena_mib: int | None = Field(None, ge=0, le=1024,
        description="MiB of shared memory per front-end process into which v2 binary request bodies are received "
                    "(the wire arena): the ranks read hidden_states' rows from there and write the answer there, "
                    "and the response is sent from it, so the front end copies neither way for a request whose "
                    "hidden_states are in the compute dtype and whose answer goes in the binary part (others, and "
                    "bodies that find no room, take the front end's copies: moe_wire_arena_full_total); with "
                    "wire_arena_grpc (default) its second half holds gRPC messages instead; a CUDA "
                    "rank page-locks each front end's arena once, when its group starts; unset (default): 256 "
                    "where the ranks are CUDA (2048 / front ends when that is less), 0 (off) on CPU ranks (there "
                    "each rank would read every row itself); front ends x this at most 2048")
    wire_arena_grpc: bool = Field(True,
        description="with a wire arena, its second half holds the large Python objects (64 KiB or more) the "
                    "front end's event loop makes, gRPC messages among them: CPython's object allocator is "
                    "wrapped (a C library built into the image, elsewhere on first use with the host's C "
                    "compiler and Python headers) so that the bytes grpc "
                    "receives a request into, and the response made before the step, lie where the ranks read "
                    "the rows and write the answer, and the front end copies neither way for a gRPC request "
                    "whose hidden_states are in the compute dtype in raw_input_contents (objects that find no "
                    "room stay in the process's heap); false: the whole arena serves v2 binary bodies and gRPC "
                    "requests take the front end's copies; where the library cannot be built that is logged "
                    "and the same holds")
    malloc_keep_mib: int = Field(256, ge=0, le=2047,
        description="MiB of freed memory each front-end and rank process keeps for reuse (glibc malloc: "
                    "allocations up to 32 MiB come from its heaps, each heap trimmed only past this much free; a "
                    "process has a heap per thread that allocates) instead of mapping, page-faulting and "
                    "unmapping a request's buffers anew each time (CPU stand-in, gRPC at 4 clients: +32 % "
                    "tokens/s at T=512, +24-29 % at T=2048, where 64 kept too little; the CPU default's T=512 "
                    "p50 -8 %); a process's memory then stays near its peak; 0: glibc's defaults")
    max_connections: int = Field(1000, ge=1, le=MAX_CONNECTIONS,
        description="open connections per protocol; at the limit HTTP closes the longest-idle one (or answers 503 "
                    "to the new one when every one has a request in flight), gRPC refuses new ones")
    idle_timeout_s: float = Field(30.0, gt=0, le=MAX_SECONDS,
        description="a connection without a request in flight (idle, or still sending its headers) is closed after "
                    "this")
    http_impl: Literal["httptools", "h11"] | None = Field(None, validate_default=True,
        description="HTTP/1.1 parser of the HTTP server: `httptools` (C, faster for large bodies) or `h11` (pure "
                    "Python); default httptools when it is installed, else h11")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="logging level: DEBUG, INFO, WARNING, ERROR, CRITICAL (any case)")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, v):
        return v.upper() if isinstance(v, str) else v

    @field_validator("host")
    @classmethod
    def _host_literal_or_name(cls, v: str) -> str:
        """An IP address (an IPv6 one may come in brackets, as in a URL: they are taken off) or a
        host name; anything else would fail later, in the servers' bind, with a traceback."""
        bare = v[1:-1] if v.startswith("[") and v.endswith("]") else v
        try:
            ipaddress.ip_address(bare)
            return bare
        except ValueError:
            pass
        if v is bare and _HOST_NAME.fullmatch(v) and not v.rsplit(".", 1)[-1].isdigit():  # 999.1.1.1: no name
            return v
        raise ValueError(f"must be an IP address (IPv6 with or without brackets) or a host name, got {v!r}")

    @field_validator("model_name")
    @classmethod
    def _routable_model_name(cls, v: str) -> str:
        """One path segment of the v2 routes; not "stats": GET /v2/models/stats is the statistics of
        every model (tritonclient's get_inference_statistics() with no name), so that model's
        metadata could never be read."""
        if not v or "/" in v or v != v.strip() or v in (".", ".."):
            raise ValueError(f"must be one URL path segment (no '/', no surrounding spaces), got {v!r}")
        if v == "stats":
            raise ValueError("'stats' is taken by GET /v2/models/stats (every model's statistics)")
        return v

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"must be one of {sorted(PRESETS)}")
        return v

    @field_validator("http_impl")
    @classmethod
    def _http_impl_installed(cls, v: str | None) -> str:
        if v is None:
            return "httptools" if httptools_installed() else "h11"
        if v == "httptools" and not httptools_installed():
            raise ValueError("httptools is not installed (pip install httptools), choose h11")
        return v

    @model_validator(mode="after")
    def _layer_needs_weights(self) -> Settings:
        if self.layer is not None and not self.weights:
            raise ValueError("layer picks a decoder layer of --weights (a model directory); no weights are set")
        return self

    @model_validator(mode="after")
    def _direct_needs_shared_memory(self) -> Settings:
        if self.shm_direct and self.shared_memory != "system":
            raise ValueError("shm_direct reads and writes clients' system shared-memory regions; it needs "
                             "shared_memory: system (--shared-memory system)")
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> Settings:
        ports = [p for p in (self.http_port, self.grpc_port, self.metrics_port) if p]
        if len(ports) != len(set(ports)):
            raise ValueError(f"http_port, grpc_port and metrics_port must differ, got {ports}")
        return self

    def resolve_device(self) -> tuple[str, str]:
        """The device to run on and why."""
        if self.device == "cuda":
            if not cuda_available():
                raise ConfigError("device=cuda was asked for but torch sees no CUDA device")
            return "cuda", "device=cuda was asked for"
        if self.device == "cpu":
            return "cpu", "device=cpu was asked for"
        if cuda_available():
            return "cuda", f"{torch.cuda.device_count()} CUDA device(s) found"
        return "cpu", "no CUDA device found"

    def layer_config(self, device: str) -> LayerConfig:
        """The layer shape: the preset (seed on GPU, cpu on CPU) with any overrides applied.

        With --weights, E, H, I (and K, where config.json gives it) are the checkpoint's, which
        service.moe.weights.checkpoint_layer puts in place and checks R and K against; the preset's E and I,
        which the checkpoint replaces, are widened here so as not to refuse an R or K that fits the checkpoint."""
        name = self.preset or ("seed" if device == "cuda" else "cpu")
        R = self.world_size
        if device == "cuda":
            gpus = torch.cuda.device_count()
            if R is not None and R > gpus:
                raise ConfigError(f"world_size={R} needs {R} GPUs, torch sees {gpus} (NCCL cannot share a GPU "
                                  f"between ranks)")
            if R is None and PRESETS[name].R > gpus:
                R = max(r for r in range(1, gpus + 1) if PRESETS[name].I % r == 0)
                log.warning("preset %s wants R=%d ranks, %d GPU(s) found: running R=%d", name,
                            PRESETS[name].R, gpus, R)
        C = self.capacity
        if device == "cpu" and R is None and PRESETS[name].R > (cpus := usable_cpus()):
            # More CPU ranks than cores only take turns on them (R=4 on 2 cores: a T=8 step 6.8 ->
            # 4.2 ms served, T=512 20.5 -> 16.6; bench/NOTES.md, twenty-ninth): as many ranks as
            # cores, the step's tokens (R*C) the preset's.
            base = PRESETS[name]
            R = max(r for r in range(1, cpus + 1) if base.I % r == 0 and base.R * base.C % r == 0)
            C = C or base.R * base.C // R
            log.warning("preset %s wants R=%d ranks, %d usable CPU(s): running R=%d, C=%d (--world-size %d to "
                        "keep them)", name, base.R, cpus, R, C, base.R)
        overrides = dict(R=R, C=C, K=self.top_k, dtype=DTYPES[self.dtype] if self.dtype else None)
        if self.weights:  # placeholders until checkpoint_layer: I a multiple of R, E at least K
            base = preset(name)
            overrides.update(I=math.lcm(base.I, R or base.R), E=max(base.E, self.top_k or base.K))
        return preset(name, **overrides)


def default_text(name: str) -> str:
    """A setting's default as written in the environment, for `--help` and docs/DEPLOY.md's table:
    'unset' for None (a default that depends on the host, which the description gives), '""' for
    an empty string, a byte count with its MiB."""
    value = Settings.model_fields[name].default
    if value is None:
        return "unset"
    if value == "":
        return '""'
    if name.endswith("_bytes") and isinstance(value, int) and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return str(value)


# MOE_* variables that are not settings but are read outside Settings, each by exactly this name
# (not any case, as Settings' own): unknown_variables() does not name them.
READ_ELSEWHERE = frozenset({
    "MOE_CACHE_DIR",  # service.api.arena_objects.cache_dir: where the wire arena's C library is built
})


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """MOE_* variables of the environment that name no setting (a typo such as MOE_HTTP_PROT is
    otherwise ignored without a word: extra="ignore") and are not READ_ELSEWHERE, sorted."""
    prefix = Settings.model_config["env_prefix"]
    env = os.environ if environ is None else environ
    return sorted(k for k in env
                  if k.upper().startswith(prefix) and k[len(prefix):].lower() not in Settings.model_fields
                  and k not in READ_ELSEWHERE)
