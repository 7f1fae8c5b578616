"""The direct rows' device check (service.kernels.finite_rows): interpreter cases on CPU (in a
subprocess, tests/interp.py), the launcher's refusals, compile-only for sm_90 / sm_120, and on a GPU
the kernel against the torch calls it replaced (service.worker.rank._check_cuda both ways).

Every case's expected flags come from how its rows were built, not from a reference: each bad row
holds +inf, -inf or a NaN (quiet, signalling, negative, with a payload) at random columns, the first
or the last; good rows hold -0.0, subnormals and +-max (whole rows, whose sums overflow, and at
random columns and the last), which must be left bit for bit. The checked rows sit between two
NaN rows of the buffer, which must not be touched.
"""

from __future__ import annotations

import pytest
import torch
import triton

from tests.interp import job, main, run_cases

# name: (dtype, r, H, flags dtype, seed: with r = 1 an even seed makes the row bad, an odd one good)
CASES = {
    "bf16_r512_h4096": ("bfloat16", 512, 4096, "bool", 0),
    "fp16_r512_h4096": ("float16", 512, 4096, "bool", 0),
    "fp32_r512_h4096": ("float32", 512, 4096, "uint8", 0),
    "bf16_r7_h4104": ("bfloat16", 7, 4104, "uint8", 0), # H not a multiple of BLOCK_H: a masked tail
    "fp16_r7_h4104": ("float16", 7, 4104, "bool", 0),
    "fp32_r7_h4104": ("float32", 7, 4104, "bool", 0),
    "bf16_r7_h8192": ("bfloat16", 7, 8192, "bool", 0), # two full tiles per row
    "bf16_r1_h4096_bad": ("bfloat16", 1, 4096, "bool", 0),
    "fp16_r1_h4104_good": ("float16", 1, 4104, "uint8", 1),
    "fp32_r1_h4096_bad": ("float32", 1, 4096, "bool", 2),
    "bf16_r1_h4096_good": ("bfloat16", 1, 4096, "bool", 3),
    "fp32_r3_h5": ("float32", 3, 5, "bool", 0), # H far below one tile
}

# The span form (a CUDA graph's launch over a whole buffer, service.worker.rank._SpanCheck): name:
# (dtype, rows of the buffer, H, lo, hi); rows outside [lo, hi) hold bad and good rows alike and must
# keep their bits and their flags' poison.
SPAN_CASES = {
    "span_bf16_r40_h4104_3_29": ("bfloat16", 40, 4104, 3, 29),
    "span_fp32_r9_h5_0_9": ("float32", 9, 5, 0, 9),  # the whole buffer
    "span_fp16_r12_h4096_11_12": ("float16", 12, 4096, 11, 12),  # the last row alone (a good one)
    "span_fp16_r12_h4096_0_1": ("float16", 12, 4096, 0, 1),  # the first row alone (a bad one)
    "span_bf16_r12_h4096_5_5": ("bfloat16", 12, 4096, 5, 5),  # empty: nothing read or written
}

# IEEE 754 layouts: (bits dtype, width, exponent field)
LAYOUT = {torch.bfloat16: (torch.int16, 16, 0x7F80), torch.float16: (torch.int16, 16, 0x7C00),
          torch.float32: (torch.int32, 32, 0x7F800000)}


def _signed(v: int, width: int) -> int:
    return v - (1 << width) if v >= 1 << (width - 1) else v


def specials(dtype: torch.dtype) -> list[int]:
    """Bit patterns that are not finite: +inf, -inf, quiet NaN, signalling NaN, negative NaN with a payload."""
    _, width, exp = LAYOUT[dtype]
    sign, quiet = 1 << (width - 1), (exp & -exp) >> 1  # quiet: the mantissa's top bit
    return [_signed(v, width) for v in (exp, sign | exp, exp | quiet, exp | 1, sign | exp | quiet | 5)]


