#!/usr/bin/env python3
"""Sums the CUDA kernel time of a Kineto Chrome trace (q4train --profile-trace) by kernel name
and prints the top N with their share, then where the GPU sat idle: the largest gaps between
consecutive kernels with the host calls (CUDA runtime, ATen ops) that overlapped them.
kernel_table.py TRACE.json [N]."""
import collections
import json
import sys


def main(events):
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    by_name = collections.defaultdict(lambda: [0.0, 0])
    total = 0.0
    t_min, t_max = float("inf"), 0.0
    for e in events:
        if e.get("cat") in ("kernel", "Kernel") and "dur" in e:
            by_name[e["name"]][0] += e["dur"]
            by_name[e["name"]][1] += 1
            total += e["dur"]
            t_min = min(t_min, e["ts"])
            t_max = max(t_max, e["ts"] + e["dur"])
    span = t_max - t_min if t_max > t_min else 0.0
    print(f"kernel time {total / 1e3:.1f} ms over a span of {span / 1e3:.1f} ms "
          f"({(total / span if span else 0):.1%} busy), {sum(c for _, c in by_name.values())} launches")
    print("| ms | share | launches | kernel |\n|---|---|---|---|")
    for name, (dur, cnt) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {dur / 1e3:.2f} | {dur / total:.1%} | {cnt} | {name[:110]} |")


def gaps(events, top=15, min_us=100.0):
    """Idle stretches of the GPU (no kernel or memcpy running) and what the host did meanwhile."""
    dev = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                 if e.get("cat") in ("kernel", "Kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cpu_op", "user_annotation")
            and "dur" in e]
    if not dev:
        return
    out, end, prev = [], dev[0][1], dev[0][2]
    for ts, te, name in dev[1:]:
        if ts - end >= min_us:
            out.append((ts - end, end, ts, prev, name))
        if te > end:
            end, prev = te, name
    total = sum(g[0] for g in out)
    print(f"\nidle gaps >= {min_us / 1e3:.1f} ms: {len(out)}, {total / 1e3:.1f} ms in all; largest:")
    print("| gap ms | at ms | after kernel | host calls overlapping (longest first) |\n|---|---|---|---|")
    t0 = dev[0][0]
    for g, a, b, prev, nxt in sorted(out, reverse=True)[:top]:
        over = sorted(((min(b, e["ts"] + e["dur"]) - max(a, e["ts"]), e["name"]) for e in host
                       if e["ts"] < b and e["ts"] + e["dur"] > a), reverse=True)[:4]
        desc = ", ".join(f"{n[:40]} {d / 1e3:.2f}" for d, n in over)
        print(f"| {g / 1e3:.2f} | {(a - t0) / 1e3:.1f} | {prev[:50]} | {desc} |")


if __name__ == "__main__":
    trace = json.load(open(sys.argv[1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    main(events)
    gaps(events)
