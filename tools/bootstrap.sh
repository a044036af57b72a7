#!/usr/bin/env bash
# Set-up on a fresh Debian 12 machine: installs the apt packages, fetches the tokenizer asset,
# configures and builds into build/. Without arguments it builds what the demo, the chat and the evaluation need
# (q4train, q4chat, q4eval and their libraries); with --tests it also installs GoogleTest and builds
# everything else: the other tools and the test binaries. Idempotent and quiet on success (with
# Q4_TIMES=1, one "bootstrap: STEP ok in Ns" line per step); prints the failing step's log on
# error. Usage: tools/bootstrap.sh [--tests] [extra cmake args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tests=0
if [ "${1:-}" = --tests ]; then tests=1; shift; fi
log=$(mktemp); trap 'rm -f "$log"' EXIT
step() {  # step NAME CMD...: run quietly, show the log on failure
  local name=$1 t0=$SECONDS; shift
  if ! "$@" >"$log" 2>&1; then echo "bootstrap: $name failed:" >&2; tail -n 40 "$log" >&2; exit 1; fi
  [ "${Q4_TIMES:-0}" != 1 ] || echo "bootstrap: $name ok in $((SECONDS - t0))s"
}

pkgs=(build-essential cmake ninja-build pkg-config libtorch-dev libyaml-cpp-dev libfmt-dev
      libcli11-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev libgloo-dev
      libopenblas0-pthread   # LibTorch's libblas.so.3 otherwise falls back to the slow reference BLAS
      libedit2               # q4chat's line editing, loaded at run time (optional: plain lines without it)
      curl ca-certificates)  # tools/fetch_tokenizer.sh
[ "$tests" = 0 ] || pkgs+=(libgtest-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  step "apt-get update" $sudo apt-get update -qq
  step "apt-get install" env DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

step "fetch tokenizer" tools/fetch_tokenizer.sh
# The demo set-up leaves the tests out of a new build directory; one configured with them keeps them.
opts=()
if [ "$tests" = 1 ]; then opts=(-DQ4_BUILD_TESTS=ON)
elif [ ! -f build/CMakeCache.txt ]; then opts=(-DQ4_BUILD_TESTS=OFF); fi
step "cmake configure" cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${opts[@]}" "$@"
if [ "$tests" = 1 ]; then
  step "build" cmake --build build -j "$(nproc)"
else
  step "build" cmake --build build -j "$(nproc)" --target q4train q4chat q4eval
fi
