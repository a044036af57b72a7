#!/usr/bin/env python3
"""The fine-tune benchmark's table (scripts/bench/quality_ft.sh, docs/quality.md).

  quality_ft_summary.py WORK SEED...
reads WORK/eval-NAME-{cls,subj,pre}.json (q4eval --json) of base, base_ptq and, per seed s,
a{s}_plain, a{s}, b{s}, c{s}, d{s}, e{s}, b32_{s}, bd_{s}, cd_{s} (every arm WORK holds, from
this call or an earlier one; an arm scored for only some seeds is left out with a note); prints
per arm the mean
+- sample standard deviation
over the seeds of every score, then every pair of shipped arms whose difference of means exceeds
2 sigma, sigma = sqrt(sd_x^2 / n_x + sd_y^2 / n_y) (the standard error of the difference).
Scores: task loss (mean token loss over the answers of both held-out instructions), spam/ham
exact match, subject-line loss, forgetting (held-out loss on pretraining text).
"""
import json
import math
import os
import sys

ARMS = [("a_plain", "(a) plain fine-tune, before PTQ (not shipped)"),
        ("a", "(a) plain fine-tune, then PTQ: the peer path"),
        ("b", "(b) QAT from the NVFP4 base"),
        ("c", "(c) QAD from the NVFP4 base, teacher (a)"),
        ("d", "(d) LoRA r16 merge-aware from the NVFP4 base"),
        ("e", "(e) QAT, 4-over-6 block rule"),
        ("b32", "(b32) QAT, fp32 masters and moments (as (a))"),
        ("bd", "(bd) QAT, fp32 masters and moments, dithered masters"),
        ("cd", "(cd) QAD, fp32 masters and moments, dithered masters")]
SCORES = [("task_loss", "task loss", 4, -1), ("exact_match", "spam/ham exact match", 4, 1),
          ("subject_loss", "subject loss", 4, -1), ("forgetting", "pretraining loss", 4, -1)]


def scores(work, name):
    ev = {k: json.load(open(f"{work}/eval-{name}-{k}.json")) for k in ("cls", "subj", "pre")}
    nll = ev["cls"]["nll"] + ev["subj"]["nll"]
    tokens = ev["cls"]["tokens"] + ev["subj"]["tokens"]
    return {"task_loss": nll / tokens, "exact_match": ev["cls"].get("exact_match", float("nan")),
            "subject_loss": ev["subj"]["loss"], "forgetting": ev["pre"]["loss"]}


def mean_sd(xs):
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def main():
    work, seeds = sys.argv[1], sys.argv[2:]
    fixed = {"base": scores(work, "base"), "base_ptq": scores(work, "base_ptq")}
    def run_name(arm, seed):  # a{s}_plain, a{s}, b{s}, ..., b32_{s} as quality_ft.sh names them
        if arm == "a_plain":
            return f"a{seed}_plain"
        return f"{arm}{seed}" if len(arm) == 1 else f"{arm}_{seed}"
    arms = []
    for arm, label in ARMS:
        missing = [s for s in seeds
                   if not os.path.exists(f"{work}/eval-{run_name(arm, s)}-pre.json")]
        if len(missing) == len(seeds):
            continue
        if missing:
            print(f"note: ({arm}) left out, no scores for seed(s) {' '.join(missing)}")
            continue
        arms.append((arm, label))
    per = {arm: [scores(work, run_name(arm, s)) for s in seeds] for arm, _ in arms}
    print(f"seeds: {' '.join(seeds)}")
    print("| model | " + " | ".join(label for _, label, _, _ in SCORES) + " |")
    print("|---" * (len(SCORES) + 1) + "|")
    for key, label in (("base", "base (plain precision)"), ("base_ptq", "base, PTQ (NVFP4)")):
        print(f"| {label} | " + " | ".join("-" if math.isnan(fixed[key][k]) else f"{fixed[key][k]:.{d}f}"
                                          for k, _, d, _ in SCORES) + " |")
    stats = {}
    for arm, label in arms:
        stats[arm] = {k: mean_sd([r[k] for r in per[arm]]) for k, _, _, _ in SCORES}
        cells = [f"{stats[arm][k][0]:.{d}f} ± {stats[arm][k][1]:.{d}f}" for k, _, d, _ in SCORES]
        print(f"| {label} | " + " | ".join(cells) + " |")
    # QAD's recovery of (a)'s PTQ gap, per seed: (L_a+PTQ - L_c) / (L_a+PTQ - L_a).
    for qad in ("c", "cd"):
        rec = []
        for i in range(len(seeds) if {"a", "a_plain", qad} <= set(per) else 0):
            gap = per["a"][i]["task_loss"] - per["a_plain"][i]["task_loss"]
            if gap != 0:
                rec.append(100 * (per["a"][i]["task_loss"] - per[qad][i]["task_loss"]) / gap)
        if rec:
            m, sd = mean_sd(rec)
            print(f"\n({qad}) QAD recovers {m:.1f}% ± {sd:.1f}% of (a)'s PTQ gap in task loss "
                  f"(per seed: {', '.join(f'{r:.1f}%' for r in rec)})")
    print("\nDifferences of shipped arms beyond 2 sigma (sigma: standard error of the "
          "difference of means; 'better' by the score's direction):")
    shipped = [a for a, _ in arms if a != "a_plain"]
    n = len(seeds)
    found = False
    for k, label, d, sign in SCORES:
        for i, x in enumerate(shipped):
            for y in shipped[i + 1:]:
                (mx, sx), (my, sy) = stats[x][k], stats[y][k]
                sigma = math.sqrt(sx * sx / n + sy * sy / n)
                diff = mx - my
                if n > 1 and abs(diff) > 2 * sigma:
                    better = x if diff * sign > 0 else y
                    sig = f"{abs(diff) / sigma:.1f} sigma" if sigma > 0 else "sigma 0"
                    print(f"- {label}: ({x}) - ({y}) = {diff:+.{d}f} ({sig}): ({better}) better")
                    found = True
    if not found:
        print("- none")


if __name__ == "__main__":
    main()
