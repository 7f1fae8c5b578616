"""Large Python objects placed in the wire arena: gRPC messages received where the ranks read them,
and their responses made where the ranks write the answer (`--wire-arena-grpc`).

T tokens, H hidden.

A v2 binary body is received into the wire arena by our own code (service.api.connections). A gRPC
message is not: grpc's Cython layer gathers the received slices into one `bytes` object it
allocates itself, and takes the response as a `bytes` object, so without this both lie in the front
end's private heap, and the front end copies a request's rows into the step's slot (with their
check) and the answer out of it into the response: two host copies of T x H per request (on one
H100 host, T=512 bf16: ~1.4 ms of a request's ~13 ms; bench/NOTES.md, fourteenth session).

CPython lets a process wrap its object allocator (PyMem_SetAllocator on PYMEM_DOMAIN_OBJ: what
tracemalloc does); every `bytes` object's memory comes from it. service/api/arena_alloc.c (built into
the image by its install step, `prebuild`; elsewhere compiled on first use with the host's C compiler
and the Python headers, as Triton compiles its launcher) maps a window of the arena's file and places
there each new object of at least MIN_BYTES, while it has room; the rest, and what finds no room, goes
to CPython's own allocator as before. A received message of T=512 rows and the response made before the
step (service.api.grpc_codec.grpc_response) then lie in the arena, `WireArena.place` finds their rows,
and the batcher hands them to the ranks as a source like any arena piece: the ranks read the rows from
the message and write the answer into the response's bytes, which grpc then sends.

The window is the arena's second half (`WireArena.adopt_objects`); it is mapped by the C library
itself and never unmapped, since a placed object may be freed at any time, interpreter shutdown
included. Lifetimes are Python's: an object's block is free when the object is, and whatever holds
its rows for a step (the request's tensors, the batcher's job, a failed step's retired tensors)
holds the object. The hook is per process and for the process's life: installed once, by a front
end's server, before any rank maps the arena.

Only the objects of the thread that installed the window are placed: the front end's event loop, on
which grpc.aio receives its messages (cygrpc's receive ends with `bytes(bytearray)` in the coroutine
that awaited the batch) and the handlers make their responses. Large objects of other threads (the step
thread's, a copy thread's) stay in the heap, and so do the loop's small ones; what else of 64 KiB or
more the loop makes (an HTTP JSON body's str, a large dict's table) lands there too: most of it lives
for one request, and all of it is counted like the rest (the window's figures are exported:
`moe_wire_arena_objects_*`).

A child forked from the process afterwards (the ranks and front ends are spawned, not forked; this is
for anything else, a multiprocessing pool among them) gets a private copy of the window's blocks as
they were at the fork, at the same address (arena_alloc.c's pthread_atfork handlers: the copy is
taken in the parent, ~0.1 s a fork for ~120 MiB live), so neither its refcounts nor its frees reach
the parent's objects, and it places nothing new there.

The process's memory debug hooks (PYTHONMALLOC=debug) sit under this one: they see every allocation but
the placed ones, and they stop the process if a placed block is ever freed through another domain (a
server test runs under them); tracemalloc started before the install is refused (its stop() would put
back the allocator it saved, and a placed object's free would then reach the heap's free())."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("arena_alloc.c")
MIN_BYTES = 64 << 10  # an object this large or larger is placed in the window (T=8 bf16 at H=4096)
STATS = ("used_bytes", "blocks", "free_extents", "placed_total", "no_room_total")

_library: ctypes.PyDLL | None = None
_installed = False


def cache_dir() -> Path:
    """Where the compiled library is kept: $MOE_CACHE_DIR, else $XDG_CACHE_HOME/moe-serve, else
    ~/.cache/moe-serve."""
    if os.environ.get("MOE_CACHE_DIR"):
        return Path(os.environ["MOE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-serve"


def _library_name() -> str:
    """The compiled library's file name: one per source, Python headers and Python build."""
    include = sysconfig.get_paths()["include"]
    key = hashlib.sha256(SOURCE.read_bytes() + include.encode() + sys.version.encode()).hexdigest()[:16]
    return f"arena_alloc-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def prebuild() -> Path:
    """Build the library beside its source, where `library` looks first (the image's install step:
    no compile at a front end's start, no writable cache needed). OSError when it cannot be built."""
    path = SOURCE.with_name(_library_name())
    if not path.exists():
        _compile(path, sysconfig.get_paths()["include"])
    return path


