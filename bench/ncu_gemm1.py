"""Side-by-side table of ncu reports of GEMM1 kernels (bench/gpu_ncu_gemm1.sh, issue 12t).

    python bench/ncu_gemm1.py RAW.csv [SOURCE.csv]

RAW.csv: `ncu --import R.ncu-rep --page raw --csv` (one row per profiled launch, the units in the row
under the header: scaled here, so that either unit option of ncu gives the same table).
Prints per launch: duration, tensor pipe utilisation (the collected `pipe_tensor` % metrics), SM and
L2 throughput (% of peak), DRAM read rate and bytes, L2 hit rate, L2 -> L1 bytes, achieved occupancy,
registers, and the three largest stall reasons over all warps (WarpStateStats: cycles per issued
instruction spent in each reason; producer and consumer warps together).
SOURCE.csv (optional): `ncu --import R.ncu-rep --page source --csv --print-source sass` of the same
report: the SASS lines with the most warp-stall samples, per kernel block of the file, which
separates the consumer warps' waits (HGMMA, WARPGROUP.DEPBAR, their SYNCS.PHASECHK on `full`) from
the producer's (LDGSTS, its SYNCS on `empty`). Best effort: a format it does not know is said, not
guessed.
"""

from __future__ import annotations

import csv
import re
import sys

STALL = re.compile(r"smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio$")


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


PREFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
UNIT = re.compile(r"^([numKMGT]?)(?:byte|second)(?:/(?:second|s))?$")


def _first(row: dict, *names: str, units: dict | None = None) -> float | None:
    """The first of `names` the launch has, in base units (seconds, bytes, bytes/second) when its
    unit in `units` has a prefix (usecond, Gbyte/second, ...), else as printed."""
    for name in names:
        if name in row and _num(row[name]) is not None:
            unit = UNIT.match((units or {}).get(name, ""))
            return _num(row[name]) * (PREFIX[unit.group(1)] if unit else 1.0)
    return None


def raw_table(path: str) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        print(f"{path}: no 'Kernel Name' header: not an ncu raw CSV")
        return
    header = rows[start]
    units = dict(zip(header, rows[start + 1], strict=False)) if len(rows) > start + 1 else {}
    launches = [dict(zip(header, r, strict=False)) for r in rows[start + 2:] if len(r) == len(header)]
    tensor = [h for h in header if "pipe_tensor" in h and "pct" in h][:3]  # utilisation, % of peak
    print("| launch | kernel | us | " + " | ".join(tensor) + " | SM % | L2 % | DRAM GB/s | DRAM read MB | "
          "L2 hit % | L2->L1 MB | occupancy % | regs | top stalls (cycles per issue) |")
    print("|" + "---|" * (12 + len(tensor)))
    for row in launches:
        us = _first(row, "gpu__time_duration.sum", units=units)
        us = us * 1e6 if us is not None else None
        stalls = sorted(((v, m.group(1)) for h, v in ((h, _num(row[h])) for h in header)
                         if (m := STALL.search(h)) and v is not None), reverse=True)[:3]
        values = [us, *(_first(row, t) for t in tensor),
                  _first(row, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                  _first(row, "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
                  (_first(row, "dram__bytes_read.sum.per_second", units=units) or 0) / 1e9,
                  (_first(row, "dram__bytes_read.sum", units=units) or 0) / 1e6,
                  _first(row, "lts__t_sector_hit_rate.pct"),
                  (_first(row, "l1tex__m_xbar2l1tex_read_bytes.sum", units=units) or 0) / 1e6,
                  _first(row, "sm__warps_active.avg.pct_of_peak_sustained_active"),
                  _first(row, "launch__registers_per_thread")]
        cells = ["-" if v is None else f"{v:.1f}" for v in values]
        full = row.get("Kernel Name", "?")  # demangled: keep the name and its template argument (the variant)
        name = m.group(0) if (m := re.search(r"\w*_kernel(<\d+>)?", full)) else full[:40]
        print(f"| {row.get('ID', '?')} | {name} | " + " | ".join(cells) + " | "
              + ", ".join(f"{n} {v:.2f}" for v, n in stalls) + " |")


def source_top(path: str, top: int = 8) -> None:
    """The SASS lines with the most stall samples, per block of the source CSV (one per kernel)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    blocks, current = [], None
    for r in rows:
        col = next((i for i, h in enumerate(r) if h.startswith("Warp Stall Sampling (All")), None)
        if col is not None and "Source" in r:
            current = (r, col, r.index("Source"), [])
            blocks.append(current)
        elif current is not None and len(r) == len(current[0]):
            current[3].append(r)
    if not blocks:
        print(f"{path}: no 'Source' / 'Warp Stall Sampling (All Samples)' header: format unknown, see the file")
        return
    for n, (_header, col, src, lines) in enumerate(blocks):
        total = sum(_num(r[col]) or 0 for r in lines) or 1
        print(f"-- source block {n}: {len(lines)} SASS lines, {total:.0f} stall samples; the top {top}:")
        for r in sorted(lines, key=lambda r: _num(r[col]) or 0, reverse=True)[:top]:
            print(f"   {(_num(r[col]) or 0) / total:6.1%}  {r[src].strip()[:90]}")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    raw_table(sys.argv[1])
    if len(sys.argv) > 2:
        source_top(sys.argv[2])


if __name__ == "__main__":
    main()
