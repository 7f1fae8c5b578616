"""A py-spy raw profile (`py-spy record --format raw --subprocesses`) in a few lines: samples per
process (its pid), and the service frames (the deepest `service/` frame of each stack) with the most samples.

    python bench/pyspy_summary.py PROFILE.txt [--top 25]

Each line of the raw format is one stack, its frames joined by ';' (the first names the process),
then a space and its sample count.
"""

from __future__ import annotations

import argparse
import collections


def summarize(lines, top: int) -> list[str]:
    per_process: collections.Counter[str] = collections.Counter()
    per_frame: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # with --subprocesses a child's stack starts with its parents' "process PID:cmdline" frames
        process = [f for f in frames if f.startswith("process ")][-1].split(":", 1)[0]
        per_process[process] += int(count)
        service = [f for f in frames if "service/" in f]
        per_frame[process, (service[-1] if service else frames[-1])[:120]] += int(count)
    total = sum(per_process.values()) or 1
    out = [f"{total} samples"]
    out += [f"{n:7d} {100 * n / total:5.1f} %  {p}" for p, n in per_process.most_common()]
    out.append(f"top {top} frames (the deepest service/ frame of each stack):")
    out += [f"{n:7d} {100 * n / total:5.1f} %  {p[:30]}  {f}" for (p, f), n in per_frame.most_common(top)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    with open(args.profile) as f:
        print("\n".join(summarize(f, args.top)))  # noqa: T201 (a bench script prints)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
