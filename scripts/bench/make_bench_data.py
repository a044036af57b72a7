#!/usr/bin/env python3
"""Deterministic benchmark dataset for scripts/bench/step_vs_peer.sh: chat examples (JSONL,
{"messages": [...]}) of widely varied length, from a fixed word list and a seeded generator,
so every run and every machine trains on the same tokens.

--preference writes TRL preference pairs instead ({"prompt", "chosen", "rejected"}: a prompt of
8-160 words and two answers of 24-640 words each), for the preference step's benchmark.

Lengths: prompt 8-160 words, answer 24-640 words (about 1.3 tokens a word with the Qwen3
tokenizer), so examples span roughly 50-1,000 tokens and fit a 1,024-token row; a quarter
are two-turn conversations. Usage: make_bench_data.py [--examples N] [--seed S] [--preference] > bench.jsonl
"""
import argparse
import json
import random
import sys

WORDS = """the of and to in is that for it as was with be by on not he this are or his from at
which but have an they you were her she there one all we their has been if more when will would
who so no time people year way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face others
level office door health person art war history party result change morning reason research girl
guy moment air teacher force education model training weight gradient matrix token layer memory
kernel compute tensor vector scale block quantize format export checkpoint optimizer learning rate
loss batch sequence attention head norm value key query output input data file path read write
small large fast slow early late good new first last long great little own other old big high
different local important public bad same able human major better social national free strong
make know take see come think look want give use find tell ask seem feel try leave call keep let
begin help talk turn start show hear play run move live believe hold bring happen write provide
sit stand lose pay meet include continue set learn lead understand watch follow stop create speak
allow add spend grow open walk win offer remember love consider appear buy wait serve die send
expect build stay fall cut reach kill remain suggest raise pass sell require report decide pull""".split()

PUNCT = [".", ".", ".", ",", ",", "?", "!", ";"]


def sentence_stream(rng, n_words):
    out, since = [], 0
    for i in range(n_words):
        w = rng.choice(WORDS)
        if since == 0:
            w = w.capitalize()
        out.append(w)
        since += 1
        if since > 4 and rng.random() < 0.12:
            out[-1] += rng.choice(PUNCT)
            since = 0 if out[-1][-1] in ".?!" else since
    return " ".join(out) + "."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=20261126)
    ap.add_argument("--preference", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.preference:
        for _ in range(args.examples):
            budget = int(rng.triangular(40, 760, 200))
            p = max(8, min(160, int(budget * rng.uniform(0.1, 0.35))))
            pair = {"prompt": sentence_stream(rng, p)}
            for side in ("chosen", "rejected"):
                pair[side] = sentence_stream(rng, max(24, min(640, int(rng.uniform(0.5, 1.0) * (budget - p)))))
            sys.stdout.write(json.dumps(pair, ensure_ascii=False) + "\n")
        return
    for _ in range(args.examples):
        turns = 2 if rng.random() < 0.25 else 1
        budget = int(rng.triangular(40, 760, 200))  # words for the whole conversation
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": sentence_stream(rng, rng.randint(6, 24))})
        for t in range(turns):
            share = budget // turns
            p = max(8, min(160, int(share * rng.uniform(0.1, 0.35))))
            a = max(24, min(640, share - p))
            msgs.append({"role": "user", "content": sentence_stream(rng, p)})
            msgs.append({"role": "assistant", "content": sentence_stream(rng, a)})
        sys.stdout.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
