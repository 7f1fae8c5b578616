"""Large Python objects in the wire arena (service.api.arena_objects, service/api/arena_alloc.c,
--wire-arena-grpc): gRPC messages received where the ranks read them, responses made where they
write the answer.

The allocator, in processes of their own (its hook is for a process's life): objects of MIN_BYTES or
more land in the arena's second half and smaller ones do not; a block is reused only once its object
is gone, and the free space merges back into one extent; objects that find no room go to the heap and
are counted; realloc moves a block out when it grows or shrinks far, and keeps its bytes; the
object's file keeps its ctime under writes through the window (a rank would register it again);
a second window in one process is refused; only the armed thread's objects are placed; a forked
child works on a private copy (the parent's refcounts, bytes, books and ctime unchanged); tracemalloc
tracing refuses the install; CC with arguments, and a cached build that does not load is rebuilt. A
real server (CPU ranks, fp32) with a small arena over gRPC: concurrent answers right and equal to solo
ones, a solo request's rows counted as the ranks' (moe_wire_arena_rows_total grows by T), a small
request, another dtype and a NaN row as before (the copies; its 400); the window's figures exported
and back to empty once answered; under PYTHONMALLOC=debug no block freed through another domain; with
--wire-arena-grpc false gRPC takes the copies while v2 binary bodies keep the arena.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from service.api import arena_objects
from tests.api.common import check, check_like_solo, inputs
from tests.api.test_e2e import triton_inputs
from tests.api.test_wire_arena import full_count, metric_value, v2_binary
from tests.helpers import side_by_side
from tests.serverproc import ServerProcess

NAN = float("nan")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One build of the library for the module's processes; skipped (failed in CI) where it cannot be built."""
    path = tmp_path_factory.mktemp("moe-cache")
    run = isolated("from service.api import arena_objects; arena_objects.library()", path)
    if run.returncode:
        if os.environ.get("CI") == "true":  # (as tests.helpers.external_tool; .ci/run sets it)
            pytest.fail(f"the arena's object allocator cannot be built in CI: {run.stderr[-2000:]}")
        pytest.skip(f"the arena's object allocator cannot be built here: {run.stderr[-300:]}")
    return path


def isolated(code: str, cache_dir) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (the hook stays for its life), with the library's cache."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MOE_CACHE_DIR": str(cache_dir)})


def ran_ok(run: subprocess.CompletedProcess) -> None:
    """The code exited 0, having printed "ok" last."""
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ok"), run.stdout + run.stderr


ISOLATED: dict[str, str] = {}  # test name -> the code it runs in a fresh interpreter


def in_isolation(code: str):
    """The decorated test's `code`, for `isolated_runs` to run in a fresh interpreter (`isolated`) side
    by side with the other tests' (~2-3 s each, most of it one core importing torch); the test checks
    what it did (its `ran` fixture)."""
    def register(test):
        ISOLATED[test.__name__] = code
        return test
    return register


@pytest.fixture(scope="module")
def isolated_runs(cache):
    """Every test's code of `in_isolation`, run side by side once the first test asks: test name -> Future."""
    with side_by_side({name: functools.partial(isolated, code, cache)
                       for name, code in ISOLATED.items()}) as futures:
        yield futures


@pytest.fixture
def ran(isolated_runs, request) -> subprocess.CompletedProcess:
    """What the requesting test's code of `in_isolation` did in its fresh interpreter."""
    return isolated_runs[request.function.__name__].result()


EXPECT_REFUSED = """
def expect_refused(arena, why):
    try:
        arena.adopt_objects()
    except OSError as err:
        assert why in str(err), err
    else:
        raise AssertionError(f"the window was installed ({why})")
    assert len(arena._windows) == 1 and arena._free == [(0, arena.size)]  # unchanged: all for the blocks
"""

PRELUDE = EXPECT_REFUSED + """
import ctypes, gc, os, random, warnings
import torch
from service.api import arena_objects
from service.api.arena import PAGE, WireArena
from service.api.grpc_codec import bytes_to_fill

warnings.simplefilter("ignore", UserWarning)  # torch.frombuffer of bytes
MIN = arena_objects.MIN_BYTES
arena = WireArena(64 * MIN)
arena.adopt_objects()
stats = arena_objects.stats

def placed(b):
    return arena.place(torch.frombuffer(b, dtype=torch.uint8)) is not None
"""


