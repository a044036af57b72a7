#!/usr/bin/env python3
"""List what TensorBoard's own reader finds in q4train's event files.

Usage: python3 scripts/bench/read_tfevents.py RUN_DIR_OR_EVENT_FILE [--require TAG ...]

Uses the `tensorboard` package (EventAccumulator, the loader TensorBoard itself runs; no
TensorFlow needed) to load events.out.tfevents.* written by the C++ TfEventsWriter, prints each
scalar tag with its step count, first and last (step, value), and each text tag with its last
value. Exits 1 when nothing loads or a --require'd tag is missing, so it can gate a check.
"""
import argparse
import os
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="run directory or one events.out.tfevents.* file")
    ap.add_argument("--require", nargs="*", default=[], help="tags that must be present")
    args = ap.parse_args()
    acc = event_accumulator.EventAccumulator(
        args.path, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = tags.get("scalars", [])
    tensors = tags.get("tensors", [])
    print(f"{args.path}: {len(scalars)} scalar tags, {len(tensors)} tensor/text tags")
    for tag in sorted(scalars):
        ev = acc.Scalars(tag)
        print(f"  scalar {tag}: {len(ev)} points, first (step {ev[0].step}, {ev[0].value:.6g}), "
              f"last (step {ev[-1].step}, {ev[-1].value:.6g})")
    for tag in sorted(tensors):
        ev = acc.Tensors(tag)
        last = ev[-1]
        vals = list(last.tensor_proto.string_val)
        text = vals[0].decode("utf-8", "replace") if vals else "<non-string tensor>"
        print(f"  text   {tag}: {len(ev)} events, last (step {last.step}): {text[:100]!r}")
    missing = [t for t in args.require if t not in scalars and t not in tensors]
    if missing:
        print(f"missing tags: {missing}", file=sys.stderr)
        return 1
    if not scalars and not tensors:
        print("no scalars or text found", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
