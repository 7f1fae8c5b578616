"""Triton-interpreter cases in a child process: the test module's fixture and the child's entry.

TRITON_INTERPRET is read when `@triton.jit` decorates, so interpreter cases cannot share a process
with compiled kernels (the compile-only tests, the GPU tests, other packages' kernels). A test
module's fixture runs the module itself as a script with TRITON_INTERPRET=1 (`run_cases`); its
`__main__` block runs every case once (`main`) and prints one JSON object, case name -> record, and
each test asserts on its case's record. A module that returns `job(__file__)` from its
`background_jobs()` has its run started once collection ends, in the background (tests/background.py).
By hand:

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/test_combine.py [case ...]
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from tests import background

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 240  # every case of a module, one after another
OUTPUT_TAIL = 3000  # characters of the child's stdout and stderr shown when it fails


def job(script: str) -> background.Job:
    """The run of `script` (a test module's __file__) under the interpreter, every case."""
    path = Path(script).resolve()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return background.Job.of(f"interpreter {path.relative_to(ROOT)}", [sys.executable, str(path)], RUN_TIMEOUT_S,
                             env=env, cwd=ROOT)


def run_cases(script: str) -> dict:
    """Run `script` (a test module's __file__) under the interpreter, or take the run started in the
    background; its records by case name."""
    proc = background.result(job(script))
    assert proc.returncode == 0, \
        f"interpreter run failed:\n{proc.stdout[-OUTPUT_TAIL:]}\n{proc.stderr[-OUTPUT_TAIL:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def patch_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter turns scalars into 1-element arrays and calls int() on them in
    range(); numpy >= 2.4 rejects int() of arrays with ndim > 0. Index through the element."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def main(cases: Iterable[str], run_case: Callable[[str], dict]) -> None:
    """The child: run the cases named on the command line (else all), seed 0, and print their
    records as one JSON line; a case that raises records the exception for its test to report."""
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    patch_interpreter_for_numpy_2_4()
    torch.manual_seed(0)
    out = {}
    for case in sys.argv[1:] or list(cases):
        try:
            out[case] = run_case(case)
        except Exception as exc:  # reported per case by the parent test
            out[case] = {"exception": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    sys.stdout.write(json.dumps(out) + "\n")