@in_isolation(PRELUDE + textwrap.dedent("""
    big, small = bytes_to_fill(MIN), bytes_to_fill(MIN - 64)
    assert placed(big) and not placed(small)
    at = arena.place(torch.frombuffer(big, dtype=torch.uint8))[2]
    assert at >= arena.size // 2, at  # the objects' half: the blocks keep the first
    joined = b"".join([b"a" * MIN, b"b" * MIN])  # as grpc gathers a message's slices
    assert placed(joined) and joined[:1] == b"a" and joined[-1:] == b"b"
    assert stats()["blocks"] == 2
    del big, joined
    s = stats()
    assert s["blocks"] == 0 and s["used_bytes"] == 0 and s["free_extents"] == 1, s
    print("ok")
    """))
def test_large_objects_land_in_the_window_and_come_back_when_gone(ran):
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    rng = random.Random(7)
    live = {}
    for step in range(3000):
        if live and (len(live) > 40 or rng.random() < 0.45):
            key = rng.choice(list(live))
            b, fill = live.pop(key)
            assert b == bytes([fill]) * len(b), key
            del b
            continue
        n = rng.choice([rng.randrange(1, MIN), rng.randrange(MIN, 5 * MIN)])
        b = bytes_to_fill(n)
        fill = step % 251
        torch.frombuffer(b, dtype=torch.uint8).fill_(fill)
        live[step] = (b, fill)
        if step % 100 == 0:
            for b, f in live.values():
                assert b == bytes([f]) * len(b)
    s = stats()
    assert s["placed_total"] > 100 and s["no_room_total"] > 0, s  # some found the window full
    live.clear()
    gc.collect()
    s = stats()
    assert s["blocks"] == 0 and s["used_bytes"] == 0 and s["free_extents"] == 1, s
    print("ok")
    """))
def test_blocks_never_overlap_a_live_object_and_merge_back(ran):
    """Random sizes (half below MIN), random frees, every live object's pattern intact throughout."""
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    held = [bytes_to_fill(4 * MIN) for _ in range(12)]  # the window: 32 x MIN, blocks a page more each
    where = [placed(b) for b in held]
    assert where[:7] == [True] * 7 and not any(where[8:]), where
    assert stats()["no_room_total"] >= 4
    print("ok")
    """))
def test_a_full_window_sends_objects_to_the_heap(ran):
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    api = ctypes.pythonapi
    api.PyObject_Malloc.restype = api.PyObject_Realloc.restype = ctypes.c_void_p
    api.PyObject_Malloc.argtypes = (ctypes.c_size_t,)
    api.PyObject_Realloc.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    api.PyObject_Free.argtypes = (ctypes.c_void_p,)
    base, length = arena._windows[1][0], arena._windows[1][2]
    inside = lambda p: base <= p < base + length

    def filled(p, n):
        ctypes.memmove(p, bytes(range(256)) * (n // 256), n)

    def same(p, n):
        return ctypes.string_at(p, n) == (bytes(range(256)) * (n // 256))[:n]

    p = api.PyObject_Malloc(2 * MIN)
    assert inside(p)
    filled(p, 2 * MIN)
    q = api.PyObject_Realloc(p, 2 * MIN - 4096)  # shrinks a little: stays
    assert q == p and same(q, 2 * MIN - 4096)
    r = api.PyObject_Realloc(q, 3 * MIN)  # grows past its block: moves out, bytes kept
    assert not inside(r) and same(r, 2 * MIN - 4096) and stats()["blocks"] == 0
    api.PyObject_Free(r)
    p = api.PyObject_Malloc(2 * MIN)
    filled(p, 2 * MIN)
    q = api.PyObject_Realloc(p, 1024)  # shrinks far below MIN: moves out
    assert not inside(q) and same(q, 1024) and stats()["blocks"] == 0
    api.PyObject_Free(q)
    print("ok")
    """))
def test_realloc_moves_a_block_out_only_when_it_must_and_keeps_its_bytes(ran):
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    import time
    before = os.fstat(arena.fd)
    time.sleep(0.05)
    objects = [bytes_to_fill(3 * MIN) for _ in range(8)]
    for b in objects:
        torch.frombuffer(b, dtype=torch.uint8).fill_(3)
    after = os.fstat(arena.fd)
    assert (after.st_ctime_ns, after.st_size) == (before.st_ctime_ns, before.st_size)
    print("ok")
    """))
def test_writes_through_the_window_leave_the_files_ctime(ran):
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    other = WireArena(64 * MIN)
    expect_refused(other, "already")
    other.close()
    print("ok")
    """))
