"""The offline commands end to end: write-checkpoint, then forward through the rank group.

Each test's commands (~2-7 s each, most of a short one one core importing torch) run in `runs`,
side by side with the other tests' (tests.helpers.side_by_side); the test checks what they did."""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.config import preset
from service.moe.reference import moe_reference
from tests.helpers import TOL, rel_err, routing, run_at_once, side_by_side

CLI = [sys.executable, "-m", "service.cli"]


def moe_serve(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def checkpoint_weights(path: str, prefix: str, names: tuple[str, str, str]):
    """gate, up [E, I, H] and down [E, H, I] in fp32, read back from a checkpoint."""
    t = load_file(path)
    E = len({k for k in t if k.endswith(f"{names[0]}.weight")})
    stack = lambda n: torch.stack([t[f"{prefix}experts.{e}.{n}.weight"].float() for e in range(E)])  # noqa: E731
    return tuple(stack(n) for n in names)


CHECKPOINTS = [
    ("hf", "", ("gate_proj", "up_proj", "down_proj"), torch.float32),
    ("mixtral", "model.layers.0.block_sparse_moe.", ("w1", "w3", "w2"), torch.bfloat16),
]


def _forward_with_checkpoint(folder, naming, prefix, dtype):
    """test_forward_with_checkpoint's commands: write-checkpoint, then (if it wrote) forward."""
    ckpt, inp, outp = (str(folder / n) for n in ("ckpt.safetensors", "in.safetensors", "out.safetensors"))
    written = moe_serve("write-checkpoint", ckpt, "--preset", "cpu", "--seed", "5", "--naming", naming,
                        "--prefix", prefix)
    cfg = preset("cpu")
    gen = torch.Generator().manual_seed(2)
    T = cfg.tokens_per_step + 37  # two steps: the progress line shows
    x = torch.randn(T, cfg.H, generator=gen).to(dtype)
    ids, w = routing(T, cfg.E, cfg.K, "skewed", gen)
    save_file({"hidden_states": x, "topk_ids": ids, "topk_weights": w}, inp)
    forward = None if written.returncode else moe_serve(
        "forward", "--input", inp, "--output", outp, "--weights", ckpt, "--weights-prefix", prefix, "--device", "cpu")
    return written, forward, ckpt, outp, (x, ids, w)


def _forward_synthetic_weights_small_batch(folder):
    inp, outp = str(folder / "in.safetensors"), str(folder / "out.safetensors")
    cfg = preset("cpu")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, cfg.H, generator=gen)
    ids, w = routing(1, cfg.E, cfg.K, "balanced", gen)
    save_file({"hidden_states": x, "topk_ids": ids.int(), "topk_weights": w}, inp)
    r = moe_serve("forward", "--input", inp, "--output", outp, "--device", "cpu", "--seed", "4")
    return r, outp, (x, ids, w)


def _forward_bad_input(folder):
    inp = str(folder / "in.safetensors")
    save_file({"hidden_states": torch.randn(2, 8)}, inp)
    return run_at_once([[*CLI, "forward", "--input", path, "--output", str(folder / "o"), "--device", "cpu"]
                        for path in (inp, str(folder / "nope"))], timeout=240)


REFUSED = [
    (lambda x, ids, w: x[1].__setitem__(7, float("nan")), "hidden_states contains NaN or infinity (row 1)"),
    (lambda x, ids, w: x[2].__setitem__(0, float("-inf")), "hidden_states contains NaN or infinity (row 2)"),
    (lambda x, ids, w: w[0].__setitem__(1, float("inf")), "topk_weights contains NaN or infinity"),
    (lambda x, ids, w: ids[1].__setitem__(0, 2 ** 32 + 3), "topk_ids[1, 0] = 4294967299 is not an expert id"),
    (lambda x, ids, w: ids[0].__setitem__(2, -1), "topk_ids[0, 2] = -1 is not an expert id"),
]


def _forward_refused(folder, change):
    inp, outp = str(folder / "in.safetensors"), folder / "out.safetensors"
    cfg = preset("cpu")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, cfg.H, generator=gen)
    ids, w = routing(3, cfg.E, cfg.K, "balanced", gen)
    change(x, ids, w)
    save_file({"hidden_states": x, "topk_ids": ids, "topk_weights": w}, inp)
    return moe_serve("forward", "--input", inp, "--output", str(outp), "--device", "cpu", timeout=120), outp


