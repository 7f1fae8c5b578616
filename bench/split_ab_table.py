"""The table of a bench/split_ab.sh output: per cell and tree, each round's p50, tokens/s, compute_input
and compute_output (ms per request, the server's books).

    python bench/split_ab_table.py split_ab.txt
"""

from __future__ import annotations

import collections
import re
import sys

ROW = re.compile(r"round (\d+) tree (\S+) \| (\w+) \| (\d+) \| (\d+) \| \d+ \| ([\d,]+) \| ([\d.]+) \|")
PHASE = re.compile(r"compute_(input|output): ([\d.]+) ms")


def main() -> int:
    cells: dict[tuple, list[dict]] = collections.defaultdict(list)
    cur: dict = {}
    with open(sys.argv[1]) as f:
        for line in f:
            if m := ROW.match(line):
                _, tree, proto, T, c, tps, p50 = m.groups()
                cur = {"tokens/s": int(tps.replace(",", "")), "p50": float(p50)}
                cells[(proto, int(T), int(c), tree)].append(cur)
            elif (m := PHASE.search(line)) and cur:
                cur[m.group(1)] = float(m.group(2))
    print("| protocol | T | c | tree | p50 ms | tokens/s | compute_input ms | compute_output ms |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(cells):
        rounds = cells[key]

        def each(name: str, fmt: str = "{:.2f}", rounds=rounds) -> str:
            return " / ".join(fmt.format(r[name]) if name in r else "-" for r in rounds)

        print(f"| {' | '.join(map(str, key))} | {each('p50')} | {each('tokens/s', '{:,}')} | {each('input')} | "
              f"{each('output')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
