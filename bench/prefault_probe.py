"""How often a CUDA rank registers a client's regions again when its input and output regions lie in
one object (--shm-direct; service.worker.direct), with and without the read pre-fault before the
page-locking (the second review's fault: page-locking write-faults tmpfs pages, which moves the
object's ctime, so each region's registration made the other look stale).

    python bench/prefault_probe.py [--steps 5]   # needs a GPU

Prints, per arm, the registrations over --steps steps (2 are due: one per region) and the mean time of
a step's plan + DMA in + DMA out."""

from __future__ import annotations

import argparse
import os
import time
import uuid

import torch

from service.worker import direct
from service.worker.rank import _dma_in, _dma_out


def arm(prefault: bool, steps: int, H: int = 4096, n: int = 512) -> tuple[int, float]:
    row_bytes = H * 2
    key = f"/probe-{uuid.uuid4().hex[:12]}"
    path = f"{direct.SHM_ROOT}/{key[1:]}"
    size = 2 * n * row_bytes
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    ident = direct.identity(fd)
    rows = torch.randn(n, H).to(torch.bfloat16)
    os.pwrite(fd, direct.memory(rows), 0)
    os.close(fd)
    src, dst = (0, n * row_bytes), (n * row_bytes, n * row_bytes)
    sources = [(0, n, key, ident, 0, key, ident, n * row_bytes, src, dst)]
    real_register, real_libc, count = direct.Objects._register, direct._LIBC, [0]

    class NoAdvice:  # the pre-fault left out: page-locking faults the pages in itself
        @staticmethod
        def madvise(*_):
            return 0

    def counting(self, entry):
        count[0] += 1
        return real_register(self, entry)

    direct.Objects._register = counting
    if not prefault:
        direct._LIBC = NoAdvice
    cache = direct.Objects(cuda=True)
    dev = torch.empty(n, H, dtype=torch.bfloat16, device="cuda")
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            plan = direct.plan(sources, cache, row_bytes, (0, n), (0, n))
            assert plan.report == {}, plan.report
            _dma_in(dev, torch.zeros(n, H, dtype=torch.bfloat16), plan, row_bytes)
            _dma_out(dev, torch.empty(n, H, dtype=torch.bfloat16), plan, row_bytes)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        direct.Objects._register, direct._LIBC = real_register, real_libc
        cache.close()
        os.unlink(path)
    return count[0], sum(times[1:]) / max(1, len(times) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    for prefault in (True, False, True):
        n, t = arm(prefault, args.steps)
        print(f"pre-fault {'on ' if prefault else 'off'}: {n} registrations over {args.steps} steps (2 due); "
              f"a step after the first {t * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