def _unwritable_output(folder):
    inp = str(folder / "in.safetensors")
    cfg = preset("cpu")
    gen = torch.Generator().manual_seed(3)
    ids, w = routing(3, cfg.E, cfg.K, "balanced", gen)
    save_file({"hidden_states": torch.randn(3, cfg.H, generator=gen), "topk_ids": ids, "topk_weights": w}, inp)
    locked = folder / "locked"
    locked.mkdir(mode=0o500)
    cases = [(str(folder / "missing" / "out.safetensors"), "does not exist"), (str(folder), "is a directory")]
    if os.geteuid() != 0:  # root writes anywhere: the permission case needs an ordinary user
        cases.append((str(locked / "out.safetensors"), "not writable"))
    runs = [(argv, needle) for out, needle in cases
            for argv in (["forward", "--input", inp, "--output", out, "--device", "cpu"], ["write-checkpoint", out])]
    return list(zip(runs, run_at_once([[*CLI, *argv] for argv, _ in runs], timeout=60), strict=True))


def _written_with_umask_022(folder):
    ckpt = folder / "ckpt.safetensors"
    r = subprocess.run(["sh", "-c", 'umask 022 && exec "$@"', "sh", *CLI, "write-checkpoint", str(ckpt)],
                       capture_output=True, text=True, timeout=120)
    return r, ckpt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every test's commands, in a folder of its own, run side by side once the first test asks: key ->
    Future of what they returned, in the tests' order."""
    def job(key, run, *args):
        jobs[key] = functools.partial(run, tmp_path_factory.mktemp("cli"), *args)

    jobs: dict = {}
    for naming, prefix, _, dtype in CHECKPOINTS:
        job(("checkpoint", naming), _forward_with_checkpoint, naming, prefix, dtype)
    job("synthetic", _forward_synthetic_weights_small_batch)
    job("bad input", _forward_bad_input)
    for change, needle in REFUSED:
        job(("refused", needle), _forward_refused, change)
    job("unwritable", _unwritable_output)
    job("umask 022", _written_with_umask_022)
    with side_by_side(jobs) as futures:
        yield futures


@pytest.mark.parametrize("naming,prefix,names,dtype", CHECKPOINTS)
def test_forward_with_checkpoint(runs, naming, prefix, names, dtype):
    written, r, ckpt, outp, (x, ids, w) = runs[("checkpoint", naming)].result()
    assert written.returncode == 0, written.stderr
    assert r.returncode == 0, r.stderr
    assert "tokens (" in r.stderr  # progress line of a multi-step batch
    cfg = preset("cpu")
    T = cfg.tokens_per_step + 37
    out = load_file(outp)["output"]
    assert out.dtype == dtype and out.shape == (T, cfg.H)
    ref = moe_reference(x.float(), ids, w, *checkpoint_weights(ckpt, prefix, names))
    assert rel_err(out, ref) <= TOL[dtype], rel_err(out, ref)


def test_forward_synthetic_weights_small_batch(runs):
    from service.moe.reference import full_weights

    r, outp, (x, ids, w) = runs["synthetic"].result()
    assert r.returncode == 0, r.stderr
    ref = moe_reference(x, ids, w, *full_weights(preset("cpu"), 4))
    assert rel_err(load_file(outp)["output"], ref) <= TOL[torch.float32]


def test_forward_bad_input_names_the_problem(runs):
    lacking, missing = runs["bad input"].result()
    assert lacking.returncode == 2
    assert "lacks ['topk_ids', 'topk_weights']" in lacking.stderr
    assert missing.returncode == 2 and "cannot read --input" in missing.stderr


@pytest.mark.parametrize("change, needle", REFUSED)
def test_forward_refuses_what_the_service_refuses(runs, change, needle):
    """The service's checks and messages, exit 2, nothing written: a NaN row was computed and
    written (exit 0), and an id past 32 bits was cast to int32 before its range was checked."""
    r, outp = runs[("refused", needle)].result()
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not outp.exists()


def test_unwritable_output_exits_2_before_any_work(runs):
    for (argv, needle), r in runs["unwritable"].result():
        assert r.returncode == 2, (argv, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "started" not in r.stderr, "the rank group started before the output was checked"


def test_written_files_are_readable_by_other_users(runs):
    """The image runs as UID 10001: a checkpoint written by another user and mounted must be readable."""
    r, ckpt = runs["umask 022"].result()
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o644