def test_a_second_window_in_one_process_is_refused(ran):
    ran_ok(ran)


# ---- a real server --------------------------------------------------------------------------------


def rows_count(url: str) -> float:
    return metric_value(url, "moe_wire_arena_rows_total")


def grpc_answer(url: str, x, ids, w, dtype_name: str = "FP32") -> torch.Tensor:
    client = grpcclient.InferenceServerClient(url)
    result = client.infer("moe", triton_inputs(grpcclient, x, ids, w, dtype_name))
    out = result.as_numpy("output")
    if dtype_name == "BF16":  # (ml_dtypes' bfloat16: exact in fp32)
        return torch.from_numpy(out.astype("float32")).bfloat16()
    return torch.from_numpy(out.copy())


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache):
    with ServerProcess.serving(tmp_path_factory.mktemp("objects") / "server.log", "--wire-arena-mib", "4",
                               env={**os.environ, "MOE_CACHE_DIR": str(cache)}) as proc:
        yield proc


def test_grpc_requests_in_the_arena_are_answered_right_and_their_rows_are_the_ranks(server):
    """The cpu preset (fp32, H=256: 1 KiB a row), a 4 MiB arena (2 MiB for objects): a request of T=100
    is a 100 KiB message and a 100 KiB response, both placed; eight at once, some find the window full."""
    assert "its last 2 MiB hold gRPC messages" in server.log(), server.log()[-2000:]
    url, grpc_url = server.url, server.grpc_url
    work = [inputs(100, 800 + i) for i in range(8)] + [inputs(700, 900)]
    results: list = [None] * len(work)

    def run(i: int) -> None:
        results[i] = grpc_answer(grpc_url, *work[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in enumerate(results):
        check(out, *work[i])
    for i in (0, 3, 8):  # each alone: its rows read from its message, its answer written into the response
        before = rows_count(url)
        solo = grpc_answer(grpc_url, *work[i])
        assert rows_count(url) == before + work[i][0].shape[0], i
        check_like_solo(results[i], solo, what=i)


def test_what_the_arena_does_not_take_is_answered_by_the_copies(server):
    url, grpc_url = server.url, server.grpc_url
    before = rows_count(url)
    x, ids, w = inputs(8, 950)  # an 8 KiB message: below MIN_BYTES, in the heap
    check(grpc_answer(grpc_url, x, ids, w), x, ids, w)
    x, ids, w = inputs(100, 951, torch.bfloat16)  # BF16 rows on an fp32 layer: the copies convert them
    out = grpc_answer(grpc_url, x, ids, w, "BF16")
    assert out.dtype == torch.bfloat16
    check(out, x, ids, w)
    assert rows_count(url) == before


def test_a_nan_row_in_a_placed_message_gets_its_400(server):
    x, ids, w = inputs(100, 960)
    x[37, 3] = NAN
    with pytest.raises(InferenceServerException) as info:
        grpc_answer(server.grpc_url, x, ids, w)
    assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert "hidden_states contains NaN or infinity (row 37)" in info.value.message()
    x, ids, w = inputs(100, 961)  # and the next one is answered
    check(grpc_answer(server.grpc_url, x, ids, w), x, ids, w)


def test_with_the_flag_off_grpc_takes_the_copies_and_v2_keeps_the_arena(tmp_path, cache):
    with ServerProcess.serving(tmp_path / "server.log", "--wire-arena-mib", "4", "--wire-arena-grpc", "false",
                               env={**os.environ, "MOE_CACHE_DIR": str(cache)}) as proc:
        assert "hold gRPC messages" not in proc.log()
        x, ids, w = inputs(100, 970)
        before = rows_count(proc.url)
        check(grpc_answer(proc.grpc_url, x, ids, w), x, ids, w)
        assert rows_count(proc.url) == before
        status, out = v2_binary(proc.url, x, ids, w)
        assert status == 200 and rows_count(proc.url) == before + 100, out
        assert full_count(proc.url) == 0


def test_under_the_debug_allocator_no_placed_block_is_freed_through_another_domain(tmp_path, cache):
    """PYTHONMALLOC=debug: CPython's hooks check that each block is freed through the domain it came
    from, so a placed message freed with PyMem_Free by grpc's Cython layer, protobuf or torch would stop
    the front end (the hook sits above them: a placed block carries none of their marks). Concurrent
    gRPC requests through the window, answered right, and the server still up."""
    env = {**os.environ, "MOE_CACHE_DIR": str(cache), "PYTHONMALLOC": "debug"}
    with ServerProcess.serving(tmp_path / "server.log", "--wire-arena-mib", "4", env=env) as proc:
        assert "hold gRPC messages" in proc.log()
        work = [inputs(100, 980 + i) for i in range(6)]
        before = rows_count(proc.url)
        with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
            answers = list(pool.map(lambda job: grpc_answer(proc.grpc_url, *job), work))
        for out, job in zip(answers, work, strict=True):
            check(out, *job)
        assert rows_count(proc.url) > before  # some went through the window
        x, ids, w = inputs(100, 986)
        check(grpc_answer(proc.grpc_url, x, ids, w), x, ids, w)  # and it is still up
    assert "Fatal Python error" not in proc.log(), proc.log()[-3000:]


def test_the_library_is_built_once_per_source_and_python(cache):
    built = list(cache.glob("arena_alloc-*"))
    assert len(built) == 1, built
    assert arena_objects.SOURCE.exists()


@in_isolation(PRELUDE + textwrap.dedent("""
    import sys, time
    mine = bytes_to_fill(2 * MIN)
    view = torch.frombuffer(mine, dtype=torch.uint8)
    view.fill_(9)
    address = view.data_ptr()  # (the child writes with ctypes: torch's thread pool does not survive a fork)
    refs, before, ctime = sys.getrefcount(mine), stats(), os.fstat(arena.fd).st_ctime_ns
    time.sleep(0.05)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            held = [mine] * 5  # refcount writes to the child's copy only
            ctypes.memset(address, 7, len(mine))  # the child's writes to the block
            assert mine[0] == 7
            code = 3 if placed(bytes_to_fill(2 * MIN)) else 0
            del held, view, mine  # the child's free of its copy
            gc.collect()
        except BaseException:
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
    pid = os.fork()
    if pid == 0:
        held = [mine] * 7
        os._exit(0)  # exits holding references
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sys.getrefcount(mine) == refs, (sys.getrefcount(mine), refs)
    assert stats() == before, (stats(), before)
    assert mine == bytes([9]) * len(mine)
    assert os.fstat(arena.fd).st_ctime_ns == ctime
    other = bytes_to_fill(2 * MIN)  # a new object does not take the live object's block
    assert placed(other) and not (id(mine) <= id(other) < id(mine) + len(mine))
    del view, mine, other
    gc.collect()
    assert stats()["blocks"] == 0  # the parent's frees still work: the children left the headers alone
    print("ok")
    """))
def test_a_forked_child_gets_a_private_copy_of_the_window(ran):
    """A child forked after the install: its refcounts, writes and frees of the parent's placed objects
    stay in the child (a private copy of the blocks, made at the fork), it places nothing new, and the
    file's ctime is not moved by its writes. The parent's objects, refcounts and books are unchanged
    after the child freed its copy and after a child exited holding references."""
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    import sys
    first = bytes_to_fill(2 * MIN)
    torch.frombuffer(first, dtype=torch.uint8).fill_(9)
    spacer = bytes_to_fill(3 * MIN)
    far = bytes_to_fill(2 * MIN)  # a live block after the hole the spacer leaves
    torch.frombuffer(far, dtype=torch.uint8).fill_(11)
    del spacer
    refs = sys.getrefcount(first)
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.read(go_r, 1)  # the parent has reused the block by now
            code = 5 if first != bytes([9]) * len(first) else 6 if far != bytes([11]) * len(far) else 0
            code = code or (7 if sys.getrefcount(first) != refs else 0)
        except BaseException:
            code = 4
        finally:
            os._exit(code)
    address = id(first)
    del first
    reused = [bytes_to_fill(2 * MIN) for _ in range(3)]  # one of them takes the freed block
    assert any(address <= id(b) < address + 2 * MIN + PAGE for b in reused)
    for b in reused:
        torch.frombuffer(b, dtype=torch.uint8).fill_(0x55)
    os.write(go_w, b"x")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
    print("ok")
    """))
def test_a_forked_childs_copy_is_the_window_as_it_was_at_the_fork(ran):
    """The copy is the parent's window at the fork, whatever the parent does next: right after fork()
    the parent frees an object and puts a new one in its block; the child, reading afterwards, still
    sees the old object's bytes and refcount, and a live block after a free hole comes across too."""
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    import resource, signal
    mine = bytes_to_fill(2 * MIN)
    torch.frombuffer(mine, dtype=torch.uint8).fill_(9)
    before = stats()
    size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 20), hard))  # no room for the window's copy
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(3 if mine[0] == 9 else 4)  # the read is the test: it must fault
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGSEGV, os.waitstatus_to_exitcode(status)
    assert mine == bytes([9]) * len(mine)
    now = stats()
    assert (now["used_bytes"], now["blocks"]) == (before["used_bytes"], before["blocks"]), (now, before)
    print("ok")
    """))
def test_a_fork_without_memory_for_the_copy_leaves_the_child_no_window(ran):
    """When the copy cannot be made (the address space limit here), the child's window is inaccessible:
    a child that reads a placed object dies of SIGSEGV, and the parent's object and books are intact."""
    ran_ok(ran)