def library() -> ctypes.PyDLL:
    """The compiled arena_alloc.c: prebuilt beside its source (`prebuild`), else built on first use
    into cache_dir() (OSError saying why when it cannot be: no C compiler, no Python headers). Loaded
    with PyDLL: its calls keep the GIL, which the allocator's state relies on."""
    global _library
    if _library is not None:
        return _library
    include = sysconfig.get_paths()["include"]
    path = SOURCE.with_name(_library_name())
    if not path.exists():
        path = cache_dir() / path.name
    if not path.exists():
        _compile(path, include)
    try:
        lib = ctypes.PyDLL(str(path), use_errno=True)
    except OSError as err:  # a build that does not load (truncated, another libc): built again, once, in
        # the cache (a prebuilt one's directory may not be writable: the image's site-packages)
        log.warning("rebuilding %s, which does not load: %s", path, err)
        path = cache_dir() / path.name
        _compile(path, include)
        lib = ctypes.PyDLL(str(path), use_errno=True)
    lib.moe_arena_objects_install.restype = ctypes.c_size_t
    lib.moe_arena_objects_install.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
    lib.moe_arena_objects_arm.restype = None
    lib.moe_arena_objects_arm.argtypes = (ctypes.c_int,)
    lib.moe_arena_objects_stats.restype = None
    lib.moe_arena_objects_stats.argtypes = (ctypes.POINTER(ctypes.c_size_t),)
    _library = lib
    return lib


def _compile(path: Path, include: str) -> None:
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError(f"no Python headers in {include} (install python3-dev) to build {SOURCE.name}")
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]  # (CC may carry a wrapper or flags: "ccache gcc")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")  # renamed into place: front ends build at once
    os.close(fd)
    try:
        run = subprocess.run([*cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", tmp],
                             capture_output=True, text=True, timeout=120)
        if run.returncode:
            raise OSError(f"{shlex.join(cc)} could not build {SOURCE.name}: {run.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    except FileNotFoundError:
        raise OSError(f"no C compiler ({shlex.join(cc)}) to build {SOURCE.name}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def install(fd: int, offset: int, length: int, min_bytes: int = MIN_BYTES) -> int:
    """Place the objects of `min_bytes` or more that the calling thread makes (`arm` for another) in
    bytes offset..offset+length of the file `fd` from now on: the window's address (OSError when it
    cannot be, or is already, installed)."""
    global _installed
    if _installed:
        raise OSError("this process has its objects' window already (one per process, for its life)")
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        raise OSError("this Python runs without the GIL, which the allocator's state relies on")
    import tracemalloc

    if tracemalloc.is_tracing():  # its stop() would restore the allocator it saved, dropping the hook
        raise OSError("tracemalloc is tracing: its stop() would unhook the window's frees")
    lib = library()
    ctypes.set_errno(0)
    at = lib.moe_arena_objects_install(fd, offset, length, min_bytes)
    if not at:
        err = ctypes.get_errno()
        raise OSError(err, f"the objects' window could not be installed: {os.strerror(err) if err else 'refused'}")
    _installed = True
    return at


def arm(on: bool = True) -> None:
    """Place the large objects the calling thread makes from now on (or stop: `on` False). The
    installing thread is armed already; a no-op where no window is installed."""
    if _installed and _library is not None:
        _library.moe_arena_objects_arm(int(on))


def stats() -> dict[str, int]:
    """The window's figures (STATS); all 0 where none is installed."""
    if _library is None:
        return dict.fromkeys(STATS, 0)
    out = (ctypes.c_size_t * len(STATS))()
    _library.moe_arena_objects_stats(out)
    return dict(zip(STATS, out, strict=True))
