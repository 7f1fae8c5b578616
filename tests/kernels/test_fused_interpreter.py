"""The fused kernels under the Triton interpreter, R virtual ranks in one process (CPU CI).

Every rank's symmetric region is a CPU tensor and the pointer table holds their addresses, so
peer loads and stores, flags and watermarks go through the same code as on a GPU (USE_PTX=False:
the tl.atomic_* path). The interpreter runs programs one after another, so each phase runs for
every rank before the next (producers before consumers) and the barrier's peer signals are
pre-satisfied. What it checks, against the fp32 reference and service/moe/simulate.py:
the input stage, the pulls of remote tokens and GEMM1's in-place row reads, the gates, GEMM2,
the job dispenser with 1-, 2- and 4-token grabs, reduce + push into the owners' planes, the
last-writer watermarks (empty owners included), the final reduce, the flags' sequence targets
over consecutive batches (including seq crossing 2**31, where the int32 flags wrap), the arrival
flags' refresh to seq every step, and that timed-out waits end in the error flag.

TRITON_INTERPRET is read when `@triton.jit` decorates, so the cases run in a subprocess (this
file as a script, tests/interp.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import TOL
from tests.interp import job, main, run_cases

# name: (dtype, E, H, Ir, K, C, counts per batch, routing, programs, comm1, compute2, join, seq0, fault)
CASES = {
    "r3_fp32": ("float32", 4, 32, 16, 2, 6, [[6, 0, 3], [1, 6, 6], [0, 0, 1]], "balanced", 4, 2, 2, False, 1, None),
    "r2_fp16_skewed": ("float16", 5, 48, 24, 3, 5, [[5, 4], [2, 5]], "skewed", 4, 1, 2, False, 1, None),
    "r1_join": ("float32", 3, 32, 16, 3, 7, [[7], [1]], "balanced", 2, 1, 1, True, 1, None),
    "r2_wrap": ("float32", 4, 32, 16, 2, 4, [[4, 3], [2, 4], [3, 1]], "balanced", 3, 1, 2, False, (1 << 31) - 2, None),
    "barrier_timeout": ("float32", 4, 32, 16, 2, 4, [[4, 3]], "balanced", 3, 1, 2, False, 1, "withhold"),
    "gate_timeout": ("float32", 4, 32, 16, 2, 4, [[4, 3]], "balanced", 3, 1, 2, False, 1, "gate"),
    # Kernel 1's epilogue variants (EPILOGUES): a clamped SwiGLU, GELU-tanh, gpt-oss with biases.
    "r2_clamped_silu": ("float32", 4, 32, 16, 2, 5, [[5, 3], [2, 5]], "skewed", 4, 1, 2, False, 1, None),
    "r2_gelu_tanh": ("float16", 4, 48, 24, 2, 5, [[4, 5]], "balanced", 4, 1, 2, False, 1, None),
    "r3_gpt_oss_bias": ("float32", 5, 32, 16, 2, 4, [[4, 0, 3], [1, 4, 4]], "empty_expert", 4, 2, 2, False, 1, None),
    # Both GEMMs reading the weights through TMA tensor descriptors (GemmConfig.w_desc).
    "r2_w_desc": ("float32", 4, 32, 16, 2, 5, [[5, 3], [2, 5]], "skewed", 4, 1, 2, False, 1, None),
    "r2_fp16_w_desc_bias": ("float16", 5, 48, 32, 3, 5, [[5, 4], [2, 5]], "empty_expert", 4, 1, 2, False, 1, None),
    # Tail blocks of more and of fewer than BM/2 real rows (GemmConfig.split_tail: full and half
    # tiles in one step), and the same layouts with split_tail off (full tiles only).
    "r2_mixed_tiles": ("float32", 3, 32, 16, 2, 50, [[50, 37], [23, 50]], "skewed", 4, 1, 2, False, 1, None),
    "r2_no_split": ("float32", 3, 32, 16, 2, 50, [[50, 37]], "skewed", 4, 1, 2, False, 1, None),
    # Both kernels' GEMM tiles from the tile queues (GemmConfig.queue), in pn_major order, over
    # three steps (the final reduce must rewind the queues), and the static walk in pn_major order.
    "r2_queue_pn_major": ("float32", 3, 32, 16, 2, 50, [[50, 37], [23, 50], [50, 50]], "skewed", 4, 1, 2, True, 1,
                          None),
    "r2_pn_major": ("float32", 3, 32, 16, 2, 50, [[50, 37]], "balanced", 4, 1, 2, False, 1, None),
    # Both kernels with pair tiles (GemmConfig.pair, BN = 32: pair tiles 16 columns wide, Ir % 32 != 0):
    # experts of two and more full blocks next to half tails and single blocks, pulled rows gated
    # over both blocks of a pair, kernel 2's jobs behind both blocks' tile marks, three steps; with
    # the queue in pn_major order at R = 1 and a one-token step; fp16 with an empty expert; and a
    # pair's gate timing out.
    "r2_pair": ("float32", 3, 32, 48, 2, 130, [[130, 97], [64, 130], [130, 130]], "skewed", 4, 1, 2, False, 1, None),
    "r1_pair_queue": ("float32", 2, 32, 32, 2, 200, [[200], [1]], "balanced", 3, 0, 2, True, 1, None),
    "r2_fp16_pair_empty_expert": ("float16", 4, 48, 40, 2, 150, [[150, 130]], "empty_expert", 4, 1, 2, False, 1,
                                  None),
    "gate_timeout_pair": ("float32", 2, 32, 32, 2, 130, [[130, 130]], "balanced", 3, 1, 1, False, 1, "gate"),
}
ORDERS = {"r2_queue_pn_major": dict(queue=True, pn_major=True), "r2_pn_major": dict(pn_major=True),
          "r1_pair_queue": dict(queue=True, pn_major=True)}
PAIR = {"r2_pair", "r1_pair_queue", "r2_fp16_pair_empty_expert", "gate_timeout_pair"}
W_DESC = {"r2_w_desc", "r2_fp16_w_desc_bias"}
NO_SPLIT = {"r2_no_split"}
# name -> (activation kind, clamp limit, biases, input scale); the scale makes the clamps bite.
EPILOGUES = {
    "r2_clamped_silu": ("silu", 1.5, False, 4.0),
    "r2_gelu_tanh": ("gelu_tanh", None, False, 1.0),
    "r3_gpt_oss_bias": ("gpt_oss", 1.5, True, 4.0),
    "r2_fp16_w_desc_bias": ("silu", None, True, 1.0),
}


# Kernel-2 tokens per dispenser grab, where not the default (2).
JOB_TOKENS = {"r3_fp32": 1, "r2_wrap": 4}


def _wrap32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _pairs(tables, E: int) -> list[int]:
    """First blocks of the pairs that GemmConfig.pair forms in this layout (split_tail on): an
    expert's blocks but a half tail, paired from its first block."""
    from service.config import BM

    off, rt = tables.expert_offsets.tolist(), tables.row_token
    firsts = []
    for e in range(E):
        b0, nb = off[e] // BM, (off[e + 1] - off[e]) // BM
        full = nb - (1 if nb and int(rt[(b0 + nb - 1) * BM + BM // 2]) < 0 else 0)
        firsts += [b0 + 2 * p for p in range(full // 2)]
    return firsts


def _run_case(name: str) -> dict:
    from service.config import BM, Activation, LayerConfig
    from service.kernels import fused_kernels as fk
    from service.kernels.grouped_gemm import GemmConfig
    from service.moe import fused, fused_buffers
    from service.moe.reference import moe_reference
    from service.moe.simulate import simulate_fused
    from service.moe.tables import build_tables, check_invariants
    from service.moe.weights import RankWeights
    from tests.helpers import random_experts, rel_err, routing, slice_rank

    dtype_name, E, H, Ir, K, C, batches, kind, P, comm1, compute2, join, seq0, fault = CASES[name]
    dtype = getattr(torch, dtype_name)
    R = len(batches[0])
    kind_act, limit, biased, scale = EPILOGUES.get(name, ("silu", None, False, 1.0))
    cfg = LayerConfig(E=E, H=H, I=Ir * R, K=K, R=R, C=C, dtype=dtype, act=Activation(kind_act, limit=limit),
                      bias=biased)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    full = random_experts(E, H, cfg.I, gen)
    full = tuple(t.to(dtype).float() for t in full)  # weights exactly representable in dtype
    sl = [slice_rank(*full, r, R) for r in range(R)]
    biases = None
    b13 = b2 = [None] * R
    if biased:  # gate [E, I], up [E, I], down [E, H]; rank r holds its rows of gate / up, rank 0 the down bias
        biases = tuple((torch.randn(E, n, generator=gen) * 0.5).to(dtype).float() for n in (cfg.I, cfg.I, H))
        b13 = [torch.cat([biases[0][:, r * Ir:(r + 1) * Ir], biases[1][:, r * Ir:(r + 1) * Ir]], 1).to(dtype)
               for r in range(R)]
        b2 = [biases[2].to(dtype)] + [None] * (R - 1)
    lay = fused_buffers.Layout(R, C, H, K, dtype.itemsize)
    regions = [torch.zeros(lay.nbytes, dtype=torch.uint8) for _ in range(R)]
    ptrs = [t.data_ptr() for t in regions]
    bufs = [fused_buffers.RankBuffers(cfg, r, regions[r], ptrs) for r in range(R)]
    order = ORDERS.get(name, {})
    cfg1 = GemmConfig(BN=32 if name in PAIR else 16, BK=16, num_warps=4, num_stages=1, w_desc=name in W_DESC,
                      split_tail=name not in NO_SPLIT, pair=name in PAIR, **order)
    cfg2 = GemmConfig(BN=32, BK=16, num_warps=4, num_stages=1, w_desc=name in W_DESC, split_tail=name not in NO_SPLIT,
                      pair=name in PAIR, **order)
    plan = fk.Plan(num_programs=P, num_comm1=comm1, num_compute2=compute2, join=join, config1=cfg1,
                      config2=cfg2, max_spins=20, use_ptx=False, job_tokens=JOB_TOKENS.get(name, 2))
    w13 = [s[0].to(dtype) for s in sl]
    w2 = [s[1].to(dtype) for s in sl]
    args = [b.args(w13[r], w2[r], b13[r], b2[r]) for r, b in enumerate(bufs)]  # one structure per rank
    # Kernel 2's marks per block and step: 1 per own tile number, 2 with pair tiles (fused_kernels).
    NB, marks2 = cfg.S // BM, -(-H // cfg2.BN) * (2 if cfg2.pair else 1)
    # Flags as a long-running process left them after step seq0 - 1 (never reset).
    for b in bufs:
        b.arrived.fill_(_wrap32(seq0 - 1))
        b.tiles.fill_(_wrap32((seq0 - 1) * marks2))
        b.wm.fill_(_wrap32(seq0 - 1))
        b.bar.fill_(_wrap32(seq0 - 1))
        b.pulled.fill_(float("nan"))  # nothing unwritten may be read as data
        b.tokens.fill_(float("nan"))  # rows past n are never staged
        b.D.fill_(float("nan"))
        b.staging.fill_(float("nan"))

    record: dict = {"dtype": dtype_name, "errors": [], "steps": []}
    for step, counts in enumerate(batches):
        seq = seq0 + step
        xs, ids, ws = [], [], []
        for n in counts:
            xs.append((torch.randn(n, H, generator=gen) * scale).to(dtype))
            i, w = routing(n, E, K, kind, gen)
            ids.append(i)
            ws.append(w)
        for r, b in enumerate(bufs):
            # Inputs as a caller leaves them: this step's rows, then stale rows (NaN) past n.
            for buf in (b.x_in, b.w_in):
                buf.fill_(float("nan"))
            b.ids_in.fill_(-7)
            b.take_inputs(xs[r], ids[r].int(), ws[r])
            b.ctl.copy_(torch.tensor([_wrap32(seq), counts[r], seq & 0x7FFFFFFF, seq >> 31], dtype=torch.int32))
            fk.stage(args[r])
        # The peers' barrier signals, pre-satisfied (the interpreter cannot run ranks concurrently);
        # "withhold": rank R-1 never signals rank 0.
        for b in bufs:
            b.bar.fill_(_wrap32(seq))
        if fault == "withhold":
            bufs[0].bar[R - 1] = _wrap32(seq - 1)
        # Twice: on a GPU every rank writes its META before its barrier signal and reads the peers'
        # after the wait; run one after another, the first round writes them all, the second reads.
        for _ in range(2):
            for a in args:
                fk.exchange(a, plan)
        routing_same = all(torch.equal(b.routing_g, bufs[0].routing_g) for b in bufs)
        tables = [fused.build_step_tables(b) for b in bufs]
        counts_t, ids_g, _ = bufs[-1].routing_views()
        check_invariants(tables[-1], ids_g, counts_t, E, C)
        if fault == "gate":
            # Rank 0's pullers skip one remote token (pull_order names another in its place):
            # the blocks holding its rows must time out at their gates.
            withheld = next(g for g in tables[0].pull_order.tolist()
                            if g // C != 0 and int(tables[0].slots[g, 0]) >= 0)
            order = tables[0].pull_order.clone()
            order[order == withheld] = int(order[order != withheld][0])
            tables[0] = dataclasses.replace(tables[0], pull_order=order)
            gate_blocks = sorted({s // BM for s in tables[0].slots[withheld].tolist()})
        for a, t in zip(args, tables, strict=True):
            fk.ag_gemm1(a, plan, t)
        for a, t in zip(args, tables, strict=True):
            fk.gemm2_push(a, plan, t)
        for a in args:
            fk.final_reduce(a, plan)
        errors = [int(b.error.item()) for b in bufs]
        record["errors"] = errors
        if fault:
            record["error_names"] = [fk.describe_error(e) for e in errors]
            if fault == "gate":
                record["gate_blocks"] = gate_blocks
                record["pairs"] = _pairs(tables[0], E)
            break
        refs = [moe_reference(x.float(), i, w, *full, act=cfg.act, biases=biases)
                for x, i, w in zip(xs, ids, ws, strict=True)]
        sims = simulate_fused([x.float() for x in xs], ids, ws,
                              [RankWeights(a.float(), c.float(), None if p is None else p.float(),
                                           None if q is None else q.float())
                               for a, c, p, q in zip(w13, w2, b13, b2, strict=True)],
                              cfg.replace(dtype=torch.float32), seq=seq)
        outs = [b.out[:n].clone() for b, n in zip(bufs, counts, strict=True)]
        # Rank 0's row blocks by tile height (split_tail: a block whose row BM/2 is padding runs a
        # BM/2-row tile), and whether its D rows BM/2.. of those blocks were written.
        rt0 = tables[0].row_token.view(NB, BM)
        used0 = tables[0].block_expert < E
        half0 = used0 & (rt0[:, BM // 2] < 0)
        d_tail = bufs[0].D.view(NB, BM, H)[half0][:, BM // 2:]
        record["steps"].append(dict(
            tiles_half_full=[int(half0.sum()), int((used0 & ~half0).sum())],
            pairs=_pairs(tables[0], E),
            d_tail_nan=bool(torch.isnan(d_tail).all()), d_tail_finite=bool(torch.isfinite(d_tail).all()),
            seq=seq, counts=counts,
            err=[rel_err(o, ref) if n else 0.0 for o, ref, n in zip(outs, refs, counts, strict=True)],
            err_sim=[rel_err(o, s) if n else 0.0 for o, s, n in zip(outs, sims, counts, strict=True)],
            clamped_share=None if limit is None else float(torch.cat(
                [(x.float() @ full[0][0].T > limit).float().reshape(-1) for x in xs]).mean()),
            finite=all(bool(torch.isfinite(o).all()) for o in outs),
            routing_same=routing_same,
            tables_same=all(torch.equal(getattr(t, f), getattr(tables[0], f)) for t in tables
                            for f in ("slots", "pull_order", "job_order", "row_token", "block_expert")),
            tables_match_torch=torch.equal(tables[0].slots, build_tables(ids_g, counts_t, E, C, cfg.S).slots),
            arrived_ok=all(b.arrived[:R * C].tolist() == [_wrap32(seq)] * (R * C) for b in bufs),
            tiles_ok=all(torch.equal(b.tiles, torch.full((NB,), _wrap32(seq * marks2), dtype=torch.int32))
                         for b in bufs),
            wm_ok=all(torch.equal(b.wm, torch.full((R,), _wrap32(seq), dtype=torch.int32)) for b in bufs),
            bar_ok=all(torch.equal(b.bar, torch.full((R,), _wrap32(seq), dtype=torch.int32)) for b in bufs),
            scratch_zero=all(int(b.disp.abs().sum()) == 0 and int(b.pushed.abs().sum()) == 0 for b in bufs),
            seqs=[int(v) for v in bufs[0].routing_g[:, 1].tolist()],
        ))
    return record


def background_jobs() -> list:
    """The interpreter run, started as soon as the session has collected this module (tests/background.py)."""
    return [job(__file__)]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_cases(__file__)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][-1] is None])
def test_fused_pipeline_matches_reference(results, name):
    r = results[name]
    assert "exception" not in r, r.get("exception")
    assert r["errors"] == [0] * len(r["errors"]), f"a wait timed out: {r['errors']}"
    assert len(r["steps"]) == len(CASES[name][6])
    for s in r["steps"]:
        where = f"seq {s['seq']} counts {s['counts']}"
        assert s["routing_same"] and s["tables_same"] and s["tables_match_torch"], where
        assert s["finite"], f"{where}: a garbage row reached the output"
        tol = TOL[getattr(torch, r["dtype"])]
        for rank, (e, es) in enumerate(zip(s["err"], s["err_sim"], strict=True)):
            assert e <= tol, f"{where} rank {rank}: error vs reference {e:.2e}"
            assert es <= tol, f"{where} rank {rank}: error vs simulation {es:.2e}"
        if s["clamped_share"] is not None:
            assert s["clamped_share"] > 0.05, f"{where}: inputs too small to reach the clamp"
        assert s["arrived_ok"], f"{where}: arrival flags not refreshed to seq (pulled or not)"
        assert s["tiles_ok"], f"{where}: tile counters are not at seq * n_tiles"
        assert s["wm_ok"], f"{where}: a watermark (empty owners included) is not at seq"
        assert s["bar_ok"], f"{where}: barrier slots are not at seq"
        assert s["scratch_zero"], f"{where}: dispenser / tile queues / push counts not reset for the next step"
        assert s["seqs"] == [s["seq"] & 0x7FFFFFFF] * len(s["seqs"]), where
    first = r["steps"][0]
    if name in PAIR:
        assert all(s["pairs"] for s in r["steps"][:1]), "the case must run pair tiles"
    if name == "r2_mixed_tiles":
        assert min(first["tiles_half_full"]) > 0, f"the case must run half and full tiles: {first['tiles_half_full']}"
    if first["tiles_half_full"][0]:  # D was NaN before the first step: a half tile leaves rows BM/2.. alone
        assert first["d_tail_finite"] if name in NO_SPLIT else first["d_tail_nan"], \
            "split_tail off must write every row of a used block, on: only the first BM/2 of a half-padding tail"


def test_barrier_timeout_sets_error(results):
    from service.kernels.fused_kernels import ERR_BARRIER, ERR_WATERMARK

    r = results["barrier_timeout"]
    assert "exception" not in r, r.get("exception")
    R = len(CASES["barrier_timeout"][6][0])
    assert r["errors"][0] == ERR_BARRIER.value + R - 1, r.get("error_names")
    # Rank 0 then skips the step, so its peer's final reduce never sees rank 0's watermark: also
    # a bounded wait that ends in the error flag.
    assert r["errors"][1] == ERR_WATERMARK.value, r.get("error_names")


def test_gate_timeout_sets_error(results):
    from service.kernels.fused_kernels import ERR_GATE, error_kind

    r = results["gate_timeout"]
    assert "exception" not in r, r.get("exception")
    assert error_kind(r["errors"][0]) == ERR_GATE.value, r.get("error_names")
    assert r["errors"][0] - ERR_GATE.value in r["gate_blocks"], r.get("error_names")


def test_pair_gate_timeout_sets_error(results):
    """A pair tile's gate covers both blocks' rows: a remote token withheld from either block times
    out, and the error names the pair's first block."""
    from service.kernels.fused_kernels import ERR_GATE, error_kind

    r = results["gate_timeout_pair"]
    assert "exception" not in r, r.get("exception")
    assert error_kind(r["errors"][0]) == ERR_GATE.value, r.get("error_names")
    block = r["errors"][0] - ERR_GATE.value
    in_pair = block in r["pairs"] and (block in r["gate_blocks"] or block + 1 in r["gate_blocks"])
    assert in_pair or block in r["gate_blocks"], (block, r["gate_blocks"], r["pairs"], r.get("error_names"))
    assert any(b in r["gate_blocks"] or b + 1 in r["gate_blocks"] for b in r["pairs"]), \
        "the withheld token must sit in a pair, or this case does not test the pair's gate"


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(CASES, _run_case)