@in_isolation(PRELUDE + textwrap.dedent("""
    import threading
    found = {}

    def other():
        found["plain"] = placed(bytes_to_fill(2 * MIN))
        found["tuple"] = stats()["blocks"]
        t = tuple(range(MIN // 8 + 1))  # a large tuple (a GC object) of this thread: the heap
        found["tuple"] = stats()["blocks"] - found["tuple"]
        arena_objects.arm()
        found["armed"] = placed(bytes_to_fill(2 * MIN))
        arena_objects.arm(False)
        found["disarmed"] = placed(bytes_to_fill(2 * MIN))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert found == {"plain": False, "tuple": 0, "armed": True, "disarmed": False}, found
    assert placed(bytes_to_fill(2 * MIN))  # the installing thread still is
    print("ok")
    """))
def test_only_the_armed_threads_objects_are_placed(ran):
    """The installing thread (a front end's event loop) is armed; another thread's large objects stay
    in the heap until it arms itself, and after it disarms."""
    ran_ok(ran)


@in_isolation(EXPECT_REFUSED + textwrap.dedent("""
    import tracemalloc
    from service.api.arena import WireArena
    tracemalloc.start()
    expect_refused(WireArena(64 << 20), "tracemalloc")
    print("ok")
    """))
def test_tracemalloc_tracing_refuses_the_install(ran):
    ran_ok(ran)


