#!/usr/bin/env python3
"""Where a traced step's time goes when state crosses PCIe (q4train --profile-trace with
optim.offload): the GPU timeline cut into bins, each with the share of time a kernel ran, the
host-to-device and device-to-host copy rates, and the phase the host was in (the trainer's
forward / backward / optimizer ranges). Then totals per phase.
copy_timeline.py TRACE.json [BIN_MS]"""
import collections
import json
import sys

PHASES = ("forward", "backward", "optimizer")


def union_length(intervals, lo, hi):
    """Length of the union of [a, b) intervals clipped to [lo, hi)."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def main():
    events = json.load(open(sys.argv[1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    bin_us = float(sys.argv[2]) * 1e3 if len(sys.argv) > 2 else 100e3
    kernels, copies = [], collections.defaultdict(list)  # direction -> (ts, te, bytes)
    phases = []
    for e in events:
        if "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "Kernel"):
            kernels.append((e["ts"], e["ts"] + e["dur"]))
        elif cat == "gpu_memcpy":
            name = e["name"]
            d = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else "other"
            copies[d].append((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("bytes", 0)))
        elif cat == "user_annotation" and e["name"] in PHASES:
            phases.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    if not kernels:
        sys.exit("no kernels in the trace")
    t0 = min(a for a, _ in kernels)
    t1 = max(b for _, b in kernels)
    for d in copies.values():
        t1 = max(t1, max(b for _, b, _ in d))
    print(f"span {(t1 - t0) / 1e3:.1f} ms; copies: " + ", ".join(
        f"{d} {sum(n for *_, n in v) / 1e9:.2f} GB in {len(v)}" for d, v in copies.items()))

    def rate(d, lo, hi):
        """GB/s moved in [lo, hi) (bytes apportioned by overlap) and the busy share."""
        moved = 0.0
        for a, b, n in copies.get(d, []):
            if b > lo and a < hi and b > a:
                moved += n * (min(b, hi) - max(a, lo)) / (b - a)
        busy = union_length([(a, b) for a, b, _ in copies.get(d, [])], lo, hi)
        return moved / 1e3 / (hi - lo), busy / (hi - lo)

    def phase_at(lo, hi):
        best = collections.Counter()
        for a, b, n in phases:
            if b > lo and a < hi:
                best[n] += min(b, hi) - max(a, lo)
        return best.most_common(1)[0][0] if best else "-"

    print(f"\n| at ms | host phase | kernels busy | HtoD GB/s (busy) | DtoH GB/s (busy) |")
    print("|---:|---|---:|---:|---:|")
    lo = t0
    while lo < t1:
        hi = min(lo + bin_us, t1)
        k = union_length(kernels, lo, hi) / (hi - lo)
        h, hb = rate("HtoD", lo, hi)
        o, ob = rate("DtoH", lo, hi)
        print(f"| {(lo - t0) / 1e3:.0f} | {phase_at(lo, hi)} | {k:.0%} | {h:.1f} ({hb:.0%}) "
              f"| {o:.1f} ({ob:.0%}) |")
        lo = hi

    # Per phase of the host (its ranges; the GPU work they launched runs a little later).
    print("\n| phase | host ms | GB HtoD | GB DtoH |\n|---|---:|---:|---:|")
    for name in PHASES:
        spans = [(a, b) for a, b, n in phases if n == name]
        ms = sum(b - a for a, b in spans) / 1e3
        h = sum(rate("HtoD", a, b)[0] * (b - a) / 1e6 for a, b in spans)
        o = sum(rate("DtoH", a, b)[0] * (b - a) / 1e6 for a, b in spans)
        print(f"| {name} | {ms:.1f} | {h:.2f} | {o:.2f} |")


if __name__ == "__main__":
    main()
