"""Where a served request's time goes, from the server's own books (a running server).

    python bench/latency_split.py --url http://127.0.0.1:18000 [--model moe] [--before before.json]

Reads /metrics and /v2/models/{model}/stats and prints, per answered request (means over the
requests since `--before`, a snapshot this script wrote with --save): the server's arrival-to-answer
time by protocol (moe_request_duration_seconds: HTTP from the request's first byte, gRPC from the
deserializer's start), the receive inside it (moe_request_receive_seconds: HTTP first byte to the
body read, gRPC the deserializer), the send after it (moe_response_send_seconds, HTTP: the
response handed to the connection), the statistics' queue, compute_input (rows into
the slot), compute_infer (group.run: the send to the ranks, their step, the answers) and
compute_output (rows out of the slot), and per step the layer time on rank 0 (moe_layer_seconds)
with its stages, and a step's wall time in the group's owner and on rank 0 (moe_step_seconds), cut
into its phases (moe_step_phase_seconds, in service.metrics.STEP_PHASES order; they add up to part=group).
The client's time minus the server's is the wire and the client; compute_infer
minus the layer is the hop to the ranks and the ranks' own host work.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.metrics import STEP_PHASES  # noqa: E402

PER_STEP = ("moe_layer_seconds_count", "moe_stage_seconds_count", "moe_step_seconds_count")


def snapshot(url: str, model: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count")) and fam.name in (
                    "moe_request_duration_seconds", "moe_request_receive_seconds", "moe_response_send_seconds",
                    "moe_layer_seconds", "moe_stage_seconds", "moe_step_seconds", "moe_step_phase_seconds"):
                key = s.name + "|" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                sums[key] = sums.get(key, 0.0) + s.value
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.load(r)["model_stats"][0]["inference_stats"]
    for k, v in stats.items():
        sums[f"stats_{k}_count"] = float(v["count"])
        sums[f"stats_{k}_ns"] = float(v["ns"])
    return sums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="moe")
    p.add_argument("--before", help="a snapshot written by --save: report the difference")
    p.add_argument("--save", help="write this snapshot here")
    args = p.parse_args()
    now = snapshot(args.url, args.model)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(now, f)
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
        now = {k: v - before.get(k, 0.0) for k, v in now.items()}
    ms = lambda s, c: 1e3 * s / c if c else float("nan")  # noqa: E731
    for key in sorted(k for k in now if k.startswith("moe_request_duration_seconds_count")):
        labels = key.split("|", 1)[1]
        total = now.get(key.replace("_count", "_sum"), 0.0)
        if now[key]:
            print(f"server arrival->answer {labels}: {ms(total, now[key]):.2f} ms over {now[key]:.0f} requests")
    for family, what in (("moe_request_receive_seconds", "receive (in arrival->answer)"),
                         ("moe_response_send_seconds", "send (after it)")):
        for key in sorted(k for k in now if k.startswith(family + "_count")):
            if now[key]:
                print(f"server {what} {key.split('|', 1)[1]}: "
                      f"{ms(now.get(key.replace('_count', '_sum'), 0.0), now[key]):.2f} ms over {now[key]:.0f}")
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        c, ns = now.get(f"stats_{part}_count", 0.0), now.get(f"stats_{part}_ns", 0.0)
        print(f"statistics {part}: {ms(ns * 1e-9, c):.3f} ms over {c:.0f}")
    for key in sorted(k for k in now if k.startswith(PER_STEP)):
        labels = key.split("|", 1)[1]
        name = key.split("_count")[0]
        total = now.get(key.replace("_count", "_sum"), 0.0)
        if now[key]:
            print(f"{name} {labels}: {ms(total, now[key]):.3f} ms per step over {now[key]:.0f} steps")
    phase = lambda p, part: now.get(f"moe_step_phase_seconds_{part}|phase={p}", 0.0)  # noqa: E731
    phases = [(p, phase(p, "sum"), phase(p, "count")) for p in STEP_PHASES]
    if any(c for _, _, c in phases):
        print("step phases, ms per step: " + ", ".join(f"{p} {ms(s, c):.3f}" for p, s, c in phases)
              + f" (sum {sum(ms(s, c) for _, s, c in phases if c):.3f})")


if __name__ == "__main__":
    main()