def test_a_compiler_with_arguments_and_an_unloadable_cached_build(tmp_path, cache):
    """CC may name a wrapper with arguments; a cached library that does not load is built again."""
    bad = tmp_path / "cache"
    bad.mkdir()
    key = next(cache.glob("arena_alloc-*")).name
    (bad / key).write_bytes(b"not a library")
    run = subprocess.run([sys.executable, "-c", "from service.api import arena_objects as a; a.library(); print('ok')"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MOE_CACHE_DIR": str(bad), "CC": "env cc"})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    assert "does not load" in run.stderr
    assert (bad / key).read_bytes()[:4] == b"\x7fELF"


def test_the_windows_figures_are_exported(server):
    """The window's gauges and counters: placed grows with a placed request, and nothing is left held
    once its answer is sent."""
    placed_before = metric_value(server.url, "moe_wire_arena_objects_placed_total")
    x, ids, w = inputs(100, 990)
    check(grpc_answer(server.grpc_url, x, ids, w), x, ids, w)
    assert metric_value(server.url, "moe_wire_arena_objects_placed_total") >= placed_before + 2  # message, response
    names = ("moe_wire_arena_objects_bytes", "moe_wire_arena_objects_blocks", "moe_wire_arena_objects_free_extents")
    deadline = time.monotonic() + 10
    while (now := [metric_value(server.url, name) for name in names]) != [0, 0, 1] and time.monotonic() < deadline:
        time.sleep(0.05)  # (grpc lets the response go once it is sent, after the client has it)
    assert now == [0, 0, 1], now
    assert metric_value(server.url, "moe_wire_arena_objects_no_room_total") >= 0  # exported