def make_rows(dtype: torch.dtype, r: int, H: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [r, H] and the flags it must give: about a third of the rows bad; with r > 1 the first row
    bad and the last good, with r = 1 the row bad iff the seed is even."""
    gen = torch.Generator().manual_seed(seed)
    bits_dtype, _, _ = LAYOUT[dtype]
    info = torch.finfo(dtype)
    x = torch.randn(r, H, generator=gen).to(dtype)
    bad = torch.rand(r, generator=gen) < 1 / 3
    bad[0] = r > 1 or seed % 2 == 0
    if r > 1:
        bad[-1] = False
    good_rows = (~bad).nonzero().flatten().tolist()
    for i in good_rows[0::3]:  # finite extremes, left as they are; the row's sum overflows
        x[i] = info.max
        x[i, ::3] = -info.max
    for i in good_rows[1::3]:
        x[i, :H // 2] = info.smallest_normal / 4  # subnormals: exponent field 0
        x[i, H // 2:] = -0.0
    for i in good_rows[2::3]:  # +-max at random columns and the last one among ordinary values
        cols = torch.randint(H, (4,), generator=gen)
        x[i, cols] = info.max
        x[i, cols[:2]] = -info.max
        x[i, H - 1] = info.max
    bits = x.view(bits_dtype)
    pats = specials(dtype)
    for n, i in enumerate(bad.nonzero().flatten().tolist()):
        where = [H - 1, 0, int(torch.randint(H, (1,), generator=gen))][n % 3]  # last, first, anywhere
        bits[i, where] = pats[n % len(pats)]
        if n % 4 == 3:  # several in one row
            cols = torch.randint(H, (3,), generator=gen)
            bits[i, cols] = pats[(n + 1) % len(pats)]
    return x, bad


def _run_case(name: str) -> dict:
    from service.kernels.finite_rows import zero_bad_rows, zero_bad_rows_ref

    dtype_name, r, H, flags_name, seed = CASES[name]
    dtype = getattr(torch, dtype_name)
    bits_dtype = LAYOUT[dtype][0]
    x, want = make_rows(dtype, r, H, seed)
    buf = torch.full((r + 2, H), float("nan"), dtype=dtype)  # NaN rows around the span: not its to touch
    buf[1:r + 1] = x
    if flags_name == "bool":
        flags = ~want  # poisoned: every flag must be written
    else:
        flags = torch.full((r,), 7, dtype=torch.uint8)
    zero_bad_rows(buf[1:r + 1], flags)
    got = flags.bool() if flags_name == "bool" else flags
    out = buf[1:r + 1].view(bits_dtype)
    ref_x, ref_bad = zero_bad_rows_ref(x)
    return dict(flags_exact=torch.equal(got.to(torch.uint8), want.to(torch.uint8)),
                flags_01=bool(((flags.view(torch.uint8) == 0) | (flags.view(torch.uint8) == 1)).all()),
                good_bit_equal=torch.equal(out[~want], x.view(bits_dtype)[~want]),
                bad_all_zero=bool((out[want] == 0).all()),
                ref_agrees=torch.equal(ref_bad, want) and torch.equal(ref_x.view(bits_dtype), out),
                neighbours_untouched=bool(buf[0].isnan().all() and buf[r + 1].isnan().all()),
                n_bad=int(want.sum()), n_good=int((~want).sum()))


def _run_span_case(name: str) -> dict:
    from service.kernels.finite_rows import zero_bad_rows

    dtype_name, r, H, lo, hi = SPAN_CASES[name]
    dtype = getattr(torch, dtype_name)
    bits = LAYOUT[dtype][0]
    x, want = make_rows(dtype, r, H, seed=r + lo)
    y = x.clone()
    flags = torch.full((r,), 7, dtype=torch.uint8)  # poison: inside the span overwritten, outside kept
    zero_bad_rows(y, flags, torch.tensor([lo, hi], dtype=torch.int32))
    inside = torch.zeros(r, dtype=torch.bool)
    inside[lo:hi] = True
    return dict(flags_inside=torch.equal(flags[inside], want[inside].to(torch.uint8)),
                flags_outside_kept=bool((flags[~inside] == 7).all()),
                good_inside_bit_equal=torch.equal(y.view(bits)[inside & ~want], x.view(bits)[inside & ~want]),
                bad_inside_zero=bool((y.view(bits)[inside & want] == 0).all()),
                outside_bit_equal=torch.equal(y.view(bits)[~inside], x.view(bits)[~inside]),
                bad_inside=int((inside & want).sum()), bad_outside=int((~inside & want).sum()))


def _run(name: str) -> dict:
    return _run_span_case(name) if name in SPAN_CASES else _run_case(name)


def background_jobs() -> list:
    """The interpreter run, started as soon as the session has collected this module (tests/background.py)."""
    return [job(__file__)]


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_cases(__file__)


def _holds(r: dict, checks: dict[str, str]) -> None:
    """Every boolean of a case's record that `checks` names is true (its message otherwise)."""
    assert "exception" not in r, r.get("exception")
    for key, message in checks.items():
        assert r[key], message


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_flags_and_zeroes_exactly_the_bad_rows(interpreter_results, name):
    r = interpreter_results[name]
    _holds(r, {"flags_exact": "a flag differs from the rows as built", "flags_01": "a flag byte is neither 0 nor 1",
               "good_bit_equal": "a good row changed", "bad_all_zero": "a bad row is not all +0.0",
               "neighbours_untouched": "a row outside the span was written",
               "ref_agrees": "the reference disagrees with the rows as built"})
    assert r["n_bad"] + r["n_good"] == CASES[name][1]
    if CASES[name][1] > 1 or name.endswith("_good"):  # the case has rows of both kinds, or the one it names
        assert r["n_good"] >= 1
    if not name.endswith("_good"):
        assert r["n_bad"] >= 1


@pytest.mark.parametrize("name", list(SPAN_CASES))
def test_interpreter_span_checks_its_rows_alone(interpreter_results, name):
    r = interpreter_results[name]
    _holds(r, {"flags_inside": "a flag inside the span differs from the rows as built",
               "flags_outside_kept": "a flag outside the span was written",
               "good_inside_bit_equal": "a good row inside the span changed",
               "bad_inside_zero": "a bad row inside the span is not all +0.0",
               "outside_bit_equal": "a row outside the span was written"})
    _, rows, _, lo, hi = SPAN_CASES[name]
    # the case holds what it claims: bad rows inside (but for the good row and the empty span) and outside
    if name not in ("span_fp16_r12_h4096_11_12", "span_bf16_r12_h4096_5_5"):
        assert r["bad_inside"] >= 1
    if hi - lo < rows:
        assert r["bad_outside"] >= 1


def test_cases_hold_what_they_claim():
    """The generator's bad rows are the non-finite ones (torch's isfinite agrees) and its good rows
    hold the extremes the kernel must leave alone."""
    for dtype in LAYOUT:
        x, bad = make_rows(dtype, 40, 96, seed=1)
        assert torch.equal(~torch.isfinite(x.float()).all(dim=1), bad)
        good = x[~bad]
        assert (good == torch.finfo(dtype).max).any() and not torch.isfinite(good.sum(dim=1)).all()
        assert (good.view(LAYOUT[dtype][0]) == _signed(1 << (LAYOUT[dtype][1] - 1), LAYOUT[dtype][1])).any()
        assert ((good != 0) & (good.abs() < torch.finfo(dtype).smallest_normal)).any()
    assert make_rows(torch.float16, 1, 8, seed=0)[1].tolist() == [True]
    assert make_rows(torch.float16, 1, 8, seed=1)[1].tolist() == [False]


def test_launcher_rejects_bad_arguments():
    from service.kernels.finite_rows import zero_bad_rows

    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    flags = torch.zeros(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        zero_bad_rows(x.double(), flags)
    with pytest.raises(ValueError, match="bool or uint8"):
        zero_bad_rows(x, flags.int())
    with pytest.raises(ValueError, match="want x"):
        zero_bad_rows(x, flags[:3])
    with pytest.raises(ValueError, match="want x"):
        zero_bad_rows(x[0], flags)
    with pytest.raises(ValueError, match="row-major"):
        zero_bad_rows(torch.zeros(8, 4, dtype=torch.bfloat16).t(), flags)
    with pytest.raises(ValueError, match="contiguous"):
        zero_bad_rows(x, torch.zeros(8, dtype=torch.bool)[::2])
    for span in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="span must be int32"):
            zero_bad_rows(x, flags, span)


def test_empty_shapes_need_no_launch():
    from service.kernels.finite_rows import zero_bad_rows

    zero_bad_rows(torch.zeros(0, 8), torch.zeros(0, dtype=torch.bool))
    flags = torch.ones(3, dtype=torch.bool)
    zero_bad_rows(torch.zeros(3, 0), flags)  # no values: all finite
    assert not flags.any()


def test_bytes_moved():
    from service.kernels.finite_rows import bytes_moved

    assert bytes_moved(512, 4096, 2) == 512 * 4096 * 2 + 512
    assert bytes_moved(2, 10, 4, bad_rows=1) == 2 * 10 * 4 + 2 + 10 * 4


# ---------------------------------------------------------------------------------------------
# Compile-only (no GPU needed).
# ---------------------------------------------------------------------------------------------

interpreting = pytest.mark.skipif(triton.knobs.runtime.interpret, reason="compile-only needs the compiler")


@interpreting
@pytest.mark.parametrize("span", [False, True], ids=["rows", "span"])
@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiles(arch, dtype, span):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from service.kernels.finite_rows import _BITS, BLOCK_H, NUM_WARPS, _zero_bad_rows_kernel

    bits, exp = _BITS[dtype]
    sig = {"x_ptr": "*i16" if bits == torch.int16 else "*i32", "bad_ptr": "*u8",
           "span_ptr": "*i32" if span else "constexpr", "H": "i32", "stride_x": "i32",
           "EXP": "constexpr", "BLOCK_H": "constexpr"}
    aligned = [["tt.divisibility", 16]]  # what the launcher's specialization sees at H = 4096 (bad_ptr: never)
    specialized = ("x_ptr", "H", "stride_x", *(("span_ptr",) if span else ()))
    attrs = {(i,): aligned for i, name in enumerate(sig) if name in specialized}
    constants = {"EXP": exp, "BLOCK_H": BLOCK_H, **({} if span else {"span_ptr": None})}
    src = ASTSource(_zero_bad_rows_kernel, sig, constants, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=NUM_WARPS))
    ptx = kernel.asm["ptx"]
    assert ".v4." in ptx, "row loads not vectorized (16 bytes per thread per load)"
    assert "st.global" in ptx, "no store: the flags or the zeroing are missing"


