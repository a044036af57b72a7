#!/usr/bin/env python3
"""Sums the CUDA kernel time of a Kineto Chrome trace (q4train --profile-trace) by kernel name
and prints the top N with their share: kernel_table.py TRACE.json [N]."""
import collections
import json
import sys


def main():
    trace = json.load(open(sys.argv[1]))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
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


if __name__ == "__main__":
    main()
