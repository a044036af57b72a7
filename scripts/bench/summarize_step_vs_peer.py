#!/usr/bin/env python3
"""Summarizes a scripts/bench/step_vs_peer.sh output folder as one Markdown table with ratios.

q4train training: steps 3..N of train-metrics.jsonl (tokens/s = real tokens / wall time of
those steps, slot fill = real tokens / slots, median and slowest step, peak allocated); the
optimizer time comes from the probe on the same data (phases timed with syncs). Peer rows come
from the RESULT lines of peer.log. MFU = 6 x 4.41e9 trained parameters x tokens/s / 989 TFLOP/s
(dense bf16, H100/H200 SXM data sheet) for every row, so rows compare like for like.
"""
import json
import os
import statistics
import sys

PARAMS = 4411424256
PEAK = 989e12


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def main():
    d = sys.argv[1]
    rows = []
    m = [r for r in load_jsonl(os.path.join(d, "train-metrics.jsonl")) if r["step"] >= 3]
    if m:
        ms = [r["step_ms"] for r in m]
        tok = sum(r["tokens"] for r in m)
        slots = sum(r.get("slots", 0) for r in m)
        tps = tok / (sum(ms) / 1e3)
        peak = max((r.get("gpu_peak_bytes") or 0) for r in m) / 2**30
        opt_ms = None
        p = os.path.join(d, "probe-data.json")
        if os.path.exists(p):
            st = json.load(open(p)).get("info", {}).get("steady") or {}
            opt_ms = st.get("optimizer_ms_median")
        rows.append(dict(run="q4train training (bench data)", tps=tps,
                         fill=tok / slots if slots else None, med=statistics.median(ms),
                         slow=max(ms), peak=peak, opt=opt_ms, steps=len(m)))
    for name, label in (("probe-data.json", "q4train --probe (bench data)"),
                        ("probe-synth.json", "q4train --probe (synthetic rows)")):
        p = os.path.join(d, name)
        if not os.path.exists(p):
            continue
        st = json.load(open(p)).get("info", {}).get("steady") or {}
        if st:
            rows.append(dict(run=label, tps=st["tokens_per_s"], fill=st.get("slot_fill"),
                             med=st["step_ms_median"], slow=None,
                             peak=(st.get("peak_allocated_bytes") or 0) / 2**30,
                             opt=st.get("optimizer_ms_median"), steps=st["steps"]))
    peer = {}
    p = os.path.join(d, "peer.log")
    if os.path.exists(p):
        for line in open(p):
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                peer[r["mode"]] = r
                rows.append(dict(run="peer " + r["mode"], tps=r["tokens_per_s"], fill=1.0,
                                 med=r["step_s_median"] * 1e3, slow=None, peak=r["peak_alloc_gib"],
                                 opt=r["optimizer_ms_median"], steps=4))
    gpu = open(os.path.join(d, "gpu.txt")).read().strip() if os.path.exists(
        os.path.join(d, "gpu.txt")) else "?"
    modes = [k for k in ("ste", "ste+compile", "plain", "plain+nockpt") if k in peer]
    print(f"GPU: {gpu}\n")
    head = ["run", "real tok/s", "slot fill", "median step ms", "slowest ms", "peak GiB",
            "optimizer ms", "MFU"] + [f"x {k}" for k in modes]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    f = lambda v, spec: "-" if v is None else format(v, spec)
    for r in rows:
        cells = [r["run"], f(r["tps"], ",.0f"), f(r["fill"], ".1%"), f(r["med"], ".1f"),
                 f(r["slow"], ".1f"), f(r["peak"], ".2f"), f(r["opt"], ".1f"),
                 f(6 * PARAMS * r["tps"] / PEAK, ".1%")]
        cells += [f(r["tps"] / peer[k]["tokens_per_s"], ".2f") for k in modes]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