# ---------------------------------------------------------------------------------------------
# GPU.
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 4096), (512, 4096), (2048, 4096), (512, 8192), (37, 4104)]


def _check_both_ways(x: torch.Tensor, span: tuple[int, int]):
    """rank._check_cuda on a copy of x with the kernel, and on another with the torch calls."""
    import types

    from service.worker import rank

    plan = types.SimpleNamespace(span=span)
    outs = []
    for use_kernel in (True, False):
        y = x.clone()
        flags = (torch.full((x.shape[0],), True, dtype=torch.bool, device=x.device),
                 torch.full((x.shape[0],), True, dtype=torch.bool, pin_memory=True))
        if use_kernel:
            assert rank._row_check() is not None, "Triton is importable here: the kernel must be used"
            rank._check_cuda(y, plan, flags)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(rank, "_row_check", lambda: None)
                rank._check_cuda(y, plan, flags)
        torch.cuda.synchronize()
        outs.append((y, flags[1].clone()))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "r{}_H{}".format(*s))
def test_gpu_kernel_equals_the_torch_calls(shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r, H = shape
    bits = LAYOUT[dtype][0]
    rows, want = make_rows(dtype, r, H, seed=r + H)
    # the span inside a layer input of r + 5 rows, as the rank checks it: rows 2 .. r+2
    x = torch.full((r + 5, H), float("nan"), dtype=dtype)
    x[2:r + 2] = rows
    x = x.cuda()
    (k_x, k_flags), (t_x, t_flags) = _check_both_ways(x, (2, r + 2))
    assert torch.equal(k_flags[2:r + 2], want), "the kernel's flags differ from the rows as built"
    assert torch.equal(k_flags[2:r + 2], t_flags[2:r + 2])
    assert torch.equal(k_x.view(bits), t_x.view(bits)), "the kernel's rows differ from the torch calls' (bits)"
    assert torch.equal(k_x[2:r + 2][~want.cuda()].view(bits), rows[~want].cuda().view(bits))
    assert (k_x[2:r + 2][want.cuda()].view(bits) == 0).all()
    assert k_x[:2].isnan().all() and k_x[r + 2:].isnan().all(), "rows outside the span were touched"


@pytest.mark.gpu
def test_gpu_span_graph_equals_the_eager_check():
    """rank._SpanCheck (the check as a lane's CUDA graph over the whole input buffer) against
    rank._check_cuda on the same rows, over spans and rows that change after the capture."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import types

    from service.worker import rank

    C, H = 64, 4096
    x = torch.zeros(C, H, dtype=torch.bfloat16, device="cuda")
    flags = rank._new_flags(C, x.device)
    check = rank._SpanCheck(rank._row_check(), x, flags)
    assert check.covers(x[:5]) and not check.covers(x[1:])
    for lo, hi, seed in ((0, 64, 1), (3, 29, 2), (40, 41, 3), (7, 7, 4), (0, 1, 5)):
        rows, _ = make_rows(torch.bfloat16, C, H, seed=seed)
        x.copy_(rows)  # new rows, after the capture
        flags[1].fill_(True)
        eager = rows.cuda()
        eager_flags = (torch.ones(C, dtype=torch.bool, device="cuda"), torch.ones(C, dtype=torch.bool, pin_memory=True))
        rank._check_cuda(eager, types.SimpleNamespace(span=(lo, hi)), eager_flags)
        check.run(lo, hi)
        torch.cuda.synchronize()
        bits, built = x.view(torch.int16), rows.cuda().view(torch.int16)
        assert torch.equal(bits, eager.view(torch.int16)), f"span {lo, hi}: rows differ from the eager check"
        assert torch.equal(flags[1][lo:hi], eager_flags[1][lo:hi]), f"span {lo, hi}: flags differ"
        assert torch.equal(bits[:lo], built[:lo]) and torch.equal(bits[hi:], built[hi:]), "a row outside it changed"


@pytest.mark.gpu
def test_gpu_kernel_runs_in_the_current_stream():
    """The rank launches it in the layer's stream after the DMA: it must see the copy before it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from service.kernels.finite_rows import zero_bad_rows

    rows, want = make_rows(torch.bfloat16, 512, 4096, seed=3)
    host = rows.pin_memory()
    x = torch.empty_like(rows, device="cuda")
    flags = torch.empty(512, dtype=torch.bool, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # the copy and the check queue behind ~ms of spinning
        x.copy_(host, non_blocking=True)
        zero_bad_rows(x, flags)
    stream.synchronize()
    assert torch.equal(flags.cpu(), want)


@pytest.mark.gpu
def test_gpu_spans_at_any_row_share_one_compiled_kernel():
    """The rank's span starts at a row that varies by step: a flags slice at any offset must not
    compile a second variant while serving (bad_ptr is not specialized on alignment)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from service.kernels.finite_rows import _zero_bad_rows_kernel, zero_bad_rows

    rows, want = make_rows(torch.bfloat16, 64, 4096, seed=5)
    compiled = {}
    for lo in (0, 1, 3, 8, 17):
        x = rows.cuda()
        flags = torch.empty(64, dtype=torch.bool, device="cuda")
        zero_bad_rows(x[lo:], flags[lo:])
        torch.cuda.synchronize()
        assert torch.equal(flags[lo:].cpu(), want[lo:])
        # the process's variants so far (other tests' dtypes and H too): the first offset may add one
        compiled[lo] = len(_zero_bad_rows_kernel.device_caches[torch.cuda.current_device()][0])
    assert len(set(compiled.values())) == 1, f"variants compiled after each offset: {compiled}"


if __name__ == "__main__":
    main([*CASES, *SPAN_CASES], _run)
